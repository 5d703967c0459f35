"""Served measurement of a running server: a prompt set at a given concurrency through its OpenAI API, and what its own
Prometheus counters say of speculative decoding meanwhile.

    python -m launch.bench.served --url http://HOST:PORT --prompts PROMPTS.jsonl | --run-dir RUN \\
        [--num-prompts N] [--concurrency 8] [--max-new-tokens 256] [--temperature 0] [--json-out FILE]

Chat records go to ``/v1/chat/completions`` (the server applies the target's template), text prompts and token ids to
``/v1/completions``. ``/metrics`` is read before and after; the report is the difference:

  llama.cpp  ``llamacpp:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
             ``..._num_accepted_tokens_total``, ``..._num_accepted_tokens_per_pos_total{position}`` (``--metrics``);
  vLLM       ``vllm:spec_decode_num_drafts_total`` and the same three beside it;
  SGLang     ``sglang:spec_verify_calls_total`` and ``sglang:generation_tokens_total`` (no per-position counter;
             ``sglang:spec_accept_length`` is a gauge of its own recent window, reported as it reads).

Mean acceptance length is 1 + accepted drafts per verify forward (the target's token after them included); output
tokens/s is the answers' tokens (``usage.completion_tokens``) over the wall time of the whole set. llama.cpp counts
only the forwards that verified at least one draft: a DSpark server with a confidence cut (``--spec-draft-p-min``)
decodes a block cut to no draft as a plain token, which its counters leave out, so its mean acceptance length there is
over the forwards with a draft, above the served check's, which counts every forward.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
POSITION = re.compile(r'position="(\d+)"')
PREFIXES = {"llamacpp:": "llama.cpp", "vllm:": "vLLM", "sglang:": "SGLang"}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as ``{name{labels}: value}``, samples of the same name and labels summed (vLLM labels by model
    and engine); ``position`` is the one label kept."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        found = SAMPLE.match(line)
        if not found:
            continue
        name, labels, value = found.groups()
        position = POSITION.search(labels or "")
        key = f'{name}{{position="{position.group(1)}"}}' if position else name
        try:
            samples[key] = samples.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return samples


def server_of(samples: dict[str, float]) -> str | None:
    for prefix, name in PREFIXES.items():
        if any(key.startswith(prefix) for key in samples):
            return name
    return None


def spec_counters(samples: dict[str, float]) -> dict:
    """The server's speculative-decoding counters, named alike for every server (None where it has none)."""
    for prefix in ("llamacpp:", "vllm:"):
        drafts = samples.get(f"{prefix}spec_decode_num_drafts_total")
        if drafts is None:
            continue
        per_pos = {}
        for key, value in samples.items():
            if key.startswith(f"{prefix}spec_decode_num_accepted_tokens_per_pos_total"):
                per_pos[int(POSITION.search(key).group(1))] = value
        return {
            "drafts": drafts,
            "draft_tokens": samples.get(f"{prefix}spec_decode_num_draft_tokens_total", 0.0),
            "accepted": samples.get(f"{prefix}spec_decode_num_accepted_tokens_total", 0.0),
            "accepted_per_pos": [per_pos[k] for k in sorted(per_pos)],
        }
    if "sglang:spec_verify_calls_total" in samples:
        return {
            "drafts": samples["sglang:spec_verify_calls_total"],
            "generated": samples.get("sglang:generation_tokens_total", 0.0),
            "accept_length_gauge": samples.get("sglang:spec_accept_length"),
        }
    return {}


def difference(after: dict, before: dict) -> dict:
    """Counters over the measurement (gauges as they read after it)."""
    out = {}
    for key, value in after.items():
        if key == "accept_length_gauge":
            out[key] = value
        elif isinstance(value, list):
            old = before.get(key) or []
            out[key] = [v - (old[i] if i < len(old) else 0.0) for i, v in enumerate(value)]
        else:
            out[key] = value - before.get(key, 0.0)
    return out


class CannotMeasure(RuntimeError):
    """The server cannot be measured as it runs (no /metrics): the same on every try until it is restarted."""


def read_metrics(url: str) -> dict[str, float]:
    """The server's Prometheus counters; CannotMeasure where it serves none (llama-server answers 501 Not Implemented
    without ``--metrics``)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
            return parse_metrics(response.read().decode())
    except urllib.error.HTTPError as error:
        if error.code not in (404, 501):
            raise
        raise CannotMeasure(
            f"/metrics answered {error.code} {error.reason}: the server serves no metrics, and acceptance is "
            "read from its own counters. Restart it with them: llama-server --metrics (the line the export prints "
            "has it), SGLang --enable-metrics; vLLM serves them by default"
        ) from None


def model_name(url: str) -> str | None:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
            models = json.loads(response.read()).get("data") or []
        return models[0]["id"] if models else None
    except (OSError, ValueError, KeyError):
        return None


def send(url: str, model: str | None, record: dict, max_new_tokens: int, temperature: float) -> int:
    """One request; the answer's token count."""
    body = {"max_tokens": max_new_tokens, "temperature": temperature, **({"model": model} if model else {})}
    if "messages" in record:
        path, body["messages"] = "/v1/chat/completions", record["messages"]
    else:
        path, body["prompt"] = "/v1/completions", record.get("prompt", record.get("prompt_token_ids"))
    request = urllib.request.Request(
        f"{url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=3600) as response:
        return int(json.loads(response.read())["usage"]["completion_tokens"])


def held_out_records(run_dir: Path, limit: int | None) -> list[dict]:
    """The run's held-out prompts, what producer 0 evaluates on, as token ids (the tokens before each document's first
    supervised token: the chat template already applied, as our evaluator sends them)."""
    import dataclasses

    from common.config import load_config
    from common.gguf import dequantized_folder, is_gguf
    from common.rundir import RunDir
    from producer.acceptance.held_out import held_out_records as run_held_out
    from producer.acceptance.held_out import prompt_of
    from producer.target_model.load import build_target_config

    run = RunDir(run_dir)
    config = load_config(run.config)
    target = config.target
    if target.path is not None and is_gguf(target.path):
        target = dataclasses.replace(target, path=str(dequantized_folder(target.path)))
    vocab_size = build_target_config(target).vocab_size
    held = run_held_out(config, int(vocab_size), run.held_out)
    records = [{"prompt_token_ids": prompt_of(d, config.eval.prompt_len).tolist()} for d in held.documents]
    return records[:limit] if limit is not None else records


def measure(url: str, records: list[dict], concurrency: int, max_new_tokens: int, temperature: float) -> dict:
    """Send every record at ``concurrency``; throughput and the server's counters over the set."""
    from tqdm import tqdm

    url = url.rstrip("/")
    model = model_name(url)
    before = read_metrics(url)
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool, tqdm(total=len(records), desc="requests", unit="req") as bar:
        futures = [pool.submit(send, url, model, r, max_new_tokens, temperature) for r in records]
        tokens = 0
        for future in futures:
            tokens += future.result()
            bar.update(1)
    wall = time.perf_counter() - started
    after = read_metrics(url)
    counters = difference(spec_counters(after), spec_counters(before))
    result = {
        "url": url,
        "server": server_of(after),
        "model": model,
        "requests": len(records),
        "concurrency": concurrency,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "output_tokens": tokens,
        "seconds": wall,
        "output_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "counters": counters,
    }
    drafts = counters.get("drafts") or 0
    if drafts and "accepted" in counters:
        result["mean_acceptance_length"] = 1 + counters["accepted"] / drafts
        result["acceptance_per_position"] = [a / drafts for a in counters["accepted_per_pos"]]
    elif drafts and "generated" in counters:
        result["mean_acceptance_length"] = counters["generated"] / drafts
    return result


def print_measurement(result: dict) -> None:
    print(
        f"{result['server'] or 'server'} at {result['url']} ({result['model']}): {result['requests']} requests at "
        f"concurrency {result['concurrency']}, {result['output_tokens']} output tokens in {result['seconds']:.1f} s = "
        f"{result['output_tokens_per_s']:.1f} tokens/s"
    )
    if "mean_acceptance_length" in result:
        print(f"mean acceptance length {result['mean_acceptance_length']:.3f} (verify forwards "
              f"{result['counters']['drafts']:.0f})")  # fmt: skip
    else:
        print("the server's /metrics has no speculative-decoding counters (no draft, or --metrics not set)")
    for k, rate in enumerate(result.get("acceptance_per_position", []), start=1):
        print(f"  accepted at position {k:2d}: {rate:.3f}")
