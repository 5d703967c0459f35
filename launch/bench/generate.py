"""Generation throughput: the static-cache engine (producer/target_model/generator.py) against plain ``model.generate``.

Both continue the same random prompts greedily in batches of ``--rows``, every prompt for exactly
``--max-new-tokens`` new tokens: EOS is ignored by both (plain generate under a blank generation config,
no EOS, min_new_tokens = max_new_tokens; the engine with no stop ids), so they do the same work. New tokens per second count
generation only; the warm-ups (plain: one short generate; the engine: capturing its CUDA graphs) are
timed separately and shown. ``agree`` is the share of prompts whose first 16 new tokens are the same from
both (1.0 in float32; bf16 lets near-ties of random weights go either way).

    python -m launch.bench.generate --model smollm2 --rows 256 --prompts 512       # H200, random weights
    python -m launch.bench.generate --model qwen3-8b --rows 256 --prompts 512
    python -m launch.bench.generate --model qwen3-8b --path /models/Qwen3-8B      # stored weights (or a .gguf)
    OMP_NUM_THREADS=1 python -m launch.bench.generate --model tiny --device cpu --dtype float32 --rows 8 \\
        --prompts 24 --max-new-tokens 32                                             # CPU smoke run, seconds

On a CPU shared with other work keep OMP_NUM_THREADS=1: with two contended threads plain generate's small
matmuls took 40x longer (48 ms a step of the tiny model, against 1.3 ms), which no engine should take credit for.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from launch.bench.harness import (
    TARGET_SHAPES,
    Table,
    add_device_argument,
    add_json_argument,
    emit,
    gpu_name,
    synchronize,
)
from producer.target_model.generation import GenerationConfig, Request
from producer.target_model.generator import Generator

AGREEMENT_TOKENS = 16


def build_model(name: str, path: str | None, dtype: torch.dtype, device: torch.device, seed: int) -> nn.Module:
    """The model from ``path`` (a Hugging Face folder or a .gguf file), else random weights of shape ``name``,
    made on the device directly."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if path is not None:
        where = Path(path)
        source = (
            {"pretrained_model_name_or_path": where.parent, "gguf_file": where.name}
            if where.suffix == ".gguf"
            else {"pretrained_model_name_or_path": where}
        )
        model = AutoModelForCausalLM.from_pretrained(**source, dtype=dtype, attn_implementation="sdpa").to(device)
    else:
        fields = dict(TARGET_SHAPES[name])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        config._attn_implementation = "sdpa"
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=generator).tolist()


@torch.no_grad()
def plain_generate(
    model: nn.Module, prompts: list[list[int]], rows: int, new_tokens: int, device: torch.device
) -> tuple[list[list[int]], dict[str, Any]]:
    """``model.generate`` on batches of ``rows`` prompts (all of one length, so no padding).

    Under a blank generation config: the model's own EOS would end rows early, and suppressing it (what
    min_new_tokens does alone) would change the tokens wherever it is the argmax; its penalties or sampling
    defaults would add work the engine does not do.
    """
    from transformers import GenerationConfig as HFGenerationConfig

    pad = model.config.pad_token_id if isinstance(model.config.pad_token_id, int) else 0

    def run(batch: list[list[int]], tokens: int) -> list[list[int]]:
        ids = torch.tensor(batch, device=device)
        settings = HFGenerationConfig(do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=pad)
        saved, model.generation_config = model.generation_config, HFGenerationConfig()
        try:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=settings)
        finally:
            model.generation_config = saved
        return out[:, ids.shape[1] :].tolist()

    started = time.perf_counter()
    run(prompts[:rows], 2)
    synchronize(device)
    warmup = time.perf_counter() - started
    outputs: list[list[int]] = []
    started = time.perf_counter()
    for first in range(0, len(prompts), rows):
        outputs += run(prompts[first : first + rows], new_tokens)
    synchronize(device)
    seconds = time.perf_counter() - started
    batches = -(-len(prompts) // rows)
    return outputs, {
        "engine": "transformers-generate",
        "new_tokens": sum(map(len, outputs)),
        "seconds": seconds,
        "steps": batches * new_tokens,
        "occupancy": len(prompts) / (batches * rows),
        "warmup_seconds": warmup,
    }


def engine_generate(
    model: nn.Module, prompts: list[list[int]], rows: int, new_tokens: int, device: torch.device, cuda_graph: bool
) -> tuple[list[list[int]], dict[str, Any]]:
    """The static-cache engine on the same prompts, greedy, no stop ids."""
    config = GenerationConfig(
        max_new_tokens=new_tokens, rows=rows, max_prompt_tokens=max(map(len, prompts)), cuda_graph=cuda_graph
    )
    generator = Generator(model, config)
    warmup = generator.warm_up()
    synchronize(device)
    started = time.perf_counter()
    results = {
        finished.key: finished.new_ids
        for finished in generator.generate(Request(i, prompt) for i, prompt in enumerate(prompts))
    }
    synchronize(device)
    seconds = time.perf_counter() - started
    stats = generator.stats
    label = generator.engine + (
        " (CUDA graphs)" if generator.uses_cuda_graphs else " (eager)" if generator.engine == "static-cache" else ""
    )
    return [results[i] for i in range(len(prompts))], {
        "engine": label,
        "new_tokens": stats.new_tokens,
        "seconds": seconds,
        "steps": stats.decode_steps,
        "occupancy": stats.occupancy,
        "warmup_seconds": warmup,
        "prefill_forwards": stats.prefill_forwards,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    prompt_count = args.prompts or 2 * args.rows

    model = build_model(args.model, args.path, dtype, device, args.seed)
    prompts = random_prompts(prompt_count, args.prompt_len, model.config.vocab_size, args.seed)
    plain_ids, plain = plain_generate(model, prompts, args.rows, args.max_new_tokens, device)
    engine_ids, engine = engine_generate(model, prompts, args.rows, args.max_new_tokens, device, not args.eager)
    agree = sum(a[:AGREEMENT_TOKENS] == b[:AGREEMENT_TOKENS] for a, b in zip(plain_ids, engine_ids)) / prompt_count

    print(
        f"{args.model}{' from ' + args.path if args.path else ' (random weights)'} on {device} in {args.dtype}: "
        f"{prompt_count} prompts of {args.prompt_len} tokens, {args.max_new_tokens} new tokens each, rows {args.rows}"
    )
    print_runs([plain, engine])
    result = {
        "model": args.model,
        "path": args.path,
        "device": str(device),
        "gpu": gpu_name(device),
        "dtype": args.dtype,
        "rows": args.rows,
        "prompts": prompt_count,
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens,
        "plain": plain,
        "engine": engine,
        "ratio": engine["tokens_per_s"] / plain["tokens_per_s"],
        f"agree_first_{AGREEMENT_TOKENS}": agree,
    }
    emit(result, args.json)
    return result


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        choices=sorted(TARGET_SHAPES),
        default="smollm2",
        help="shape of the random weights (a label only with --path)",
    )
    parser.add_argument("--path", help="a Hugging Face model folder or a .gguf file instead of random weights")
    parser.add_argument("--rows", type=int, default=256, help="batch of plain generate = the engine's static rows")
    parser.add_argument("--prompts", type=int, help="prompts to continue (default 2 x rows)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    add_device_argument(parser)
    parser.add_argument("--eager", action="store_true", help="the engine without CUDA graphs")
    parser.add_argument("--seed", type=int, default=0)
    add_json_argument(parser)
    return parser.parse_args(argv)


def print_runs(runs: list[dict]) -> None:
    """The table; each run gets its new tokens per second."""
    table = Table(
        [
            ("engine", "36s"),
            ("new tok/s", "10.0f"),
            ("seconds", "8.2f"),
            ("steps", "6d"),
            ("occupancy", "9.3f"),
            ("warm-up s", "9.2f"),
        ]
    )
    print(table.header())
    for run in runs:
        run["tokens_per_s"] = run["new_tokens"] / run["seconds"]
        cells = (run["tokens_per_s"], run["seconds"], run["steps"], run["occupancy"], run["warmup_seconds"])
        print(table.row(run["engine"], *cells))


if __name__ == "__main__":
    main()
