"""llama.cpp's llama-server with a draft GGUF, driven as the served check needs it (common/llamacpp.py builds and
converts; this module runs the server and reads what it did).

The server runs on loopback with one slot (``-np 1``: one request at a time, so its log lines belong to that request),
f32 KV caches for target and draft and flash attention off (its CPU path rounds queries to f16), the kind's
``--spec-type``, drafts of B - 1 tokens (``--spec-draft-n-max``; the default is 3) and no confidence cut
(``--spec-draft-p-min 0``) unless one is asked for (``p_min``: a DSpark block is cut before its first slot whose own
confidence is below it). ``LLAMA_TRACE=1`` makes it log every verify forward as ``accepted A/N draft tokens``; a
request's lines end with its ``total time`` line; from log level 4 on the loader lists the vocabulary's
end-of-generation tokens. A block cut to no draft at all is decoded as a plain token, which the trace does not show:
with a cut the server logs at level 5, where every such forward says ``slot decode token`` (a verify forward of the
given token alone, 0/0). A request is a prompt of token ids (no BOS added), greedy (temperature 0),
``return_tokens`` for the generated ids; the server stops at its vocabulary's end-of-generation tokens, which it lists
when it loads (``eog_tokens``) and which the check then uses as every side's stop tokens.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

# (not level 5's "accepted A/N draft tokens, new n_tokens = ..." of the same forward)
STEP_LINE = re.compile(r"accepted\s+(\d+)/\s*(\d+) draft tokens( \(restore checkpoint\))?(?!,)")
PLAIN_LINE = re.compile(r"slot decode token, id=")
"""Level 5: a generating slot's forward of its last token with no draft (a block the confidence cut to nothing)."""
SPEC_LINE = re.compile(r"adding speculative implementation '([\w-]+)'")
END_LINE = re.compile(r"total time =\s*[\d.]+ ms /")
EOG_HEADER = "printing all EOG tokens:"
EOG_LINE = re.compile(r":\s+-\s+(-?\d+) \(")


ERROR_LINE = re.compile(r"^\S+ E (.*)$")


class ServerError(RuntimeError):
    """llama-server did not start or answer; the message ends with its log's last lines, ``reason`` is one line."""

    def __init__(self, message: str, log: str = ""):
        tail = "\n".join(log.splitlines()[-25:])
        super().__init__(f"{message}:\n{tail}" if log else message)
        errors = [
            found.group(1).strip()
            for line in log.splitlines()
            if (found := ERROR_LINE.match(line)) and "normal" not in line  # "... (this warning is normal ...)"
        ]
        # the first error is the cause; the later ones are its consequences ("failed to load model", "exiting")
        self.reason = f"{message}: {errors[0]}" if errors else message


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, payload: dict | None = None, timeout_s: float = 600) -> dict:
    """GET (no payload) or POST a JSON request; the decoded JSON answer."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


class LlamaServer:
    """``llama-server -m TARGET -md DRAFT`` on a free loopback port, for the length of a ``with`` block."""

    def __init__(
        self,
        binary: Path,
        target_gguf: Path,
        draft_gguf: Path | None,
        block_size: int,
        log_file: Path,
        context: int = 4096,
        threads: int = 1,
        extra_args: list[str] | None = None,
        start_timeout_s: float = 300,
        spec_type: str | None = None,
        p_min: float = 0.0,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = Path(log_file)
        self.start_timeout_s = start_timeout_s
        self.spec_type = spec_type
        self.p_min = p_min
        # with a cut, a block may keep no draft: level 5 logs those forwards (``slot decode token``)
        level = "5" if p_min > 0 else "4"
        self.command = [
            str(binary), "-m", str(target_gguf), "--host", "127.0.0.1", "--port", str(self.port),
            "-np", "1", "-c", str(context), "-t", str(threads), "-tb", str(threads),
            "-ctk", "f32", "-ctv", "f32", "-fa", "off", "--metrics", "--temp", "0", "--top-k", "1",
            "-lv", level,  # the loader's list of end-of-generation tokens is logged from level 4 on
        ]  # fmt: skip
        if draft_gguf is not None:
            self.command += [
                "-md", str(draft_gguf), "--spec-draft-n-max", str(block_size - 1), "--spec-draft-n-min", "0",
                "--spec-draft-p-min", str(p_min), "-ctkd", "f32", "-ctvd", "f32", "-td", str(threads),
                "-tbd", str(threads),
            ]  # fmt: skip
            if spec_type is not None:
                self.command += ["--spec-type", spec_type]
        self.command += list(extra_args or [])
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        env = {**os.environ, "LLAMA_TRACE": "1"}
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_file, "w")
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"llama-server exited with {self.process.returncode}", self.log_text())
            try:
                if http_json(f"{self.url}/health", timeout_s=5).get("status") == "ok":
                    if "failed to initialize speculative decoding" in self.log_text():
                        # the server goes on without a draft: a check of nothing
                        raise ServerError("llama-server could not use the draft", self.log_text())
                    self._check_spec_type()
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                pass
            time.sleep(0.5)
        raise ServerError(f"llama-server was not ready in {self.start_timeout_s:.0f} s", self.log_text())

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def _check_spec_type(self) -> None:
        """ServerError unless the server drafts with the implementation asked for (``spec_type``)."""
        if self.spec_type is None:
            return
        used = SPEC_LINE.findall(self.log_text())
        if used != [self.spec_type]:
            raise ServerError(f"llama-server drafts with {used or 'nothing'}, not {self.spec_type!r}", self.log_text())

    def log_text(self, offset: int = 0) -> str:
        with open(self.log_file, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def eog_tokens(self) -> list[int]:
        """The target's end-of-generation tokens, as the server listed them when it loaded (the first list: the
        target's; the draft's follows)."""
        text = self.log_text()
        start = text.find(EOG_HEADER)
        if start < 0:
            return []
        tokens = []
        for line in text[start:].splitlines()[1:]:
            found = EOG_LINE.search(line)
            if not found:
                break
            tokens.append(int(found.group(1)))
        return sorted(set(tokens))

    def complete(
        self, prompt: list[int], n_predict: int, timeout_s: float = 600
    ) -> tuple[list[int], list[int], list[int]]:
        """One greedy request: (the generated tokens, end-of-generation token included; each verify forward's
        accepted drafts and verified drafts from the trace)."""
        offset = self.log_file.stat().st_size
        answer = http_json(
            f"{self.url}/completion",
            {
                "prompt": prompt,
                "n_predict": n_predict,
                "temperature": 0.0,
                "top_k": 1,
                "cache_prompt": False,
                "return_tokens": True,
                "seed": 0,
            },
            timeout_s,
        )
        accepted, drafted = self._steps_since(offset)
        return [int(t) for t in answer["tokens"]], accepted, drafted

    def _steps_since(self, offset: int, timeout_s: float = 10) -> tuple[list[int], list[int]]:
        """The verify forwards the log shows after ``offset`` (accepted and verified drafts of each), once the
        request's closing line is there (the log is written by a thread of its own, a moment after the answer). With
        a cut, a forward with no draft counts as a step of 0 of 0; without one the server logs no such line (it drafts
        every block whole until ``n_predict`` nears, past the answer)."""
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.log_text(offset)
            if END_LINE.search(text) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        accepted, drafted, replaying = [], [], False
        for line in text.splitlines():
            if PLAIN_LINE.search(line):
                accepted.append(0)
                drafted.append(0)
                continue
            found = STEP_LINE.search(line)
            if not found:
                continue
            if replaying:  # the replay of a step restored from a checkpoint (recurrent targets) logs it again
                replaying = False
                continue
            accepted.append(int(found.group(1)))
            drafted.append(int(found.group(2)))
            replaying = found.group(3) is not None
        return accepted, drafted

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            return response.read().decode()
