"""Conversations the target writes turn by turn: the one code path of synthesis and regeneration.

A data record becomes a script: its messages in order. ``synthesize.turns = "last"`` keeps the record up to its
last user turn and has the target answer it (one turn). ``"all"`` has the target write every assistant turn in
order, each prompted by the conversation so far with its own earlier answers in it; user turns, system messages and
tool results stay as recorded. A self-written (Magpie) conversation has no script: the target writes each user turn
from the chat template's user prefix after the conversation so far, then answers it, ``synthesize.magpie_turns``
times.

Tool calls. The chat template decides how a call is written. ``tool_call_format`` renders a probe call through it
and finds the JSON object of the call in the text (``{"name": ..., "arguments": ...}``, or ``"parameters"``, alone
or in a list) and what the template writes before it (``<tool_call>`` for Qwen and Hermes, ``[TOOL_CALLS]`` for
Mistral, nothing for Llama 3.1). ``parse_tool_calls`` reads the target's turn the same way: after its reasoning
(the text after the last ``</think>``), every JSON call object that follows that opener is a call; the text before
the first one, less the opener, is the turn's content. A template that renders no call, or not as JSON, has no
format: its records with tool calls are skipped. Tool results are the environment's: they stay as recorded, so
they answer only the recorded calls. Where the target's calls differ from the recorded ones (a name, an argument
by JSON value, a call made or left out), the conversation ends after that turn (``cut``).

A conversation is written whole or not at all: the caller keeps it once it has ended, so a kill loses only the
conversations in flight, which are written again from their start.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from common.config import ConfigError
from producer.data.chat import check_turn_order, record_tools, tool_calls_of, validate_messages
from producer.data.files import BadRecord
from producer.target_model.generation import Finished, Request
from producer.target_model.generator import Generator

MAGPIE_PLACEHOLDER = "\x00MAGPIE\x00"
"""Rendered as the user's message to find where the template's user prefix ends."""

CUT_REASONS = ("tool_call_changed", "max_conversation_tokens", "max_prompt_tokens", "empty_user_turn", "template")
"""Why a conversation can end before its script does (``generation.cut.reason`` of its record)."""

_PROBE_TOOL = "probe_tool_of_the_template"
_CALL_START = re.compile(r"[\[{]")
_END_OF_REASONING = "</think>"


def magpie_prefix(
    tokenizer: Any, template_kwargs: dict[str, Any], system: str = "", history: list[dict[str, Any]] | None = None
) -> str:
    """What the chat template writes before a user's message after ``history`` (the conversation so far), under
    ``system`` ("": its default system prompt, if any): the target continues it with a user's message of its own.
    ConfigError when the template has no user turn."""
    messages = [{"role": "system", "content": system}] if system else []
    try:
        text = tokenizer.apply_chat_template(
            [*messages, *(history or []), {"role": "user", "content": MAGPIE_PLACEHOLDER}],
            tokenize=False,
            add_generation_prompt=False,
            **template_kwargs,
        )
    except Exception as exc:  # a template that raises on a lone user turn cannot be prompted this way
        raise ConfigError(
            f"synthesize.prompts: the chat template cannot render a user turn ({type(exc).__name__}: "
            f"{exc}); self-written prompts need one"
        ) from None
    if MAGPIE_PLACEHOLDER not in text:
        raise ConfigError(
            "synthesize.prompts: the chat template writes no user message (no user role); self-written prompts need one"
        )
    return text[: text.index(MAGPIE_PLACEHOLDER)]


# -- tool calls ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCallFormat:
    """How the chat template writes a tool call: a JSON object with the call's name and arguments, after ``opener``
    ("" when nothing comes before it)."""

    opener: str


def _calls_in(value: Any) -> list[dict[str, Any]] | None:
    """The calls a JSON value holds: one ``{"name", "arguments" | "parameters"}`` object or a list of them."""
    items = value if isinstance(value, list) and value else [value]
    calls = []
    for item in items:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
            return None
        if "arguments" in item:
            calls.append({"name": item["name"], "arguments": item["arguments"]})
        elif "parameters" in item:
            calls.append({"name": item["name"], "arguments": item["parameters"]})
        else:
            return None
    return calls


def _find_calls(body: str, opener: str) -> list[tuple[int, list[dict[str, Any]]]]:
    """(start, calls) of every JSON call object in ``body`` that follows ``opener`` (any text when it is "")."""
    decoder = json.JSONDecoder()
    found = []
    position = 0
    while (match := _CALL_START.search(body, position)) is not None:
        start = match.start()
        try:
            value, end = decoder.raw_decode(body, start)
        except ValueError:
            position = start + 1
            continue
        calls = _calls_in(value)
        if calls and body[:start].rstrip().endswith(opener):
            found.append((start, calls))
        position = end
    return found


def tool_call_format(tokenizer: Any, template_kwargs: dict[str, Any]) -> ToolCallFormat | None:
    """How the template writes a call, learned from a probe call rendered through it; None when it writes none, or
    none as a JSON object this module reads."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": _PROBE_TOOL,
                "description": "",
                "parameters": {"type": "object", "properties": {"value": {"type": "integer"}}},
            },
        }
    ]
    call = {"id": "call_0", "type": "function", "function": {"name": _PROBE_TOOL, "arguments": '{"value": 1}'}}
    conversation = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    try:
        prompt = tokenizer.apply_chat_template(
            conversation[:1], tokenize=False, add_generation_prompt=True, tools=tools, **template_kwargs
        )
        full = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=False, tools=tools, **template_kwargs
        )
    except Exception:  # a template that cannot render a call has no format
        return None
    reply = full[len(os.path.commonprefix([prompt, full])) :]
    body = reply[reply.rfind(_END_OF_REASONING) + len(_END_OF_REASONING) :] if _END_OF_REASONING in reply else reply
    for start, calls in _find_calls(body, ""):
        if calls[0]["name"] == _PROBE_TOOL:
            return ToolCallFormat(opener=body[:start].strip())
    return None


def parse_tool_calls(text: str, tool_format: ToolCallFormat) -> tuple[str, list[dict[str, Any]]]:
    """(content, calls) of a turn the target wrote: calls as ``{"name", "arguments"}`` (arguments as written, an
    object or a string), content the text before the first call without its opener. No call: (text, [])."""
    reasoning = text.rfind(_END_OF_REASONING)
    head = reasoning + len(_END_OF_REASONING) if reasoning >= 0 else 0
    found = _find_calls(text[head:], tool_format.opener)
    if not found:
        return text, []
    content = text[: head + found[0][0]].rstrip()
    if tool_format.opener and content.endswith(tool_format.opener):
        content = content[: -len(tool_format.opener)]
    return content.strip(), [call for _, calls in found for call in calls]


def _canonical_arguments(arguments: Any) -> str:
    """Arguments compared by JSON value: key order and spacing do not matter."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments.strip()
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _signature(call: dict[str, Any]) -> tuple[str, str]:
    return call["name"], _canonical_arguments(call["arguments"])


def same_calls(generated: list[dict[str, Any]], recorded: list[dict[str, Any]]) -> bool:
    """Whether the target made the recorded calls: the same names with the same arguments, in any order."""
    return Counter(map(_signature, generated)) == Counter(map(_signature, recorded))


def _describe(calls: list[dict[str, Any]]) -> str:
    text = ", ".join(f"{name}({arguments})" for name, arguments in map(_signature, calls)) or "no tool"
    return text if len(text) <= 200 else text[:197] + "..."


def openai_tool_calls(calls: list[dict[str, Any]], recorded: list[dict[str, Any]], turn: int) -> list[dict[str, Any]]:
    """The target's calls in the OpenAI form, each with the id of the recorded call it matches (so the recorded
    results still answer it), else ``call_<turn>_<k>``."""
    unused = list(recorded)
    written = []
    for k, call in enumerate(calls):
        match = next((r for r in unused if _signature(r) == _signature(call)), None)
        if match is not None:
            unused.remove(match)
        arguments = call["arguments"]
        written.append(
            {
                "id": match["id"] if match is not None and match["id"] else f"call_{turn}_{k}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
                },
            }
        )
    return written


# -- scripts -------------------------------------------------------------------------------------


def with_answer_slot(record: Any) -> Any:
    """The record with an empty assistant turn after it, so that one with no answer yet passes the chat checks."""
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        return {**record, "messages": [*record["messages"], {"role": "assistant", "content": ""}]}
    if isinstance(record, dict) and isinstance(record.get("conversations"), list):
        return {**record, "conversations": [*record["conversations"], {"from": "gpt", "value": ""}]}
    return record


def conversation_script(record: Any, turns: str, tool_format: ToolCallFormat | None) -> list[dict[str, Any]]:
    """The messages of a chat record the target writes from (see the module docstring); BadRecord when it cannot:
    no user turn, and for ``turns = "all"`` turns out of order, a tool result without its call, or tool calls the
    template does not render."""
    messages = validate_messages(with_answer_slot(record))[:-1]
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise BadRecord("no_user_turn", "no user message to answer")
    if turns == "last":
        return messages[: last_user + 1]
    check_turn_order(messages)
    if tool_format is None and any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        raise BadRecord(
            "tool_calls_not_rendered",
            "the chat template writes no tool call as a JSON object, so the target's calls cannot be read back",
        )
    return messages


@dataclass(eq=False)
class Conversation:
    """One conversation the target writes turn by turn (see the module docstring)."""

    key: Any
    """What the caller knows it by (a prompt, a record's file:line)."""
    script: list[dict[str, Any]] = field(default_factory=list)
    """The record's messages, read in order: assistant ones are written anew, the others kept as they are."""
    tools: list[dict[str, Any]] | None = None
    """The record's tool definitions, rendered into every prompt."""
    user_turns_to_write: int = 0
    """Self-written user turns still to write (Magpie)."""
    system_index: int = 0
    """Which of the writer's Magpie system prompts steers its self-written user turns."""
    read_tool_calls: bool = False
    """Whether its answers are read for tool calls (a record written with turns = "all")."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation written so far."""
    position: int = 0
    """The next message of the script."""
    turns: list[dict[str, Any]] = field(default_factory=list)
    """Each turn the target wrote: role, new_tokens, stop_reason."""
    planned_turns: int = 0
    """Assistant turns it has unless it is cut."""
    cut: dict[str, Any] | None = None
    """Why and where it ended before its script did; None when it did not."""
    skipped: str | None = None
    """Why nothing of it is kept; None when it is."""
    ended: bool = False
    """Kept, cut or skipped: nothing more to write."""

    @classmethod
    def of_record(
        cls, key: Any, script: list[dict[str, Any]], tools: list[dict[str, Any]] | None, all_turns: bool
    ) -> Conversation:
        """A data record's conversation (``conversation_script``): with ``all_turns`` the target writes the script's
        assistant turns and answers its end when nobody did; without, the script is kept as it is (its assistant
        turns included) and the target answers its end."""
        if not all_turns:
            return cls(key, tools=tools, messages=list(script), planned_turns=1)
        speakers = [m["role"] for m in script if m["role"] in ("user", "assistant", "tool")]
        planned = speakers.count("assistant") + (bool(speakers) and speakers[-1] != "assistant")
        return cls(key, list(script), tools, read_tool_calls=True, planned_turns=planned)

    @classmethod
    def self_written(cls, key: Any, user_turns: int, system_index: int) -> Conversation:
        """A Magpie conversation: ``user_turns`` user turns the target writes, each answered."""
        return cls(key, user_turns_to_write=user_turns, system_index=system_index, planned_turns=user_turns)

    @property
    def answers(self) -> list[dict[str, Any]]:
        """The target's assistant turns so far."""
        return [turn for turn in self.turns if turn["role"] == "assistant"]

    @property
    def new_tokens(self) -> int:
        """Tokens the target wrote in it, self-written user turns included."""
        return sum(turn["new_tokens"] for turn in self.turns)


def record_conversation(key: Any, record: Any, turns: str, tool_format: ToolCallFormat | None) -> Conversation:
    """The conversation the target writes from a chat record (``synthesize.turns``); BadRecord when it cannot."""
    script = conversation_script(record, turns, tool_format)
    return Conversation.of_record(key, script, record_tools(record), all_turns=turns == "all")


def generation_of(conversation: Conversation, settings: dict[str, Any], turn_details: bool) -> dict[str, Any]:
    """The ``generation`` entry of a kept conversation's record: ``settings``, the last answer's stop reason, the
    answers' new tokens, each turn the target wrote (``per_turn``, with ``turn_details``) and the cut, if any."""
    answers = conversation.answers
    generation = {
        **settings,
        "stop_reason": answers[-1]["stop_reason"],
        "new_tokens": sum(turn["new_tokens"] for turn in answers),
    }
    if turn_details:
        generation["per_turn"] = conversation.turns
    if conversation.cut is not None:
        generation["cut"] = conversation.cut
    return generation


# -- the writer ----------------------------------------------------------------------------------


class ConversationWriter:
    """Has the target write conversations: one request per turn, each next turn asked for as the previous ends.

    Answers run in one continuous batch (``answers``): a turn whose next one is known (a recorded user turn, tool
    results) is followed up at once, ahead of new conversations. A conversation whose next turn is a self-written
    user turn waits (parked) until the next chunk of conversations starts, and its user turn is written with that
    chunk's in one batch of ``questions``; the ones still waiting when no new conversation is left get theirs in
    another pass."""

    def __init__(
        self,
        tokenizer: Any,
        template_kwargs: dict[str, Any],
        answers: Generator,
        *,
        questions: Generator | None = None,
        magpie_systems: list[str] | None = None,
        tool_format: ToolCallFormat | None = None,
        max_conversation_tokens: int = 0,
    ) -> None:
        self.tokenizer, self.template_kwargs = tokenizer, template_kwargs
        self.answers, self.questions = answers, questions
        self.magpie_systems = magpie_systems or [""]
        self.tool_format = tool_format
        self.max_conversation_tokens = max_conversation_tokens
        self.stop_ids = set(answers.config.stop_token_ids)
        self.chunk = 4 * answers.config.rows
        self._parked: list[Conversation] = []
        self._done: deque[Conversation] = deque()
        self._incoming_left = True

    def run(self, conversations: Iterable[Conversation], should_stop: Callable[[], bool]) -> Iterator[Conversation]:
        """Each conversation once it has ended (kept, cut or skipped), in the order they end. Stops early, leaving
        the conversations in flight unwritten, once ``should_stop()``."""
        incoming = iter(conversations)
        self._parked, self._done, self._incoming_left = [], deque(), True
        while True:
            with contextlib.closing(
                self.answers.generate(self._requests(incoming, should_stop), self._on_answer)
            ) as run:
                for _ in run:
                    yield from self._take_done()
                    if should_stop():
                        return
            yield from self._take_done()
            if should_stop() or (not self._incoming_left and not self._parked):
                return

    def _take_done(self) -> Iterator[Conversation]:
        while self._done:
            yield self._done.popleft()

    def _requests(self, incoming: Iterator[Conversation], should_stop: Callable[[], bool]) -> Iterator[Request]:
        """The first request of each conversation, a chunk at a time, the parked ones joining the next chunk."""
        while not should_stop():
            batch, self._parked = self._parked, []
            if self._incoming_left:
                new = [c for _, c in zip(range(self.chunk), incoming)]
                self._incoming_left = len(new) == self.chunk
                batch += new
            if not batch:
                return
            self._write_user_turns([c for c in batch if self._due(c) == "user"])
            for conversation in batch:
                if not conversation.ended:
                    request = self._continue(conversation)
                    if request is not None:
                        yield request
            if not self._incoming_left:
                return  # the conversations parked from now on wait for the next pass

    # -- one turn -----------------------------------------------------------------------------------

    def _due(self, conversation: Conversation) -> str | None:
        """Take the script's messages up to its next assistant turn; which turn the target writes next ("assistant",
        "user") or None when the conversation is over."""
        script = conversation.script
        while conversation.position < len(script) and script[conversation.position]["role"] != "assistant":
            conversation.messages.append(script[conversation.position])
            conversation.position += 1
        if conversation.position < len(script):
            return "assistant"
        last = next(
            (m["role"] for m in reversed(conversation.messages) if m["role"] not in ("system", "developer")), None
        )
        if last in ("user", "tool"):
            return "assistant"  # the script ends on a turn nobody answered yet
        return "user" if conversation.user_turns_to_write else None

    def _continue(self, conversation: Conversation) -> Request | None:
        """The request of its next assistant turn; None when it waits for a user turn or has ended."""
        due = self._due(conversation)
        if due == "user":
            self._parked.append(conversation)
            return None
        if due is None:
            self._finish(conversation)
            return None
        try:
            text = self.tokenizer.apply_chat_template(
                conversation.messages, tokenize=False, add_generation_prompt=True, **self._kwargs(conversation)
            )
        except Exception as exc:  # the template rejects what the conversation has become
            self._end(conversation, "template", f"{type(exc).__name__}: {exc}")
            return None
        return Request(key=conversation, prompt_ids=self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _kwargs(self, conversation: Conversation) -> dict[str, Any]:
        return {**self.template_kwargs, "tools": conversation.tools} if conversation.tools else self.template_kwargs

    def _on_answer(self, finished: Finished) -> list[Request]:
        conversation: Conversation = finished.key
        if finished.stop_reason == "prompt_too_long":
            self._too_long(conversation, self.answers)
            return []
        text = self.tokenizer.decode([t for t in finished.new_ids if t not in self.stop_ids], skip_special_tokens=False)
        script = conversation.script
        recorded = script[conversation.position] if conversation.position < len(script) else None
        conversation.position += recorded is not None
        content, calls = (
            parse_tool_calls(text, self.tool_format)
            if conversation.read_tool_calls and self.tool_format is not None
            else (text, [])
        )
        recorded_calls = tool_calls_of(recorded, "the recorded turn") if recorded is not None else []
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = openai_tool_calls(calls, recorded_calls, len(conversation.answers))
        conversation.messages.append(message)
        conversation.turns.append(
            {"role": "assistant", "new_tokens": len(finished.new_ids), "stop_reason": finished.stop_reason}
        )
        if recorded is not None and not same_calls(calls, recorded_calls):
            self._end(
                conversation,
                "tool_call_changed",
                f"the target called {_describe(calls)} where the record calls {_describe(recorded_calls)}",
            )
            return []
        if self._over_budget(conversation):
            return []
        request = self._continue(conversation)
        return [request] if request is not None else []

    def _over_budget(self, conversation: Conversation) -> bool:
        """End the conversation if it reached max_conversation_tokens with turns still to write."""
        cap = self.max_conversation_tokens
        if not cap or conversation.new_tokens < cap:
            return False
        if conversation.position < len(conversation.script) or conversation.user_turns_to_write:
            self._end(
                conversation, "max_conversation_tokens", f"{conversation.new_tokens} new tokens reached the cap {cap}"
            )
        else:
            self._finish(conversation)
        return True

    def _write_user_turns(self, conversations: list[Conversation]) -> None:
        """Write the next user turn of each of ``conversations`` (self-written ones), in one batch."""
        if not conversations:
            return
        if self.questions is None:
            raise RuntimeError("self-written user turns need a questions generator")
        requests = []
        for conversation in conversations:
            system = self.magpie_systems[conversation.system_index % len(self.magpie_systems)]
            try:
                prefix = magpie_prefix(self.tokenizer, self.template_kwargs, system, conversation.messages)
            except ConfigError as exc:
                self._end(conversation, "template", str(exc))
                continue
            requests.append(
                Request(key=conversation, prompt_ids=self.tokenizer(prefix, add_special_tokens=False)["input_ids"])
            )
        for finished in self.questions.generate(requests):
            conversation = finished.key
            if finished.stop_reason == "prompt_too_long":
                self._too_long(conversation, self.questions)
                continue
            text = self.tokenizer.decode(
                [t for t in finished.new_ids if t not in self.questions.config.stop_token_ids], skip_special_tokens=True
            ).strip()
            conversation.turns.append(
                {"role": "user", "new_tokens": len(finished.new_ids), "stop_reason": finished.stop_reason}
            )
            if not text:
                self._end(
                    conversation,
                    "empty_user_turn",
                    "the self-written user turn is empty",
                    skipped="the self-written prompt is empty",
                )
                continue
            conversation.messages.append({"role": "user", "content": text})
            conversation.user_turns_to_write -= 1

    # -- endings ------------------------------------------------------------------------------------

    def _too_long(self, conversation: Conversation, generator: Generator) -> None:
        limit = generator.config.max_prompt_tokens
        self._end(
            conversation,
            "max_prompt_tokens",
            f"the conversation so far is longer than synthesize.max_prompt_tokens={limit} tokens",
            skipped=f"prompt longer than synthesize.max_prompt_tokens={limit}",
        )

    def _end(self, conversation: Conversation, reason: str, detail: str, skipped: str | None = None) -> None:
        """End it before its script does: cut after its last answer, or skipped (``skipped``, else ``reason:
        detail``) when it has none."""
        while conversation.messages and conversation.messages[-1]["role"] != "assistant":
            conversation.messages.pop()  # turns the target never answered
        if not conversation.answers or not conversation.messages:
            conversation.skipped = skipped or f"{reason}: {detail}"
        else:
            conversation.cut = {
                "reason": reason,
                "after_turn": len(conversation.answers),
                "of_turns": conversation.planned_turns,
                "detail": detail,
            }
        self._finish(conversation)

    def _finish(self, conversation: Conversation) -> None:
        if conversation.skipped is None and not conversation.answers:
            conversation.skipped = "no_user_turn: no user message to answer"
        conversation.ended = True
        self._done.append(conversation)
