"""The records the server's parts pass each other: a validated generation request, the
events its generation emits (text deltas, a finish or a failure), and the `Job` through which
the event loop reads them from the generation thread. What crosses threads here is plain
Python (text, ids, floats); metrics and responses read these without importing the worker.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ..generation import SpeculativeStats
from ..grammar import Grammar
from ..sampling import SamplingParams


@dataclass(frozen=True)
class Generation:
    """A validated generation request, its prompt already in token ids."""

    tokens: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop: list[str]
    method: str
    num_draft_tokens: int | None = None
    top_logprobs: int | None = None  # alternatives per token; None: no log-probabilities
    grammar: Grammar | None = None  # what the output must follow (structured output)


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]  # the most likely tokens at this position, best first


@dataclass(frozen=True)
class Delta:
    text: str  # may be empty (text held back until a stop string is ruled out)
    logprob: TokenLogprob | None = None  # None for the EOS token and when not asked for


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose cache carried over from an earlier request
    completion_tokens: int
    method: str
    stats: SpeculativeStats | None


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop", "length" or "cancelled"
    usage: Usage | None  # None when cancelled before it started
    stop_sequence: str | None = None  # the stop string that ended it, if one did


@dataclass(frozen=True)
class Failed:
    message: str
    status: int = 500  # 400: the request's own grammar could not be followed
    code: str = "internal"

    @property
    def type(self) -> str:
        """OpenAI's error type for it."""
        return "server_error" if self.status >= 500 else "invalid_request_error"


Event = Delta | Finished | Failed


class Job:
    """One request's generation as the event loop sees it: the events come in order, from
    the worker thread, through an asyncio queue of the loop that submitted it."""

    def __init__(self, request: Generation, ended: Callable[[], None] = lambda: None):
        """`ended` is called once, on the worker thread, as the job's last event is emitted
        (the worker counts the requests it holds by it)."""
        self.request = request
        self.submitted = time.perf_counter()
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()
        self._ended: Callable[[], None] | None = ended

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, event: Event) -> None:
        """From the worker thread. A loop already closed (shutdown) has nobody to tell. The
        last event calls `ended` first: a client that read it finds its place free."""
        if not isinstance(event, Delta) and self._ended is not None:
            ended, self._ended = self._ended, None
            ended()
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:
            self.cancel()

    async def events(self) -> AsyncIterator[Event]:
        while True:
            event = await self._events.get()
            yield event
            if not isinstance(event, Delta):
                return
