"""Pythonic tool calls read as they stream: `[get_weather(city="Paris", days=3), get_time()]`
(Llama 3.2's pythonic template, Llama 4), optionally in `<|python_start|>` ... `<|python_end|>`.

A call goes out as OpenAI streams one, argument by argument: a delta that names it (id,
name, no arguments, as for JSON calls) and its first argument (`{"city": "Paris"`) once that
argument is complete, or `{}` at the `)` of a call without any; each later argument follows
as `, "days": 3` once its value is complete (a top-level `,` or `)` after it), and `}` at
the call's `)`. Values are read with
`ast`, never run, as the whole-output parser reads them (`tools.literal`), so a streamed call
rebuilds to the same arguments. A string value goes out whole, not character by character.

Until the first delta goes out, output that is not calls of the offered tools is left to the
whole-output parser (which returns it as content). After that, a call that breaks ends where
it stands (truncated, as OpenAI sends a call cut by max_tokens) and the text from what broke
it on is content.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Collection

from .tools import PYTHON_END, PYTHON_START, PYTHON_TAG, CallDelta, call_id, literal

NAME = re.compile(r"\s*([A-Za-z_]\w*)\s*")
MORE, BROKEN, DONE = "more", "broken", "done"  # where `read` stopped


class PythonicCalls:
    """The calls of the offered tools `names` in pythonic output. `read` takes the whole
    output so far each time; `sent` is how far into it the deltas that went out reach."""

    def __init__(self, names: Collection[str]):
        self.names = set(names)
        self.sent = 0
        self.calls = 0  # calls begun that went out (whole or in part)
        self._at = 0  # how far it has read (a head or argument not yet out included)
        self._listed: bool | None = None  # in a `[...]` list; None: the opening is unread
        self._call: tuple[str, str] | None = None  # (id, name) of the call being read
        self._keys: set[str] = set()  # its arguments read so far

    def read(self, text: str, final: bool) -> tuple[list[CallDelta], str]:
        """The deltas `text` adds, and where it stopped: "more" (it waits for more text),
        "broken" (`text[sent:]` is not calls), or "done" (the output is calls, ended)."""
        deltas: list[CallDelta] = []
        status = None
        while status is None:
            status = self._step(text, deltas)
        if final and status == MORE:  # ended: after a whole call, with at most its closers
            rest = text[self._at :].strip().removesuffix(PYTHON_END).strip()
            closers = ("", "]") if self._listed else ("",)
            status = DONE if self._call is None and self.calls and rest in closers else BROKEN
        return deltas, status

    def _step(self, text: str, deltas: list[CallDelta]) -> str | None:
        """Reads one item (the opening, a call's head, an argument, a separator); None when
        another may follow, else `read`'s status."""
        rest = text[self._at :]
        stripped = rest.lstrip()
        skipped = self._at + len(rest) - len(stripped)  # where `stripped` starts
        if self._call is not None:
            return self._argument(text, stripped, skipped, deltas)
        if self._listed is None:  # the opening: tags, then "[" or a lone call
            for opener in (PYTHON_TAG, PYTHON_START, "["):
                if stripped.startswith(opener):
                    self._at = skipped + len(opener)
                    if opener == "[":
                        self._listed = True
                    return None
                if opener.startswith(stripped):
                    return MORE
            self._listed = False
        elif self.calls:  # after a call: "," and the next one in a list, else the end
            if not (self._listed and stripped.startswith(",")):
                ending = stripped.removeprefix("]" if self._listed else "").strip()
                return MORE if PYTHON_END.startswith(ending) else BROKEN
            skipped += 1
        found = NAME.match(text, skipped)
        if found is None or found.end() == len(text):
            return MORE if found is not None or not text[skipped:].strip() else BROKEN
        if text[found.end()] != "(" or found.group(1) not in self.names:
            return BROKEN
        self._call, self._keys = (call_id(), found.group(1)), set()
        self._at = found.end() + 1
        return None

    def _argument(self, text: str, stripped: str, skipped: int, deltas: list) -> str | None:
        """`key=value` and its `,`, or the call's `)`."""
        if stripped.startswith(")"):
            self._emit("}" if self._keys else "{}", skipped + 1, deltas)
            self._call = None
            return None
        found = NAME.match(text, skipped)
        if found is None or found.end() == len(text):
            return MORE if found is not None or not stripped else BROKEN
        key, start = found.group(1), found.end() + 1
        if text[found.end()] != "=" or key in self._keys:
            return BROKEN
        end = _value_end(text, start)
        if end is None or end < 0:
            return MORE if end is None else BROKEN
        try:
            value = literal(ast.parse(text[start:end].strip(), mode="eval").body)
        except (SyntaxError, ValueError):  # ValueError: not a literal, a NUL byte
            return BROKEN
        pair = f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}"
        first = not self._keys
        self._keys.add(key)
        # A "," is the argument's; a ")" stays, to close the call.
        self._emit(("{" if first else ", ") + pair, end + (text[end] == ","), deltas)
        return None

    def _emit(self, arguments: str, to: int, deltas: list[CallDelta]) -> None:
        """A delta of the current call, which has read `text` up to `to`; before its first,
        the one that names it."""
        if arguments.startswith("{"):
            deltas.append(CallDelta(self.calls, "", *self._call))
            self.calls += 1
        deltas.append(CallDelta(self.calls - 1, arguments))
        self._at = self.sent = to


def _value_end(text: str, at: int) -> int | None:
    """Where the argument value from `at` ends: the top-level `,` or `)` after it; None while
    it may still grow; -1 at a bracket it did not open."""
    depth, quote, i = 0, "", at
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 2
            elif text.startswith(quote, i):
                i, quote = i + len(quote), ""
            else:
                i += 1
            continue
        if c in "\"'":
            if len(text) - i < 3 and (c * 3).startswith(text[i:]):
                return None  # a quote, or the start of a triple quote
            quote = c * 3 if text.startswith(c * 3, i) else c
            i += len(quote)
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}" and depth:
            depth -= 1
        elif c in ")]}" or (c == "," and not depth):
            return i if c in ",)" else -1
        i += 1
    return None
