"""The prompt-prefix cache: a few `Session`s over the one loaded model, each keeping the KV
cache (and its drafter's state) of the last conversation it served.

A request goes to the session of its speculative method whose cached context shares the
longest prefix with the prompt, when that prefix covers at least half of the prompt the session
last served: the request continues that conversation (turn 2 of a chat prefills only what turn
1 did not) or redoes its last turn. A request that only shares, say, a system prompt takes a
fresh session while there is room, so that two conversations served in turn keep their caches.
At most `max_sessions` idle sessions are kept; past that the least recently used ones are
dropped (when a generation ends, `release`). A session serves one generation at a time: while
the batch engine runs several, each has its own (`acquire` skips busy ones), so the sessions
held are at most `max_sessions` idle plus the generations running, each one context (plus a
draft model's), and back to `max_sessions` once they end.

A session only ever reuses the tokens it verified against the new prompt (`Sequence.prefill`
truncates everything past the shared prefix), so no request sees another's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..drafters import DrafterSpec, LookupSpec, make_drafter
from ..generation import Session
from ..models.base import CausalLM
from ..models.quantized_kv import KVQuantization
from ..parallel.group import shared_policy, shared_spec
from ..policy.adaptive import Policy
from ..sequence import Sequence

NONE = "none"  # the method name that turns speculation off


@dataclass(eq=False)
class Entry:
    method: str
    session: Session
    prompt_tokens: int = 0  # length of the last prompt it served
    busy: bool = False  # serving a generation (until `release`)


class SessionPool:
    """Sessions per speculative method over one model: `methods` maps each method the server
    can serve to its spec ("none" to None); `default` is the one a request gets by default.
    With `group` (a sharded target) the drafters and their draft lengths are rank 0's."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer,
        spec: DrafterSpec | None = None,
        max_sessions: int = 4,
        group: mx.distributed.Group | None = None,
        kv: KVQuantization | None = None,
        max_kv_size: int | None = None,
    ):
        """`kv`, `max_kv_size`: every session's cache quantization and context bound."""
        if max_sessions < 1:
            raise ValueError(f"the prompt cache must hold at least 1 session, got {max_sessions}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_sessions = max_sessions
        self.kv, self.max_kv_size = kv, max_kv_size
        # Checked now: a setting that does not fit the model fails at start, not per request.
        self.max_context = Sequence(model, None, max_kv_size, kv).max_context
        self.group = group
        # Prompt lookup needs nothing loaded, so it is always on offer.
        self.methods: dict[str, DrafterSpec | None] = {NONE: None, LookupSpec.method: LookupSpec()}
        if spec is not None:
            resolved = spec.resolve(model) if group is None else shared_spec(spec, model, group)
            self.methods[spec.method] = resolved
        self.default = NONE if spec is None else spec.method
        # Built once now: a method that does not fit the model fails at start, not per request.
        drafters = {
            name: make_drafter(spec, model, tokenizer)
            for name, spec in self.methods.items()
            if spec is not None
        }
        self.max_draft = {name: drafter.max_draft for name, drafter in drafters.items()}
        self._drafters = drafters  # what each method's policy is calibrated with
        # One draft-length policy per method, shared by its sessions and kept across requests:
        # the costs and acceptance it measured hold for the next conversation too. Only the
        # single-stream loop reads them (the batch engine's planner sets its own widths), so
        # they are built when it first asks (`policy`), or all at once before the server takes
        # requests (`calibrate`); the configured method's now on a sharded target, every rank
        # at the same point.
        self.policies: dict[str, Policy] = {}
        if group is not None and self.default != NONE:
            self.policy(self.default)
        self._entries: list[Entry] = []  # least recently used first

    def acquire(self, method: str, tokens: list[int]) -> Entry:
        """The session to serve `tokens` with `method`, now the most recently used."""
        if method not in self.methods:
            raise ValueError(f"method {method!r} is not served (served: {', '.join(self.methods)})")
        best, shared = None, 0
        for entry in self._entries:
            if entry.method == method and not entry.busy:
                n = entry.session.sequence.reusable(tokens)
                if best is None or n > shared:
                    best, shared = entry, n
        idle = [e for e in self._entries if not e.busy]
        if best is not None and 2 * shared >= best.prompt_tokens:
            entry = best
        elif len(idle) < self.max_sessions:
            entry = self._new(method)
        else:
            entry = idle[0]
            if entry.method != method:
                self._entries.remove(entry)
                entry = self._new(method)
        if entry in self._entries:
            self._entries.remove(entry)
        self._entries.append(entry)
        entry.prompt_tokens = len(tokens)
        entry.busy = True
        return entry

    def policy(self, method: str) -> Policy | None:
        """`method`'s draft-length policy (None for "none"), built on first use: calibrating
        its costs when none are cached."""
        spec = self.methods[method]
        if spec is None:
            return None
        if method not in self.policies:
            self.policies[method] = shared_policy(
                self._drafters[method], self.model, spec.num_draft_tokens, self.group
            )
        return self.policies[method]

    def calibrate(self) -> None:
        """Builds every served method's policy now (prompt lookup's too: always on offer), so
        that no request of a server decoding one at a time waits on a calibration."""
        for method in self.methods:
            self.policy(method)

    def release(self, entry: Entry) -> None:
        """`entry`'s generation ended: another may take its session (and its cached context);
        past `max_sessions` idle ones, the least recently used are dropped."""
        entry.busy = False
        idle = [e for e in self._entries if not e.busy]
        for dropped in idle[: len(idle) - self.max_sessions]:
            self._entries.remove(dropped)

    @property
    def busy(self) -> int:
        """Sessions serving a generation now."""
        return sum(e.busy for e in self._entries)

    def discard(self, entry: Entry) -> None:
        """Drops a session whose state can no longer be trusted (its generation failed)."""
        entry.busy = False
        if entry in self._entries:
            self._entries.remove(entry)

    def __len__(self) -> int:
        return len(self._entries)

    def _new(self, method: str) -> Entry:
        spec = self.methods[method]
        cache = {"kv": self.kv, "max_kv_size": self.max_kv_size}
        if spec is None:
            return Entry(method, Session(self.model, self.tokenizer, **cache))
        drafter = make_drafter(spec, self.model, self.tokenizer)
        session = Session(
            self.model,
            self.tokenizer,
            drafter,
            typical_acceptance=spec.typical_acceptance,
            **cache,
        )
        return Entry(method, session)
