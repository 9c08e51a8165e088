"""A check, a character at a time, that text is a prefix of one JSON value: what lets a tool
call's arguments stream as the model writes them, each fragment released only while the text
so far can still become valid JSON; and the value such a prefix holds so far (`complete_part`),
for a call cut short."""

from __future__ import annotations

import json
import re
from typing import Any

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_PREFIX = re.compile(r"-?(?:0|[1-9]\d*)?(?:(?<=\d)\.\d*)?(?:(?<=\d)[eE][+-]?\d*)?")
_LITERALS = ("true", "false", "null")
_ESCAPES = set('"\\/bfnrtu')
_HEX = set("0123456789abcdefABCDEF")


class JsonPrefix:
    """Feed characters with `push`; it says False at the first one that no JSON value could
    continue with (the state is then no longer meaningful). `done` once the value is whole:
    a container closed, or a top-level scalar ended (numbers and literals end at a delimiter)."""

    def __init__(self) -> None:
        self._stack: list[str] = []  # "{" or "[" for each open container
        # value, key, colon, next (a comma or a close), key_or_close, value_or_close
        self._expect = "value"
        self._string: str | None = None  # inside a string: "" or the escape read so far
        self._token = ""  # a number or literal being read
        self.done = False

    def push(self, c: str) -> bool:
        if self.done:
            return False
        if self._string is not None:
            return self._in_string(c)
        if self._token:
            if _continues(self._token + c):
                self._token += c
                return True
            if not (_NUMBER.fullmatch(self._token) or self._token in _LITERALS):
                return False
            self._token = ""
            self._value_ended()
            if self.done:  # a top-level scalar: the delimiter is not part of it
                return c.isspace()
        if c.isspace():
            return True
        expect = self._expect
        if expect == "colon":
            self._expect = "value"
            return c == ":"
        if c == '"' and expect in ("value", "key", "key_or_close", "value_or_close"):
            self._string = ""
            return True
        if c in "}]" and expect in ("next", "key_or_close", "value_or_close"):
            if self._stack.pop() != {"}": "{", "]": "["}[c]:
                return False
            self._value_ended()
            return True
        if c == "," and expect == "next":
            self._expect = "key" if self._stack[-1] == "{" else "value"
            return True
        if expect not in ("value", "value_or_close"):
            return False
        if c in "{[":
            self._stack.append(c)
            self._expect = "key_or_close" if c == "{" else "value_or_close"
            return True
        if _continues(c):
            self._token = c
            return True
        return False

    def _in_string(self, c: str) -> bool:
        escape = self._string
        if escape:  # after a backslash: an escape letter, or \u and up to 4 hex digits
            if escape == "\\":
                if c not in _ESCAPES:
                    return False
                self._string = "\\u" if c == "u" else ""
            elif c in _HEX:
                self._string = "" if len(escape) == 5 else escape + c
            else:
                return False
            return True
        if c == "\\":
            self._string = "\\"
        elif c == '"':
            self._string = None
            if self._expect in ("key", "key_or_close"):
                self._expect = "colon"
            else:
                self._value_ended()
        elif ord(c) < 0x20:  # control characters must be escaped
            return False
        return True

    def _value_ended(self) -> None:
        if self._stack:
            self._expect = "next"
        else:
            self.done = True


def _continues(token: str) -> bool:
    """Whether `token` can still grow into a number or a literal."""
    return bool(_NUMBER_PREFIX.fullmatch(token) and token) or any(
        lit.startswith(token) for lit in _LITERALS
    )


def complete_part(text: str) -> Any:
    """The value a prefix of a JSON object or array holds so far: its open containers closed,
    a member or element not yet whole dropped (an unfinished string, number or literal, or a
    key without its value), as Anthropic's client reads a tool input cut short; a whole value
    is itself. ValueError when `text` is neither."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    prefix = JsonPrefix()
    cut: tuple[int, list[str]] | None = None  # where the last whole item ends; what is open
    for i, c in enumerate(text):
        reading = bool(prefix._token)  # a number or literal, which only a delimiter ends
        if not prefix.push(c):
            raise ValueError(f"not a prefix of a JSON value: {text[: i + 1]!r}")
        if prefix._string is not None or prefix._token or not prefix._stack:
            continue
        if prefix._expect in ("next", "key_or_close", "value_or_close"):
            cut = (i + 1, list(prefix._stack))  # after an item, or a container's opening
        elif reading and c == ",":
            cut = (i, list(prefix._stack))  # the number before the comma is whole
    if cut is None:
        raise ValueError(f"not a prefix of a JSON object or array: {text!r}")
    end, stack = cut
    closers = "".join("}" if c == "{" else "]" for c in reversed(stack))
    return json.loads(text[:end] + closers)
