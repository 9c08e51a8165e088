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


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def new_call(name: str, arguments: dict[str, Any]) -> ToolCall:
    return ToolCall(call_id(), name, json.dumps(arguments, ensure_ascii=False))


def call_from(value: Any, names: Collection[str]) -> ToolCall | None:
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
            call = call_from(item, names)
            if call is None:
                return None
            calls.append(call)
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
    return calls or None
