"""vLLM's CPU build as a side of the served check: ``LLM(model=TARGET, speculative_config={"method": "dflash", "model":
DRAFT, "num_speculative_tokens": B - 1}, enforce_eager=True)`` in ``.venv-vllm`` (launch/setup_vllm.sh) as a
subprocess: this very file, run as a script there, so its top level imports nothing but the standard library. It
writes vLLM's counters ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens`` and ``..._num_accepted_tokens_per_pos``
and the generated tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


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
                [str(python), str(Path(__file__).resolve()), str(request_file), str(result_file)],
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


if __name__ == "__main__":
    # In the vLLM venv; the guard matters: vLLM spawns its engine, which imports this file again.
    vllm_worker(Path(sys.argv[1]), Path(sys.argv[2]))
