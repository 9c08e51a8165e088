"""Tool calls in the model's own words: which format a chat template speaks, and a parser that
splits the model's output, as it streams, into content and tool calls.

Formats, chosen from the template's source:
  hermes  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the
          output, text around them being content (Qwen2.5, Qwen3, Hermes: templates that
          mention `<tool_call>`)
  json    the whole output is the call: a JSON object `{"name": ..., "parameters": {...}}`
          (or "arguments"), a list of them, or several separated by `;` or newlines, after an
          optional `<|python_tag|>` (Llama 3.1+), or in a ```json fence. This is also the
          fallback for any other template that takes `tools`.
A call that does not parse as a call of an offered tool (bad JSON, no name, a tool not
offered, arguments that are not an object) is returned as content, as the model wrote it.

When a call is required (`tool_choice` "required" or a named function), `call_grammar` writes
the format as a grammar whose arguments follow each tool's JSON schema, so the output is a
well-formed call however small the model.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ..grammar import JSON_LAYOUT, Grammar

HERMES, JSON = "hermes", "json"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
FENCE = "```"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


Piece = str | ToolCall  # content text, or a whole call


def template_source(tokenizer) -> str | None:
    """The chat template's Jinja source (the `tool_use` one where a tokenizer has several)."""
    source = getattr(tokenizer, "chat_template", None)
    if isinstance(source, dict):
        source = source.get("tool_use") or source.get("default")
    return source if isinstance(source, str) else None


def tool_format(tokenizer) -> str | None:
    """HERMES or JSON for a template that renders `tools`; None for one that ignores them."""
    source = template_source(tokenizer)
    if source is None or not re.search(r"\btools\b", source):
        return None
    return HERMES if OPEN in source else JSON


def call_grammar(format_: str, tools: dict[str, dict[str, Any]], parallel: bool) -> Grammar:
    """A Lark grammar of output that is only calls in `format_` of `tools` (name -> JSON schema
    of its arguments): one call, or with `parallel` one or more (hermes; the json format
    writes one). A schema llguidance cannot compile is a ValueError."""
    key = "arguments" if format_ == HERMES else "parameters"
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, key: schema},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for name, schema in tools.items()
    ]
    body = json.dumps({"anyOf": calls, "x-guidance": JSON_LAYOUT})
    if format_ == JSON:
        return Grammar.lark(f"start: body\nbody: %json {body}\n")
    start = 'call ("\\n" call)*' if parallel else "call"
    call = f'"{OPEN}\\n" body "\\n{CLOSE}"'
    return Grammar.lark(f"start: {start}\ncall: {call}\nbody: %json {body}\n")


def new_call(name: str, arguments: dict[str, Any]) -> ToolCall:
    return ToolCall(
        f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments, ensure_ascii=False)
    )


def _call(value: Any, names: Collection[str]) -> ToolCall | None:
    """The call `value` (decoded JSON) names, or None when it is not one of an offered tool."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return new_call(value["name"], arguments)


def parse_json_calls(text: str, names: Collection[str]) -> list[ToolCall] | None:
    """The calls `text` is made of in the json format, or None when it is anything else."""
    text = text.strip().removeprefix(PYTHON_TAG).strip()
    if text.startswith(FENCE) and text.endswith(FENCE) and len(text) > 2 * len(FENCE):
        text = text[len(FENCE) : -len(FENCE)].removeprefix("json").strip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        for item in value if isinstance(value, list) else [value]:
            call = _call(item, names)
            if call is None:
                return None
            calls.append(call)
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
    return calls or None


def _partial_tail(text: str, marker: str) -> int:
    """Length of the tail of `text` that could still grow into `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolParser:
    """Splits streamed output into content and calls of the tools named `names`. Whitespace
    next to a call is dropped; other content comes out as soon as it cannot be part of one."""

    def __init__(self, format_: str, names: Collection[str]):
        if format_ not in (HERMES, JSON):
            raise ValueError(f"tool-call format {format_!r} is unknown (known: hermes, json)")
        self.format = format_
        self.names = set(names)
        self._buffer = ""
        self._inside = False  # hermes: within a <tool_call> block
        self._mode: str | None = None  # json: None (undecided), "json" or "content"
        self._space = ""  # whitespace held back: dropped if a call follows
        self._called = False
        self._after_call = False  # whitespace here is dropped: it only separates calls

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        if self.format == HERMES:
            return self._hermes(final=False)
        return self._json(final=False)

    def end(self) -> list[Piece]:
        """What is left once the output ended: an unclosed or unparsed call is content."""
        pieces = self._hermes(final=True) if self.format == HERMES else self._json(final=True)
        if self._space and not self._called:
            pieces.append(self._space)
        self._space = ""
        return pieces

    def _content(self, text: str, pieces: list[Piece]) -> None:
        """Emits `text`, holding its trailing whitespace back (and, right after a call,
        dropping its leading whitespace), so that chunking never changes the result."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        body = text.rstrip()
        if body:
            pieces.append(self._space + body)
            self._space = ""
        self._space += text[len(body) :]

    def _called_with(self, call: ToolCall, pieces: list[Piece]) -> None:
        self._space = ""
        self._called = self._after_call = True
        pieces.append(call)

    def _hermes(self, *, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        while True:
            if not self._inside:
                at = self._buffer.find(OPEN)
                if at < 0:
                    keep = 0 if final else _partial_tail(self._buffer, OPEN)
                    self._content(self._buffer[: len(self._buffer) - keep], pieces)
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return pieces
                self._content(self._buffer[:at], pieces)
                self._buffer, self._inside = self._buffer[at + len(OPEN) :], True
            else:
                at = self._buffer.find(CLOSE)
                if at < 0:
                    if final:
                        self._content(OPEN + self._buffer, pieces)
                        self._buffer = ""
                    return pieces
                body = self._buffer[:at]
                self._buffer, self._inside = self._buffer[at + len(CLOSE) :], False
                try:
                    call = _call(json.loads(body), self.names)
                except json.JSONDecodeError:
                    call = None
                if call is None:
                    self._content(OPEN + body + CLOSE, pieces)
                else:
                    self._called_with(call, pieces)

    def _json(self, *, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        if self._mode is None:
            head = self._buffer.lstrip()
            if head.startswith((PYTHON_TAG, FENCE, "{", "[")):
                self._mode = "json"
            elif head and not PYTHON_TAG.startswith(head) and not FENCE.startswith(head):
                self._mode = "content"
            elif not final:
                return pieces
        if self._mode == "json" and not final:
            return pieces
        calls = parse_json_calls(self._buffer, self.names) if self._mode == "json" else None
        if calls is None:
            self._content(self._buffer, pieces)
        else:
            for call in calls:
                self._called_with(call, pieces)
        self._buffer = ""
        return pieces
