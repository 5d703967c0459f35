"""The served check: one export, one real server, the same prompts on every side (see the package's docstring)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from launch.bench.harness import emit
from launch.bench.served.schedule import Difference, PromptRun, Side, compare, failures, summary_of, table

SERVERS = ("llamacpp", "vllm")


class CannotRun(Exception):
    """The check cannot run as asked (exit 2): the message is the one line the user reads."""


@dataclass
class Request:
    server: str
    target_dir: Path
    draft: Path
    prompts: list[list[int]]
    max_new_tokens: int
    dtype: str
    live: bool
    zlab: bool
    block_size: int | None
    log_file: Path | None
    threads: int
    server_timeout_s: float
    confidence_min: float = 0.0
    """The confidence cut of every side: llama-server's ``--spec-draft-p-min`` and our ``eval.confidence_min`` (a
    drafter with a confidence head only; 0: none)."""


def resolve_target(target: str) -> Path:
    """A Hugging Face folder as given, or a GGUF file's dequantized folder (common/gguf.py, converted once)."""
    path = Path(target)
    if path.is_file() and path.suffix == ".gguf":
        from common.gguf import dequantized_folder

        return dequantized_folder(path)
    if not (path / "config.json").is_file():
        raise CannotRun(f"--target {target}: neither a Hugging Face folder (no config.json) nor a .gguf file")
    return path.resolve()  # the server runs in a folder of its own: a relative path would be looked up on a hub


def export_of(draft: Path) -> tuple[Path, dict]:
    """(the folder holding the drafter's config.json: an export, or a checkpoint's drafter/; that config)."""
    from common.drafter.export import drafter_folder
    from common.llamacpp import DRAFT_FILE

    folder, _ = drafter_folder(draft)
    if (draft / DRAFT_FILE).is_file():
        raise CannotRun(
            f"--draft {draft}: a GGUF export; the check converts the drafter itself: give its z-lab export or its "
            "checkpoint (the GGUF export's llama-server line serves it, and --url measures that server)"
        )
    if not (folder / "config.json").is_file():
        raise CannotRun(f"--draft {draft}: no config.json (export it with python -m trainer.export)")
    return folder, json.loads((folder / "config.json").read_text())


def kind_and_block(config_json: dict, server: str, asked_block: int | None):
    """The export's kind and block size, or CannotRun where the server cannot serve it or the block size given
    contradicts the export's."""
    from common.drafter.kinds import kind_of_export

    kind = kind_of_export(config_json)
    if kind is None:
        raise CannotRun("--draft: config.json is no DFlash-family export of either format")
    block_size = int(config_json["block_size"])
    if asked_block is not None and asked_block != block_size:
        raise CannotRun(
            f"--block-size {asked_block} contradicts the export's block_size {block_size}: a server told another "
            "block size drafts the wrong number of tokens (DFlash 2's convolutions misplaced without an error)"
        )
    if server == "vllm" and not kind.vllm_cpu:
        raise CannotRun(f"vLLM's CPU build does not serve {kind.name} drafters (served on GPUs only): use llamacpp")
    if server == "llamacpp":
        if kind.llamacpp_spec_type is None:
            raise CannotRun(f"llama.cpp does not serve {kind.name} drafters")
        if "speculators_model_type" in config_json and kind.llamacpp_format != "speculators":
            raise CannotRun(
                f"llama.cpp's converter reads {kind.name} drafters in the z-lab format only: export with --format zlab"
            )
        if kind.llamacpp_refusal is not None:
            from common.drafter.export import config_from_export

            refusal = kind.llamacpp_refusal(config_from_export(config_json, own_checkpoint=True))
            if refusal is not None:
                raise CannotRun(refusal)
    return kind, block_size


def preflight(server: str) -> None:
    """CannotRun, before anything is loaded, where the server is not set up on this machine."""
    if server == "llamacpp":
        from common.llamacpp import LlamaCppMissing, converter_ready, server_binary

        try:
            server_binary()
            converter_ready()
        except LlamaCppMissing as error:
            raise CannotRun(str(error)) from None
    else:
        from launch.bench.served import vllm_worker

        if not vllm_worker.VLLM_PYTHON.is_file():
            raise CannotRun(f"no vLLM venv at {vllm_worker.VLLM_PYTHON}: run launch/setup_vllm.sh")


def stop_token_ids(target_dir: Path, model) -> list[int]:
    """What a server stops at: the target config's end-of-sequence ids and its generation config's."""
    from producer.target_model.load import stop_tokens_of

    stops = set(stop_tokens_of(model))
    generation = target_dir / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        stops |= set([] if eos is None else eos if isinstance(eos, list) else [eos])
    return sorted(stops)


def converter_source(draft: Path, config_json: dict, kind, target_dir: Path, scratch: Path) -> Path:
    """The drafter (an export or a checkpoint) in the export format llama.cpp's converter reads for its kind
    (``kind.llamacpp_format``; DSpark: speculators' names and config keys): its own folder where it is one, else that
    format written into ``scratch`` (fp32, the verifier named by its folder, as ``trainer.export --format gguf``
    writes it; the tensor names are the same in both formats)."""
    import torch
    from safetensors.torch import load_file

    from common.drafter.export import (
        WEIGHTS_FILE,
        config_from_export,
        drafter_folder,
        speculators_config,
        write_export,
        zlab_config,
    )

    draft_folder, own_checkpoint = drafter_folder(draft)
    is_speculators = "speculators_model_type" in config_json
    if is_speculators == (kind.llamacpp_format == "speculators"):
        return draft_folder
    config = config_from_export(config_json, own_checkpoint=own_checkpoint)
    if kind.llamacpp_format == "speculators":
        written = speculators_config(config, str(target_dir), None, torch.float32)
    else:
        written = zlab_config(config, torch.float32)
    weights = load_file(str(draft_folder / WEIGHTS_FILE))
    return write_export(written, weights, scratch / kind.llamacpp_format, torch.float32)


def llamacpp_side(request: Request, config_json: dict, kind, block_size: int, scratch: Path, stops: set[int]):
    """Start llama-server with the draft's GGUF (converted from the format its converter reads for the kind) and
    decode every prompt; returns a function that, given the stop tokens, makes its side (the server's own
    end-of-generation tokens are learnt first, as ``stops``)."""
    from common.acceptance.arithmetic import cut_answer
    from common.llamacpp import (
        ConversionError,
        LlamaCppMissing,
        convert,
        readable_tokenizer_folder,
        server_binary,
        target_gguf,
    )
    from launch.bench.served.llamacpp import LlamaServer, ServerError

    try:
        binary = server_binary()
        target_file = target_gguf(request.target_dir)
        readable = readable_tokenizer_folder(request.target_dir, scratch / "target")
        source = converter_source(request.draft, config_json, kind, request.target_dir, scratch)
        draft_file = convert(source, scratch / "draft.gguf", "f32", target_dir=readable)
    except (LlamaCppMissing, ConversionError) as error:
        raise CannotRun(str(error)) from None
    log_file = request.log_file or scratch / "llama-server.log"
    started = time.perf_counter()
    raw = []
    try:
        with LlamaServer(binary, target_file, draft_file, block_size, log_file, threads=request.threads,
                         context=max(map(len, request.prompts)) + request.max_new_tokens + 4 * block_size,
                         start_timeout_s=request.server_timeout_s, spec_type=kind.llamacpp_spec_type,
                         p_min=request.confidence_min) as server:  # fmt: skip
            stops |= set(server.eog_tokens())
            for ids in request.prompts:
                # B - 1 tokens further than the answer: no block inside it is shortened (see schedule.py)
                raw.append(server.complete(ids, request.max_new_tokens + block_size - 1))
            metrics = server.metrics()
    except ServerError as error:
        raise CannotRun(f"llama-server: {error.reason} (log: {log_file})") from None
    seconds = time.perf_counter() - started

    def side(stop_ids: list[int]) -> Side:
        runs = [
            PromptRun(cut_answer(tokens, request.max_new_tokens, frozenset(stop_ids)), accepted, drafted)
            for tokens, accepted, drafted in raw
        ]
        made = Side("llama.cpp", runs, block_size, seconds=seconds)
        made.notes["server_counters"] = server_counters(metrics)
        return made

    return side


def server_counters(metrics: str) -> dict:
    """The server's own speculative-decoding counters over the whole check (it ran B - 1 tokens further)."""
    from launch.bench.served.measure import parse_metrics, spec_counters

    return spec_counters(parse_metrics(metrics))


def vllm_side(request: Request, draft_folder: Path, block_size: int, stops: list[int]) -> Side:
    from launch.bench.served import vllm_worker

    payload = {
        "target": str(request.target_dir),
        "draft": str(draft_folder),
        "num_speculative_tokens": block_size - 1,
        "dtype": request.dtype,
        "max_new_tokens": request.max_new_tokens,
        "stop_token_ids": stops,
        "prompts": request.prompts,
        # a short context keeps vLLM's KV cache small: the longest prompt, its new tokens and two blocks of slack
        "max_model_len": max(map(len, request.prompts)) + request.max_new_tokens + 2 * block_size,
    }
    try:
        served = vllm_worker.run_vllm(vllm_worker.VLLM_PYTHON, payload, request.server_timeout_s, request.log_file)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        reason = next((ln.strip() for ln in reversed(str(error).splitlines()) if "Error" in ln), str(error)[:300])
        raise CannotRun(f"vLLM did not serve the drafter: {reason}") from None
    reported = {key: served[key] for key in ("drafts", "draft_tokens", "accepted_per_pos")}
    runs = [PromptRun(tokens, None) for tokens in served["tokens"]]
    side = Side("vLLM", runs, block_size, reported=reported, seconds=served["wall_seconds"])
    side.notes["version"] = served.get("vllm_version")
    return side


def run_check(request: Request) -> tuple[list[Side], dict[str, list[Difference]], dict]:
    """Every side of the check and how each differs from our evaluator."""
    from launch.bench.served import ours

    draft_folder, config_json = export_of(request.draft)
    kind, block_size = kind_and_block(config_json, request.server, request.block_size)
    preflight(request.server)
    loaded = ours.load(request.target_dir, request.draft, request.dtype)
    if request.confidence_min > 0:
        if request.server != "llamacpp":
            raise CannotRun("--confidence-min: this check passes a confidence cut to llama.cpp only")
        if not ours.has_confidence(loaded):
            raise CannotRun(
                f"--confidence-min: this {kind.name} drafter has no confidence head (llama.cpp's --spec-draft-p-min "
                "would cut its blocks by another rule than our decoders' eval.confidence_min)"
            )
    zlab_skipped = None
    if request.zlab and not ours.zlab_serves(loaded):
        zlab_skipped = f"z-lab's dflash_generate has no {kind.zlab_architecture} ({kind.name} drafters): left out"
    stops = set(stop_token_ids(request.target_dir, loaded.model))
    with tempfile.TemporaryDirectory(prefix="served-") as scratch:
        if request.server == "llamacpp":
            make_side = llamacpp_side(request, config_json, kind, block_size, Path(scratch), stops)  # learns its stops
            stop_ids = sorted(stops)
            served_side = make_side(stop_ids)
        else:
            stop_ids = sorted(stops)
            served_side = vllm_side(request, draft_folder, block_size, stop_ids)
    evaluator, live, _ = ours.evaluator_and_live(
        loaded, request.prompts, request.max_new_tokens, stop_ids, request.live, request.confidence_min
    )
    sides = [served_side, evaluator] + ([live] if live is not None else [])
    if request.zlab and zlab_skipped is None:
        sides.append(ours.zlab_side(loaded, request.prompts, request.max_new_tokens, stop_ids, request.dtype))
    margin_at = ours.margin_function(loaded, request.prompts, evaluator)
    cut_margin_at = None
    if request.confidence_min > 0:
        cut_margin_at = ours.cut_margin_function(loaded, request.prompts, evaluator, request.confidence_min)
    differences = {
        side.name: compare(evaluator, side, margin_at, cut_margin_at=cut_margin_at)
        for side in sides
        if side is not evaluator
    }
    facts = {
        "kind": kind.name,
        "block_size": block_size,
        "stop_token_ids": stop_ids,
        "confidence_min": request.confidence_min,
        "load_seconds": loaded.seconds,
    }
    if zlab_skipped is not None:
        facts["zlab"] = zlab_skipped
    return sides, differences, facts


def per_prompt_lines(sides: list[Side], evaluator: Side) -> str:
    """One line a prompt: its answer's length, our verify forwards and accepted drafts on the schedule, and the sides
    whose tokens or steps differ from ours there."""
    from launch.bench.served.schedule import lengths_of

    lines = ["per prompt (ours on the schedule; the sides that differ):"]
    for p, run in enumerate(evaluator.runs):
        lengths = lengths_of(run)
        differing = [
            side.name
            for side in sides
            if side is not evaluator
            and (
                side.runs[p].tokens != run.tokens
                or (side.runs[p].accepted is not None and lengths_of(side.runs[p]) != lengths)
                or (
                    side.runs[p].drafted is not None
                    and run.drafted is not None
                    and side.runs[p].drafted[: len(lengths)] != run.drafted[: len(lengths)]
                )
            )
        ]
        lines.append(
            f"  prompt {p:3d}: {len(run.tokens):4d} tokens, {len(lengths):4d} verify forwards, "
            f"{sum(lengths) - len(lengths):4d} accepted drafts; {'differ: ' + ', '.join(differing) if differing else 'all equal'}"
        )
    return "\n".join(lines)


def report(request: Request, sides: list[Side], differences: dict[str, list[Difference]], facts: dict) -> dict:
    evaluator = next(s for s in sides if s.name == "evaluator")
    print(
        f"{request.server}: target {request.target_dir}, draft {request.draft} ({facts['kind']}, block size "
        f"{facts['block_size']}); {len(request.prompts)} prompts, greedy, max_new_tokens {request.max_new_tokens}, "
        f"stop tokens {facts['stop_token_ids']}, {request.dtype}"
        + (f", confidence cut {request.confidence_min}" if request.confidence_min > 0 else "")
    )
    if "zlab" in facts:
        print(facts["zlab"])
    if evaluator.notes.get("cut_margin") is not None:
        print(
            f"confidence cut {request.confidence_min}: the nearest confidence that decided a block (ours) lies "
            f"{evaluator.notes['cut_margin']:.2e} from it"
        )
    print(table(sides, evaluator, differences))
    print(per_prompt_lines(sides, evaluator))
    found = [d for per in differences.values() for d in per]
    for difference in found:
        print(("  " if difference.target_split or difference.cut_tie else "  DIFFERENT ") + difference.describe())
    if not failures(found):
        print(
            "every side agrees with our evaluator" + (" (beside near-ties of the target or the cut)" if found else "")
        )
    per_prompt = [
        {
            "prompt": p,
            **{
                side.name: {"tokens": len(side.runs[p].tokens), "steps": None if side.runs[p].accepted is None
                            else len(side.runs[p].accepted), "same_tokens": side.runs[p].tokens == run.tokens}
                for side in sides
            },
        }
        for p, run in enumerate(evaluator.runs)
    ]  # fmt: skip
    return {
        "server": request.server,
        "target": str(request.target_dir),
        "draft": str(request.draft),
        "num_prompts": len(request.prompts),
        "max_new_tokens": request.max_new_tokens,
        **facts,
        "agrees": not failures(found),
        "differences": [d.describe() for d in found],
        "sides": {side.name: summary_of(side) for side in sides},
        "per_prompt": per_prompt,
    }


def main_check(args) -> int:
    from launch.bench.served.prompts import read_prompts

    try:
        target_dir = resolve_target(args.target)
        if args.prompts is not None:
            prompts = read_prompts(args.prompts, target_dir, args.num_prompts)
        else:
            from launch.bench.served.measure import held_out_records

            prompts = [r["prompt_token_ids"] for r in held_out_records(args.run_dir, args.num_prompts)]
        request = Request(
            args.server, target_dir, args.draft.resolve(), prompts, args.max_new_tokens, args.dtype, not args.no_live,
            not args.no_zlab, args.block_size, args.server_log, args.threads, args.server_timeout,
            args.confidence_min,
        )  # fmt: skip
        sides, differences, facts = run_check(request)
    except (CannotRun, OSError, ValueError) as error:
        print(f"served: {error}", file=sys.stderr)
        return 2
    summary = report(request, sides, differences, facts)
    emit(summary, args.json_out)
    return 0 if summary["agrees"] else 1
