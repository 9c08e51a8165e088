"""Tool calls in the model's own words: which format a chat template speaks, how each format's
calls parse (tool_parser.py splits streamed output with these), and the grammar of a call.

Formats, chosen from the template's source:
  hermes  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the
          output, text around them being content (Qwen2.5, Qwen3, Hermes: templates that
          mention `<tool_call>`)
  json    the whole output is the call: a JSON object `{"name": ..., "parameters": {...}}`
          (or "arguments"), a list of them, or several separated by `;` or newlines, after an
          optional `<|python_tag|>` (Llama 3.1+), or in a ```json fence. This is also the
          fallback for any other template that takes `tools`.
  pythonic  the whole output is a Python list of calls with keyword arguments,
          `[get_weather(city="Paris"), get_time()]`, optionally in `<|python_start|>` ...
          `<|python_end|>` (Llama 3.2's pythonic template, Llama 4: templates that show the
          `[func_name1(params_name1=params_value1, ...)]` layout). It is read with `ast`,
          never run: argument values are literals (strings, numbers, lists, dicts, and
          True / False / None or JSON's true / false / null).
A call that does not parse as a call of an offered tool (bad JSON, no name, a tool not
offered, arguments that are not an object) is returned as content, as the model wrote it
(unless max_tokens cut it short, or a grammar forced it: tool_parser.py).

When a call is required (`tool_choice` "required" or a named function), `call_grammar` writes
the format as a grammar whose arguments follow each tool's JSON schema, so the output is a
well-formed call however small the model.
"""

from __future__ import annotations

import ast
import json
import keyword
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ..grammar import JSON_LAYOUT, Grammar, checked_schema
from ..grammar.json_schema import rooted

HERMES, JSON, PYTHONIC = "hermes", "json", "pythonic"
FORMATS = (HERMES, JSON, PYTHONIC)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
FENCE = "```"
# How a template shows the pythonic layout to the model.
PYTHONIC_EXAMPLE = re.compile(r"\[func_name\d*\(")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


@dataclass(frozen=True)
class CallDelta:
    """Part of tool call `index`, as it streams: the first names it (`id`, `name`), the
    others do not."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


def template_source(tokenizer) -> str | None:
    """The chat template's Jinja source (the `tool_use` one where a tokenizer has several)."""
    source = getattr(tokenizer, "chat_template", None)
    if isinstance(source, dict):
        source = source.get("tool_use") or source.get("default")
    return source if isinstance(source, str) else None


def tool_format(tokenizer) -> str | None:
    """The format (HERMES, JSON, PYTHONIC) of a template that renders `tools`; None for one
    that ignores them."""
    source = template_source(tokenizer)
    if source is None or not re.search(r"\btools\b", source):
        return None
    if OPEN in source:
        return HERMES
    return PYTHONIC if PYTHONIC_EXAMPLE.search(source) else JSON


def call_grammar(format_: str, tools: dict[str, dict[str, Any]], parallel: bool) -> Grammar:
    """A Lark grammar of output that is only calls in `format_` of `tools` (name -> JSON schema
    of its arguments): one call, or with `parallel` one or more (hermes and pythonic; the json
    format writes one).

    Arguments are held to their schema strictly, as xgrammar's strict mode and OpenAI's strict
    function calling hold them: an object takes only the properties its schema declares unless
    the schema allows others (`additionalProperties`), so a small model cannot invent keys
    without end. Each schema keeps its own `$defs` and `$ref`s (it sits under the grammar's
    `$defs`, its references moved with it). A schema llguidance cannot compile, or one with
    no finite instance, is a ValueError."""
    schemas = {name: checked_schema(schema, strict=True) for name, schema in tools.items()}
    if format_ == PYTHONIC:
        return _pythonic_grammar(schemas, parallel)
    key = "arguments" if format_ == HERMES else "parameters"
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, key: {"$ref": f"#/$defs/tool{t}"}},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t, name in enumerate(schemas)
    ]
    defs = {f"tool{t}": rooted(schema, f"tool{t}") for t, schema in enumerate(schemas.values())}
    body = json.dumps({"anyOf": calls, "$defs": defs, "x-guidance": JSON_LAYOUT})
    if format_ == JSON:
        return Grammar.lark(f"start: body\nbody: %json {body}\n")
    start = 'call ("\\n" call)*' if parallel else "call"
    call = f'"{OPEN}\\n" body "\\n{CLOSE}"'
    return Grammar.lark(f"start: {start}\ncall: {call}\nbody: %json {body}\n")


def _pythonic_grammar(tools: dict[str, dict[str, Any]], parallel: bool) -> Grammar:
    """`[name(key=value, ...)]`: each value a JSON value of its property's schema (JSON that
    `parse_pythonic_calls` reads back), the schema's properties in its order, the required
    ones always there; a schema without properties takes no keywords, or any where it allows
    other properties (`additionalProperties`)."""
    calls = 'call (", " call)*' if parallel else "call"
    rules = [f'start: "[" {calls} "]"']
    rules.append("call: " + " | ".join(f"c{t}" for t in range(len(tools))))
    for t, (name, schema) in enumerate(tools.items()):
        properties = schema.get("properties")
        for word in [name, *(properties if isinstance(properties, dict) else ())]:
            if not word.isidentifier() or keyword.iskeyword(word):
                raise ValueError(f"{word!r} cannot be a name in a pythonic call")
        if not isinstance(properties, dict) or not properties:
            extra = schema.get("additionalProperties", False)
            if extra is False:
                rules.append(f'c{t}: "{name}()"')
                continue
            rules.append(f'c{t}: "{name}(" (k{t} (", " k{t})*)? ")"')
            rules.append(f'k{t}: /[A-Za-z_][A-Za-z0-9_]*/ "=" v{t}')
            rules.append(f"v{t}: {_value(schema, '/additionalProperties')}")
            continue
        required = set(schema.get("required", ()))
        # f{t}_{i}: properties i.. when none came before; m{t}_{i}: the same after one did.
        first, more = "", ""
        for i in reversed(range(len(properties))):
            key = list(properties)[i]
            rules.append(f"v{t}_{i}: {_value(schema, '/properties/' + key)}")
            item = f'"{key}=" v{t}_{i}'
            if key in required:
                new_first, new_more = f"{item} {more}", f'", " {item} {more}'
            else:
                new_first = f"({item} {more})" + (f" | {first}" if first else "?")
                new_more = f'(", " {item})? {more}'
            rules.append(f"f{t}_{i}: {new_first}")
            rules.append(f"m{t}_{i}: {new_more}")
            first, more = f"f{t}_{i}", f"m{t}_{i}"
        rules.append(f'c{t}: "{name}(" {first} ")"')
    return Grammar.lark("\n".join(rules) + "\n")


def _value(schema: dict[str, Any], pointer: str) -> str:
    """The %json rule of the subschema at `pointer` in a tool's `schema` (whose own `$defs`
    and `$ref`s come with it)."""
    root = {"$defs": {"tool": rooted(schema, "tool")}, "x-guidance": JSON_LAYOUT}
    return f"%json {json.dumps({**root, '$ref': '#/$defs/tool' + pointer})}"


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


def parse_pythonic_calls(text: str, names: Collection[str]) -> list[ToolCall] | None:
    """The calls `text` is made of in the pythonic format, or None when it is anything else.
    The text is parsed, never evaluated."""
    text = text.strip().removeprefix(PYTHON_TAG).removeprefix(PYTHON_START)
    text = text.removesuffix(PYTHON_END).strip()
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError):  # ValueError: a NUL byte
        return None
    nodes = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for node in nodes:
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in names
            and not node.args
            and all(k.arg is not None for k in node.keywords)
        ):
            return None
        try:
            arguments = {k.arg: literal(k.value) for k in node.keywords}
        except ValueError:
            return None
        calls.append(new_call(node.func.id, arguments))
    return calls or None


_NAMED = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def literal(node: ast.expr) -> Any:
    """The JSON value a literal expression writes; ValueError for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, type(None))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMED:
        return _NAMED[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("a sign on something other than a number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [literal(k) if k is not None else None for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("a dict key that is not a string")
        return {k: literal(v) for k, v in zip(keys, node.values, strict=True)}
    raise ValueError(f"{type(node).__name__} is not a literal")
