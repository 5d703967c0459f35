"""The speculators peer of ``launch.bench.peers`` (launch/bench/peers/speculators.py): the files it writes for
speculators 0.9.0, the budget arithmetic, and, under ``-m reference`` with launch/setup_peers.sh's .peers/, its
prepared rows and features read back by speculators' own data loading, and two steps of ``speculators train`` on a
tiny target whose checkpoint our evaluator loads as it is."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launch.bench.peers.common import PEERS_DIR, Budget, DraftShape, PeerJob, TrainingRow
from launch.bench.peers.speculators import (
    Layout,
    Probe,
    Speculators,
    env,
    saved_checkpoints,
    step_seconds,
    validation_ratio,
    write_hidden_states,
    write_rows,
)

LAYERS = [1, 3]
NUM_LAYERS = 6
HIDDEN = 32
needs_peers = pytest.mark.skipif(
    not (PEERS_DIR / "speculators").is_dir(), reason="speculators is not in .peers: run launch/setup_peers.sh"
)


def test_a_rows_features_are_its_tokens_and_its_layers_in_bf16(tmp_path):
    row = TrainingRow([5, 6, 7], [0, 1, 1])
    features = torch.randn(3, len(LAYERS) + 1, HIDDEN)
    size = write_hidden_states(tmp_path / "hs_0.safetensors", row, features)
    saved = load_file(tmp_path / "hs_0.safetensors")
    assert size == (tmp_path / "hs_0.safetensors").stat().st_size
    assert set(saved) == {"token_ids", "hidden_states"}
    assert saved["token_ids"].dtype == torch.long and saved["token_ids"].tolist() == [5, 6, 7]
    assert saved["hidden_states"].dtype == torch.bfloat16
    assert torch.equal(saved["hidden_states"], features.to(torch.bfloat16))


def test_a_rows_file_holds_its_own_features_not_the_whole_batch(tmp_path):
    """The capture hands out views of one batch's features (bf16 already on a GPU: no copy is made)."""
    batch = torch.randn(1000, len(LAYERS) + 1, HIDDEN).to(torch.bfloat16)
    size = write_hidden_states(tmp_path / "hs_0.safetensors", TrainingRow([1] * 10, [1] * 10), batch[100:110])
    assert size < 10 * (len(LAYERS) + 1) * HIDDEN * 2 + 1024
    assert torch.equal(load_file(tmp_path / "hs_0.safetensors")["hidden_states"], batch[100:110])


def test_features_of_another_length_are_refused(tmp_path):
    with pytest.raises(ValueError, match="3 tokens"):
        write_hidden_states(tmp_path / "hs_0.safetensors", TrainingRow([1, 2, 3], [1, 1, 1]), torch.zeros(2, 3, 4))
    assert not (tmp_path / "hs_0.safetensors").exists()


def test_rows_become_speculator_format_records(tmp_path):
    rows = [TrainingRow([1, 2, 3], [0, 1, 1]), TrainingRow([9, 8], [1, 1])]
    write_rows(tmp_path / "rows.jsonl", rows)
    records = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert records == [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": [9, 8], "loss_mask": [1, 1]}]


def test_the_validation_split_is_exactly_the_last_row():
    for rows in range(2, 5000):
        ratio = validation_ratio(rows)
        assert 0 < ratio < 1 and int(rows * ratio) == rows - 1  # speculators' own cut (train/data.py)
    with pytest.raises(ValueError, match="at least 2 rows"):
        validation_ratio(1)


def test_its_loss_is_the_eager_one_on_a_card_as_on_the_cpu(monkeypatch, tmp_path):
    """Its fused Triton loss stops its compiled step at the first step under torch 2.11 (the module's docstring);
    only the CPU's own options (attention, dtype, workers, and past the smoke the optimizer) depend on the machine."""
    layout = Layout(rows=[], epochs=[[(4, 512)]], ratio=0.5)
    for card in (True, False):
        monkeypatch.setattr(torch.accelerator, "is_available", lambda card=card: card)
        args = Speculators().train_args(tmp_path, tmp_path / "target", layout, 1, 10)
        assert args[args.index("--loss-implementation") + 1] == "eager"
        assert args.count("--loss-implementation") == 1
        assert ("--draft-attn-impl" in args) is not card
        assert args[args.index("--optimizer") + 1] == ("muon" if card else "adamw")
        smoke = Speculators(smoke=True).train_args(tmp_path, tmp_path / "target", layout, 1, 10)
        assert smoke[smoke.index("--optimizer") + 1] == "muon"  # the smoke's tiny drafter trains with its recipe


def test_the_epochs_that_hold_the_steps_and_what_they_trained():
    layout = Layout([], [[(2, 100), (1, 60)], [(3, 150)], [(1, 10), (1, 20)]], 0.9)
    assert [layout.epochs_for(steps) for steps in (1, 2, 3, 4, 5)] == [1, 1, 2, 3, 3]
    assert layout.trained(3) == (6, 310) and layout.trained(5) == (8, 340)
    with pytest.raises(ValueError, match="more than the 3 epochs"):
        layout.epochs_for(6)


def test_step_times_are_read_from_its_metric_lines():
    log = (
        "[21:40:01] INFO     train/loss=2.522, profile/fetch_ms=1.2, profile/step_ms=1.25e+03, global_step=0\n"
        "           INFO     train/loss=2.4, profile/step_ms=812.500, profile/tokens_per_s=80.6, global_step=1\n"
        "           INFO     val/loss_epoch=2.522, epoch=0\n"
    )
    assert step_seconds(log) == [1.25, 0.8125]


def test_only_finished_epoch_checkpoints_count(tmp_path):
    for name, step in (("0", 40), ("1", 80), ("interrupted", 95)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "training_state.json").write_text(json.dumps({"epoch": 0, "global_step": step}))
    (tmp_path / "2").mkdir()  # a save the deadline cut before its training state
    found = saved_checkpoints(tmp_path)
    assert [(steps, folder.name) for steps, folder, _ in found] == [(40, "0"), (80, "1")]


def test_the_plan_fills_the_time_left_with_steps_and_a_save_each_epoch():
    probe = Probe(step_s=0.5, startup_s=20.0, save_s=2.0)
    steps = probe.steps_for(240.0, steps_per_epoch=40)
    epochs = -(-steps // 40)
    assert 20.0 + steps * 0.5 + (epochs - 1) * 2.0 <= 240 * 0.98 < 20.0 + (steps + 2) * 0.5 + epochs * 2.0
    assert Probe(step_s=0.5, startup_s=20.0, save_s=0.0).steps_for(240.0, 40) == int((240 * 0.98 - 20) / 0.5)
    assert Probe(step_s=10.0, startup_s=300.0, save_s=1.0).steps_for(240.0, 40) == 1


# ---- reference: speculators itself, from .peers (launch/setup_peers.sh) ----


def tiny_target(folder: Path) -> torch.nn.Module:
    """A random tiny Qwen3 with a byte-level tokenizer saved beside it (prepare-data loads one)."""
    from tests.drafter_fixtures import tiny_qwen3_target
    from tests.test_data_sources import tiny_tokenizer

    tokenizer = tiny_tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    model = tiny_qwen3_target(folder, vocab_size=len(tokenizer), num_layers=NUM_LAYERS, hidden=HIDDEN)
    tokenizer.save_pretrained(folder)
    return model


class PlainCapture:
    """A FeatureCapture by plain transformers forwards, one row at a time: HF ``hidden_states[k + 1]`` for layer k,
    and layer L - 1 taken before the final norm (a hook on the last decoder layer)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    @torch.no_grad()
    def __call__(self, rows: Sequence[TrainingRow], layers: Sequence[int]) -> Iterator[tuple[int, torch.Tensor]]:
        for index in reversed(range(len(rows))):  # any order
            yield index, self.features(rows[index].input_ids, layers)

    def features(self, input_ids: list[int], layers: Sequence[int]) -> torch.Tensor:
        last = []
        hook = self.model.model.layers[-1].register_forward_hook(lambda _m, _i, out: last.append(out))
        try:
            out = self.model(torch.tensor([input_ids]), output_hidden_states=True)
        finally:
            hook.remove()
        pre_norm = last[0][0] if isinstance(last[0], tuple) else last[0]
        picked = [pre_norm.reshape(-1, HIDDEN) if k == NUM_LAYERS - 1 else out.hidden_states[k + 1][0] for k in layers]
        return torch.stack(picked, dim=1).to(torch.bfloat16)


def random_rows(count: int, vocab: int, seed: int = 0) -> list[TrainingRow]:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        length = int(torch.randint(20, 60, (1,), generator=generator))
        ids = torch.randint(0, vocab - 2, (length,), generator=generator).tolist()
        rows.append(TrainingRow(ids, [0] * (length // 3) + [1] * (length - length // 3)))
    return rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[torch.nn.Module, DraftShape]:
    """The tiny target and the drafter shape our exporter writes for it (2 layers, block 4, target layers 1, 3)."""
    from common.drafter.export import export_speculators, export_zlab
    from common.drafter.model import DFlashDrafter
    from producer.target_model.load import target_head_of
    from tests.drafter_fixtures import tiny_config

    folder = tmp_path_factory.mktemp("tiny")
    model = tiny_target(folder / "target")
    config = tiny_config(
        vocab_size=model.config.vocab_size, mask_token_id=model.config.vocab_size - 1, target_layer_ids=LAYERS
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, target_head_of(model))
    shape = DraftShape(
        config=config,
        zlab_dir=export_zlab(drafter, folder / "zlab"),
        speculators_dir=export_speculators(
            drafter, folder / "speculators", str(folder / "target"), ["Qwen3ForCausalLM"]
        ),
        target_dir=folder / "target",
        num_target_layers=NUM_LAYERS,
    )
    return model, shape


READ_BACK = """
import json, sys, torch
from speculators.train.data import ArrowDataset
data, out = sys.argv[1:3]
train = ArrowDataset(max_len=4096, datapath=data, on_missing="raise", train_ratio=float(sys.argv[3]))
val = ArrowDataset(max_len=4096, datapath=data, on_missing="raise", train_ratio=float(sys.argv[3]), split="val")
items = [train[i] for i in range(len(train))] + [val[i] for i in range(len(val))]
torch.save(items, out)
"""


@pytest.mark.reference
@needs_peers
def test_prepared_rows_and_features_read_back_through_speculators_own_loader(tmp_path, tiny):
    """prepare-data shuffles the rows; the features must follow its order. speculators' ArrowDataset (the one its
    trainer reads) gives every row back with its own tokens, loss mask and features: the target layers side by
    side, and the last layer before the norm as the verifier's last hidden state."""
    from launch.bench.peers.speculators import dump

    model, draft = tiny
    rows = random_rows(9, model.config.vocab_size)
    peer = Speculators(token_budget=128, anchors=8, max_len=1024, smoke=True)
    log = tmp_path / "log"
    data, layout = peer.prepare(tmp_path, rows, draft, log)
    assert sorted(map(tuple, (r.input_ids for r in layout.rows))) == sorted(tuple(r.input_ids) for r in rows)
    assert [r.input_ids for r in layout.rows] != [r.input_ids for r in rows]  # shuffled: the order is its own
    capture = PlainCapture(model)
    dump(data / "hidden_states", layout.rows, capture, [*LAYERS, NUM_LAYERS - 1])
    out = tmp_path / "items.pt"
    command = [sys.executable, "-c", READ_BACK, str(data), str(out), repr(layout.ratio)]
    subprocess.run(command, env=env(), check=True, capture_output=True)
    items = torch.load(out)
    assert len(items) == len(rows)
    for row, item in zip(layout.rows, items, strict=True):
        expected = capture.features(row.input_ids, [*LAYERS, NUM_LAYERS - 1])
        assert item["input_ids"].tolist() == row.input_ids and item["loss_mask"].tolist() == row.loss_mask
        assert torch.equal(item["hidden_states"], expected[:, :-1].flatten(1))
        assert torch.equal(item["verifier_last_hidden_states"], expected[:, -1])


@pytest.mark.reference
@needs_peers
def test_two_steps_of_speculators_train_and_our_evaluator_loads_its_checkpoint(tmp_path, tiny, capsys):
    """``speculators train`` itself, two steps on the CPU, from our exporter's config; the checkpoint folder it
    saves is what the peer returns, and ``launch.evaluate`` decodes with it as it is."""
    from common.config import load_config, save_config
    from launch.evaluate import main

    model, draft = tiny
    rows = random_rows(12, model.config.vocab_size, seed=1)
    peer = Speculators(token_budget=128, anchors=8, max_len=1024, smoke=True)
    assert peer.missing() is None
    result = peer.run(
        PeerJob(tmp_path / "work", rows, PlainCapture(model), draft, Budget(seconds=600), tmp_path / "log")
    )
    assert result.steps == 2 and result.export == tmp_path / "work" / "save" / "0"
    config = json.loads((result.export / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == draft.config.block_size
    assert config["aux_hidden_state_layer_ids"] == [k + 1 for k in LAYERS]
    assert 0 < result.samples_trained < len(rows) and result.tokens_trained > result.samples_trained
    features = sum(p.stat().st_size for p in (tmp_path / "work" / "data" / "hidden_states").iterdir())
    assert result.disk_bytes >= features >= sum(len(r.input_ids) for r in rows) * (len(LAYERS) + 1) * HIDDEN * 2
    assert result.peak_gpu_bytes is None and result.dump_s > 0 and result.train_s > 0
    run = tmp_path / "run.toml"
    overrides = ["data.num_samples=20", "data.mean_len=48", "data.min_len=24", "data.max_seq_len=96"]
    overrides += ["eval.num_prompts=3", "eval.max_new_tokens=24", "target.dtype=float32"]
    save_config(load_config(None, [*overrides, f"target.path={json.dumps(str(draft.target_dir))}"]), run)
    assert main(["--checkpoint", str(result.export), "--config", str(run), "--device", "cpu"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["num_prompts"] == 3 and printed["generated_tokens"] == 3 * 24 and printed["tau"] >= 1.0
