"""Splits a model's output, as it streams, into content and tool calls (formats: tools.py).

Streamed (`eager`), a call goes out token by token, as OpenAI streams one: its first delta
names it (index, id, name) as soon as the call's head `{"name": "<offered tool>",
"arguments": {` is read, and each later delta carries the arguments text the model just
wrote, released only while it is still a prefix of valid JSON. A call whose head is
anything else (keys in another order, arguments as a string) is sent whole once its text is
complete, as are all calls of a response that is not streamed. Pythonic calls stream
argument by argument (pythonic_calls.py).

A call that does not parse is content, as the model wrote it. Only a streamed call can turn
out malformed after it went out: its arguments then stop at the last character that kept
them valid JSON (a truncated call, as OpenAI sends one cut by max_tokens) and the text from
the one that broke them on is content. A response that is not streamed has no such calls,
unless max_tokens cut it: then it reads as its stream does (`Tools.whole`), so that a call cut
short comes back with the arguments written so far and finish_reason "length", as OpenAI
returns one, never as half a call in the content. Under a forced call (`Tools.forced`: a
grammar holds the output to calls) any text that is not a call is a call cut short, and is
dropped.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, replace

from .json_prefix import JsonPrefix
from .pythonic_calls import BROKEN, DONE, PythonicCalls
from .tools import (
    CLOSE,
    FENCE,
    FORMATS,
    HERMES,
    JSON,
    OPEN,
    PYTHON_START,
    PYTHON_TAG,
    PYTHONIC,
    CallDelta,
    call_from,
    call_id,
    parse_json_calls,
    parse_pythonic_calls,
)

# What output that is calls starts with, in the formats where the whole output is the calls.
OPENERS = {JSON: (PYTHON_TAG, FENCE, "{", "["), PYTHONIC: (PYTHON_TAG, PYTHON_START, "[")}


Piece = str | CallDelta  # content text, or part of a call


@dataclass(frozen=True)
class Tools:
    """What tool calls a response may hold: their format, the offered tools' names, whether
    there may be several (`parallel`; if not, calls past the first are dropped), and whether
    the output is calls only (`forced`: tool_choice requires one, and a grammar holds it)."""

    format: str
    names: frozenset[str]
    parallel: bool = True
    forced: bool = False

    def parser(self, *, eager: bool) -> ToolParser:
        return ToolParser(
            self.format, self.names, eager=eager, parallel=self.parallel, forced=self.forced
        )

    def whole(self, text: str, *, cut: bool) -> tuple[list[Piece], bool]:
        """The content and calls of a whole output, each call one CallDelta with all its
        arguments, and whether it holds a call. Each call is read whole (one that does not
        parse is content), unless the output was `cut` by max_tokens: then it is read as it
        streams, so a call cut short keeps the arguments written so far."""
        parser = self.parser(eager=cut)
        pieces: list[Piece] = []
        at: dict[int, int] = {}  # where each call is in `pieces`
        for piece in [*parser.feed(text), *parser.end()]:
            if isinstance(piece, CallDelta) and piece.name is None:  # more of its arguments
                call = pieces[at[piece.index]]
                pieces[at[piece.index]] = replace(call, arguments=call.arguments + piece.arguments)
                continue
            if isinstance(piece, CallDelta):
                at[piece.index] = len(pieces)
            pieces.append(piece)
        return pieces, parser.called


def _partial_tail(text: str, marker: str) -> int:
    """Length of the tail of `text` that could still grow into `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _head(text: str, names: Collection[str]) -> tuple[int, str] | str:
    """Where the arguments object starts in `text` when it opens with a call's head
    `{"name": "<one of names>", "arguments": {` (or "parameters"), and the name; "more" when
    it may still grow into one; "no" when it cannot."""
    at, name, offered = 0, "", tuple(names)
    steps = ["{", ("name",), ":", offered, ",", ("arguments", "parameters"), ":", "{"]
    for step in steps:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return "more"
        if isinstance(step, str):
            if text[at] != step:
                return "no"
            at += 1
            continue
        if text[at] != '"':
            return "no"
        end = text.find('"', at + 1)
        word = text[at + 1 : len(text) if end < 0 else end]
        if end < 0:
            return "more" if any(w.startswith(word) for w in step) else "no"
        if word not in step:
            return "no"
        if step is offered:
            name = word
        at = end + 1
    return at - 1, name


class ToolParser:
    """Content and calls of the tools `names` in output of `format_` (one of FORMATS), fed
    in pieces. Whitespace next to a call is dropped; other content comes out as soon as it
    cannot be part of a call (`forced`: the output is calls only, so there is none)."""

    def __init__(
        self,
        format_: str,
        names: Collection[str],
        *,
        eager: bool,
        parallel: bool = True,
        forced: bool = False,
    ):
        if format_ not in FORMATS:
            raise ValueError(f"tool-call format {format_!r} is unknown (known: {FORMATS})")
        self.format = format_
        self.names = set(names)
        self.eager = eager
        self.parallel = parallel
        self.forced = forced
        self.calls = 0  # calls begun, kept or not
        self._buffer = ""
        # outside (content, or between calls), head (a call's head being read), arguments
        # (streaming them), tail (after them: the call's "}" and its closer), whole (a call
        # read to its end), content (the rest of the output is content)
        self._state = "outside"
        self._json: JsonPrefix | None = None
        self._pythonic: PythonicCalls | None = None
        self._space = ""  # whitespace held back: dropped if a call follows
        self._after_call = False  # whitespace here is dropped: it only separates calls
        self._decided = format_ == HERMES  # json, pythonic: whether it looked like calls yet

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while self._step(pieces, final=False):
            pass
        return self._kept(pieces)

    @property
    def called(self) -> bool:
        """Whether the output holds a call (kept, so the response's reason is "tool_calls")."""
        return self.calls > 0

    def _kept(self, pieces: list[Piece]) -> list[Piece]:
        if self.parallel:
            return pieces
        return [p for p in pieces if not (isinstance(p, CallDelta) and p.index)]

    def end(self) -> list[Piece]:
        """What is left once the output ended: an unclosed or unparsed call is content."""
        pieces: list[Piece] = []
        while self._step(pieces, final=True):
            pass
        if self._buffer:
            self._content(self._buffer, pieces)
            self._buffer = ""
        if self._space and not self.calls:
            pieces.append(self._space)
        self._space = ""
        return self._kept(pieces)

    # Each step consumes what it can of the buffer; True when another step may go further.
    def _step(self, pieces: list[Piece], *, final: bool) -> bool:
        state = self._state
        if state == "outside":
            return self._outside(pieces, final)
        if state == "head":
            return self._read_head(pieces, final)
        if state == "arguments":
            return self._arguments(pieces)
        if state == "tail":
            return self._tail(pieces, final)
        if state == "content":
            return self._content_to_end(pieces)
        if state == "pythonic":
            return self._read_pythonic(pieces, final)
        return self._whole(pieces, final)

    def _outside(self, pieces: list[Piece], final: bool) -> bool:
        if self.format != HERMES:
            return self._calls_outside(pieces, final)
        at = self._buffer.find(OPEN)
        if at < 0:
            keep = 0 if final else _partial_tail(self._buffer, OPEN)
            self._content(self._buffer[: len(self._buffer) - keep], pieces)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        self._content(self._buffer[:at], pieces)
        self._buffer = self._buffer[at + len(OPEN) :]
        self._state = "head" if self.eager else "whole"
        return True

    def _calls_outside(self, pieces: list[Piece], final: bool) -> bool:
        """The formats whose output is calls or content; between streamed calls, separators."""
        head = self._buffer.lstrip()
        if not self._decided:
            openers = OPENERS[self.format]
            if not head.startswith(openers):
                if head and not any(o.startswith(head) for o in openers):
                    self._state = "content"
                    return self._content_to_end(pieces)
                if not final:
                    return False
            self._decided = True
            self._state = "whole"
            if self.eager:
                self._state = "head" if self.format == JSON else "pythonic"
                self._pythonic = PythonicCalls(self.names)
            return True
        # Between streamed calls: separators, a list's or a fence's end.
        rest = head.lstrip(";,]`\n ")
        if not rest:
            if final:
                self._buffer = ""
            return False
        if rest.startswith("{"):
            self._buffer = rest
            self._state = "head"
            return True
        self._after_call = True
        self._state = "content"
        return self._content_to_end(pieces)

    def _content_to_end(self, pieces: list[Piece]) -> bool:
        self._content(self._buffer, pieces)
        self._buffer = ""
        return False

    def _read_head(self, pieces: list[Piece], final: bool) -> bool:
        text = self._buffer
        if self.format == JSON and not self.calls:  # what may open the calls
            text = text.lstrip().removeprefix(PYTHON_TAG).lstrip()
            if text.startswith(FENCE):
                text = text[len(FENCE) :].removeprefix("json")
            text = text.lstrip().removeprefix("[")
        head = _head(text, self.names)
        if head == "more" and not final and (self.format == JSON or CLOSE not in text):
            return False
        if isinstance(head, str):
            self._state = "whole"
            return True
        at, name = head
        self._space = ""
        self._after_call = False
        pieces.append(CallDelta(self.calls, "", call_id(), name))
        self.calls += 1
        self._buffer = text[at:]
        self._json = JsonPrefix()
        self._state = "arguments"
        return True

    def _arguments(self, pieces: list[Piece]) -> bool:
        taken = 0
        for c in self._buffer:
            if not self._json.push(c):
                break
            taken += 1
            if self._json.done:
                break
        if taken:
            pieces.append(CallDelta(self.calls - 1, self._buffer[:taken]))
        self._buffer = self._buffer[taken:]
        if self._json.done:
            self._state = "tail"
            return True
        if self._buffer:  # a character no JSON could continue with: the call is cut here
            self._broken()
            return True
        return False

    def _read_pythonic(self, pieces: list[Piece], final: bool) -> bool:
        """Streamed pythonic calls (pythonic_calls.py): until one goes out, output that is
        not calls is left to the whole-output parser; after, what breaks them is content."""
        deltas, status = self._pythonic.read(self._buffer, final)
        pieces.extend(deltas)
        self.calls = self._pythonic.calls
        if status == DONE:
            self._buffer = ""
        elif status == BROKEN and not self.calls:
            self._state = "whole"
            return True
        elif status == BROKEN:
            self._buffer = self._buffer[self._pythonic.sent :]
            self._broken()
            return True
        return False

    def _tail(self, pieces: list[Piece], final: bool) -> bool:
        closer = "}" + (CLOSE if self.format == HERMES else "")
        text = "".join(self._buffer.split())  # the closer's parts may be spaced out
        if closer.startswith(text) and not final:
            return False
        if text.startswith(closer):
            used = 0
            for c in closer:  # how much of the buffer the closer and its spaces take
                used = self._buffer.index(c, used) + 1
            self._buffer = self._buffer[used:]
            self._state = "outside"
            self._after_call = True
            return True
        self._broken()
        return True

    def _broken(self) -> None:
        """A streamed call cut short: what follows is content."""
        self._state = "outside" if self.format == HERMES else "content"
        self._decided = True

    def _whole(self, pieces: list[Piece], final: bool) -> bool:
        """A call read whole: hermes up to its close tag; the others, to the end of the output."""
        if self.format == HERMES:
            at = self._buffer.find(CLOSE)
            if at < 0:
                if final:
                    self._content(OPEN + self._buffer, pieces)
                    self._buffer = ""
                return False
            body, self._buffer = self._buffer[:at], self._buffer[at + len(CLOSE) :]
            self._state = "outside"
            try:
                calls = [call_from(json.loads(body), self.names)]
            except json.JSONDecodeError:
                calls = [None]
            if calls[0] is None:
                self._content(OPEN + body + CLOSE, pieces)
                return True
        else:
            if not final:
                return False
            parse = parse_json_calls if self.format == JSON else parse_pythonic_calls
            calls = parse(self._buffer, self.names)
            if calls is None:
                return self._content_to_end(pieces)
            self._buffer = ""
        self._space = ""
        for call in calls:
            pieces.append(CallDelta(self.calls, call.arguments, call.id, call.name))
            self.calls += 1
        self._after_call = True
        return True

    def _content(self, text: str, pieces: list[Piece]) -> None:
        """Emits `text`, holding its trailing whitespace back (and, right after a call,
        dropping its leading whitespace), so that chunking never changes the result. Forced
        calls have no content: such text is a call cut short (by max_tokens or a stop)."""
        if self.forced:
            return
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        body = text.rstrip()
        if body:
            pieces.append(self._space + body)
            self._space = ""
        self._space += text[len(body) :]
