"""A run's keys never leave its secrets/: after a real run and its exports, no byte of its CURVE keys is in an export,
a model card, a printed line, wandb's files (its config included) or a log.

The run is the tiny default through launch/run_all.sh with producer 1 on "another host" over tcp (a folder of its own
holding copies of config.toml and secrets/curve.json), so that the trainer and that producer load the keys and use
them; wandb runs offline into the run's folder. Every file under the run's folder and the other host's but their
secrets/, the launcher's output and every export command's output are scanned for each key as Z85 (as the key file
holds it), raw bytes, hex, and base64, whole and by halves (a key cut short in a log line). The GGUF export needs
llama.cpp's converter (launch/setup_llamacpp.sh) and a target with a tokenizer it knows: it is the ``served`` test.
"""

from __future__ import annotations

import base64
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import zmq.utils.z85

from common.config import load_config, save_config
from common.rundir import RunDir
from common.sockets import CurveKeys
from tests.peers import wait_for
from tests.test_pipeline import SMALL, WANDB

ROOT = Path(__file__).resolve().parents[1]
RUN_ALL = str(ROOT / "launch" / "run_all.sh")
SETTINGS = [
    *SMALL,
    WANDB,
    "training.max_steps=8",
    "eval.every_steps=8",
    "eval.num_prompts=2",
    "eval.max_new_tokens=8",
    'launch.producer_devices=["cpu"]',  # producer 0 here, producer 1 on the other host
]
EXPORT_FILES = {"config.json", "model.safetensors", "README.md"}


def key_forms(keys: CurveKeys) -> dict[str, bytes]:
    """Each key as it could appear: Z85, raw bytes, hex (both cases), base64 (both alphabets), whole and by halves."""
    forms = {}
    for name, z85 in vars(keys).items():
        raw = zmq.utils.z85.decode(z85)
        encodings = {
            "z85": z85,
            "raw": raw,
            "hex": raw.hex().encode(),
            "HEX": raw.hex().upper().encode(),
            "base64": base64.b64encode(raw).rstrip(b"="),
            "base64url": base64.urlsafe_b64encode(raw).rstrip(b"="),
        }
        for encoding, value in encodings.items():
            half = len(value) // 2
            forms |= {f"{name} ({encoding})": value, f"{name} ({encoding}, first half)": value[:half]}
            forms[f"{name} ({encoding}, second half)"] = value[half:]
    return forms


def files_outside_secrets(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` but those under a secrets/ folder, by path."""
    return {
        str(path): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file() and "secrets" not in path.relative_to(root).parts
    }


def leaks(texts: dict[str, bytes], keys: CurveKeys) -> list[str]:
    """``where: which key in which form`` for every key form found in ``texts``."""
    forms = key_forms(keys)
    return [f"{where}: {form}" for where, data in texts.items() for form, value in forms.items() if value in data]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def finished_run(tmp: Path, *overrides: str) -> tuple[RunDir, Path, str]:
    """The tiny default run to its end (8 steps, one evaluation) with producer 1 on the other host over tcp, CURVE:
    (the run, the other host's folder, the launcher's output)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    run = RunDir(tmp / "run")
    run.create()  # as run_all.sh does: the folders and the run's CURVE keys
    settings = [*SETTINGS, *overrides, f'launch.remote_producers=["{endpoint}"]']
    save_config(load_config(ROOT / "launch" / "tiny.toml", settings), run.config)
    remote = tmp / "remote"
    (remote / "secrets").mkdir(parents=True, mode=0o700)
    shutil.copy2(run.config, remote / "config.toml")
    shutil.copy2(run.curve_keys, remote / "secrets" / "curve.json")
    command = [sys.executable, "-m", "producer.server", "--run-dir", str(remote), "--producer-id", "1"]
    with open(remote / "producer.log", "w") as log:
        producer = subprocess.Popen([*command, "--listen", endpoint], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:

        def ready() -> bool:
            log_text = (remote / "producer.log").read_text()
            assert producer.poll() is None, f"the remote producer exited:\n{log_text[-3000:]}"
            return "producer 1 ready" in log_text

        wait_for(ready, "the remote producer", 180)
        with open(tmp / "launcher.out", "w") as out:
            launcher = subprocess.Popen([RUN_ALL, "--run-dir", str(run.root)], cwd=ROOT, stdout=out, stderr=out)
        code = launcher.wait(timeout=300)
    finally:
        producer.send_signal(signal.SIGINT)
        producer.wait(timeout=60)
    output = (tmp / "launcher.out").read_text()
    assert code == 0, output[-3000:]
    assert "connected to producer 1 (pid" in (run.logs / "trainer.log").read_text(), "the keys were used over tcp"
    return run, remote, output


def export(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([RUN_ALL, "export", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)


def assert_a_unit(folder: Path, files: set[str], printed: str) -> None:
    """The export's folder holds its files and its card only, and both upload lines name that folder."""
    assert {p.name for p in folder.iterdir()} == files
    upload = f"huggingface-cli upload ORG/NAME {folder}"
    assert f"`{upload}`" in (folder / "README.md").read_text() and f"  {upload}\n" in printed


def test_the_scan_finds_a_key_in_every_form(tmp_path):
    """The scanner itself: the key file, and a key's hex, base64 and half a Z85 written elsewhere, are found."""
    from common.sockets import run_keys

    keys = run_keys(tmp_path / "secrets" / "curve.json")
    raw = zmq.utils.z85.decode(keys.client_secret)
    assert leaks(files_outside_secrets(tmp_path), keys) == []
    found = leaks({"key file": (tmp_path / "secrets" / "curve.json").read_bytes()}, keys)
    assert {f"key file: {name} (z85)" for name in vars(keys)} <= set(found)
    for planted, form in [
        (raw.hex().encode(), "client_secret (hex)"),
        (base64.b64encode(raw), "client_secret (base64)"),
        (b"log: key " + keys.server_secret[:20] + b"...", "server_secret (z85, first half)"),
        (b"\x00" + raw + b"\x00", "client_secret (raw)"),
    ]:
        assert f"log: {form}" in leaks({"log": planted}, keys), form


def test_no_key_byte_leaves_the_runs_secrets(short_tmp):
    """A real run and its z-lab and speculators exports (the one the run's last lines print, pasted as printed), and
    an export refused into the run's own folder: no key anywhere but secrets/, and each export a unit of its own."""
    run, remote, output = finished_run(short_tmp)
    printed = [output]
    line = next(line for line in output.splitlines() if " export --checkpoint " in line)
    done = subprocess.run(["bash", "-c", line], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    printed.append(done.stdout + done.stderr)
    assert_a_unit(run.root / "export", EXPORT_FILES, done.stdout)
    checkpoint = run.latest_checkpoint()
    speculators = run.root / "export-speculators"
    done = export("--checkpoint", str(checkpoint), "--out", str(speculators), "--format", "speculators",
                  "--verifier", "org/tiny-qwen3")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    printed.append(done.stdout + done.stderr)
    assert_a_unit(speculators, EXPORT_FILES, done.stdout)
    refused = export("--checkpoint", str(checkpoint), "--out", str(run.root))
    assert refused.returncode == 2 and f"--out {run.root} holds secrets, " in refused.stderr, refused.stderr
    printed.append(refused.stdout + refused.stderr)

    artifacts = files_outside_secrets(run.root) | files_outside_secrets(remote)
    # wandb's offline run holds its config (the run's whole config tree) in its run file, and logs it in debug.log
    wandb_run = next((p for p in artifacts if "/wandb/offline-run-" in p and p.endswith(".wandb")), None)
    assert wandb_run is not None and b"heartbeat_timeout_s" in artifacts[wandb_run], "wandb's config is scanned"
    assert any(p.endswith("logs/trainer.log") for p in artifacts) and any(p.endswith("producer.log") for p in artifacts)
    texts = artifacts | {f"printed {i}": text.encode() for i, text in enumerate(printed)}
    assert leaks(texts, CurveKeys.load(run.curve_keys)) == []


@pytest.mark.served
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_no_key_byte_in_a_gguf_export(short_tmp):
    """The GGUF export of a real run (its target a small model with SmolLM2's tokenizer, which llama.cpp's converter
    knows): a folder holding draft.gguf and its card only, and no key in it, in what it printed, or in the run."""
    from common.llamacpp import LlamaCppMissing, converter_ready
    from launch.bench.served.small_target import make_small_target
    from tests.real_model import smollm2_folder

    try:
        converter_ready()
    except LlamaCppMissing as missing:
        pytest.skip(str(missing))
    target = make_small_target(short_tmp / "target", smollm2_folder())
    overrides = (f"target.path={target}", "target.config_overrides={}", "drafter.target_layer_ids=[1, 2]")
    run, remote, output = finished_run(short_tmp, *overrides)
    out = short_tmp / "draft-gguf"
    done = export("--checkpoint", str(run.latest_checkpoint()), "--out", str(out), "--format", "gguf")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_a_unit(out, {"draft.gguf", "README.md"}, done.stdout)
    assert f"-md {out / 'draft.gguf'} " in done.stdout and "--port 8080 --metrics" in done.stdout
    texts = files_outside_secrets(run.root) | files_outside_secrets(remote) | files_outside_secrets(out)
    texts |= {"launcher": output.encode(), "export": (done.stdout + done.stderr).encode()}
    assert leaks(texts, CurveKeys.load(run.curve_keys)) == []
