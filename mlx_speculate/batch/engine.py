"""Continuous batching with speculation per sequence: sequences join and leave between steps,
and each step verifies every running sequence's own draft in one target forward.

A sequence comes with its `Session`, whose `Sequence` (sequence.py: its context, drafter and
one-sequence cache, the server's prompt-prefix cache) is what the engine schedules, through the
operations the single-stream loop uses too. Its prompt is prefilled a chunk per engine step,
together with up to PREFILL_ROWS - 1 other joining prompts in one forward (batch/prefill.py), so
running streams keep flowing while it joins; then its keys move into a row of the batch cache
(batch/cache.py) and it decodes there: each step, its
drafter proposes (or not) as it would alone (`Sequence.plan`: grammar and room included),
its tree is padded to the step's width, and one forward of (rows, width) tokens at each row's
own slots and positions verifies them all. Each row's acceptance follows its own rule
(greedy, or lossless rejection sampling at its own settings) on its own rows alone, so a
sequence's output is what it would be alone, and it commits through `Sequence.commit` as it
would alone. When it ends (its stop, length, context, cancellation or error), its keys go back
to its session's cache.

A sequence with no other decoding or waiting beside it decodes alone, on its own cache, through
the single-stream scheduler (`Decoder.resume`: each step queued before the last one is read,
fused drafters fused), so that one client gets what `--max-batch 1` gives; when another comes,
its last queued step is read first and its keys move into a row of the batch, and when the
batch is down to one it goes on alone again. A seeded sequence stays in the batch, whose
per-sequence reseeding makes its draws the same beside any others.

A fused drafter's row (EAGLE, MTP, DFlash) drafts as its step alone does: its acceptance rule
and its drafter's next draft run inside the batch step's graph (`batch.step.FusedRow`), so its
next proposal is that draft, with no drafting call of its own between steps (a seeded request's
row, whose draws come from its own seed, drafts by `propose`).

Host syncs per step: one `mx.eval` of every row's acceptance; drafters and grammars add
their own as they do alone. A prefill step is evaluated before the decoding step is built.
The planner (policy/batch.py) sets the step's width from measured step costs and each sequence's
acceptance. A hybrid target's rows keep their own recurrent state (`BatchHybridCache`),
rolled back per row on the device; they verify chains only, and their prompts prefill together
too (a padded row's padding leaves its state as it was). Length-dependent rope types are
refused (`check_batchable`): their rotation depends on the longest position, which differs per
row.
"""

from __future__ import annotations

import secrets
import time
from collections import abc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..decode import Decoder
from ..device import GENERATION_STREAM
from ..drafters.base import Draft, TargetFeatures
from ..generation import GenerationResponse, Responder, Session
from ..grammar import Grammar
from ..grammar.constraint import Constraint, Guide, masked
from ..graphs import built
from ..models.base import CausalLM
from ..policy.adaptive import Policy
from ..policy.batch import Acceptance as Rate
from ..policy.batch import BatchPlanner
from ..policy.costs import cached_costs
from ..sampling import SamplingParams
from ..sequence import Prefill, Sequence, Step, finite
from ..step import Then, bucket
from ..tree import ROOT, Tree
from ..verify import Acceptance
from .cache import BatchKVCache
from .prefill import PrefillGroup
from .step import FusedRow, forward


def rows_bucket(n: int, most: int) -> int:
    """Batch rows for `n` sequences: a batch grows and shrinks by powers of two, up to `most`."""
    return min(most, 1 << (max(1, n) - 1).bit_length())


def check_batchable(model: CausalLM) -> None:
    """ValueError (one line) when sequences of `model` cannot share a batch forward."""
    if model.implementation != "native":
        raise ValueError(
            f"{model.args.model_type} runs through mlx-lm's module, whose caches hold one "
            "sequence: serve it one request at a time (--max-batch 1)"
        )
    if not model.traceable:  # a forward that reads the host offset (models/base.py)
        raise ValueError(
            "the model's rope frequencies depend on the longest position, which differs per "
            "sequence: serve it one request at a time (--max-batch 1)"
        )


@dataclass(eq=False)
class Handle:
    """One sequence in the engine, as its caller sees it: what it asked for, then what it got.
    `responses` are taken by `BatchEngine.step`'s caller; `done` once it ended (`error` set
    when it failed: its session's state is then not to be trusted)."""

    session: Session
    prompt: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()
    grammar: Grammar | None = None
    num_draft_tokens: int | None = None  # a cap on its drafts per step; None: its drafter's
    # Its draft lengths while it decodes alone (the method's adaptive policy, or a fixed one):
    # what `--max-batch 1` follows. None: the batch planner's, for one row.
    policy: Policy | None = None
    cancelled: Callable[[], bool] = lambda: False
    submitted: float = field(default_factory=time.perf_counter)
    done: bool = False
    cancelled_out: bool = False  # ended by `cancelled`
    error: Exception | None = None
    last: GenerationResponse | None = None
    responses: list[GenerationResponse] = field(default_factory=list)

    def take(self) -> list[GenerationResponse]:
        """The responses not taken yet, in order."""
        responses, self.responses = self.responses, []
        return responses


@dataclass(eq=False)
class _Running:
    """A sequence's state inside the engine."""

    handle: Handle
    constraint: Constraint | None
    responder: Responder | None = None
    prefill: Prefill | None = None
    row: int = -1
    rate: Rate = field(default_factory=Rate)
    draws: int = 0  # steps that drew from its seeded generator

    def reseed(self) -> bool:
        """Seeds the generator for this sequence's next random draws when its request has a
        seed, so that they do not depend on the other sequences' (True: it did)."""
        seed = self.handle.sampling.seed
        if seed is None:
            return False
        mx.random.seed((seed * 1_000_003 + self.draws) % 2**63)
        self.draws += 1
        return True

    @property
    def fixed(self) -> int:
        """The draft length its request fixed (0: none, the planner's to choose)."""
        asked = self.handle.num_draft_tokens
        return 0 if asked is None else self.cap

    @property
    def may_decode_alone(self) -> bool:
        """Whether it may decode outside the batch when no other runs: not when its draws are
        seeded, which repeat beside any others only as the batch reseeds them (`reseed`)."""
        return self.handle.sampling.seed is None

    @property
    def sequence(self) -> Sequence:
        return self.handle.session.sequence

    @property
    def cap(self) -> int:
        cap, asked = self.sequence.cap, self.handle.num_draft_tokens
        return cap if asked is None else min(cap, asked)


@dataclass(frozen=True)
class _Alone:
    """The one sequence decoding while no other runs or waits: `Decoder.resume`'s steps on its
    own cache, each queued before the last is read, as `--max-batch 1` decodes it."""

    running: _Running
    steps: Iterator[Step]


@dataclass(frozen=True)
class _AlonePolicy:
    """The draft lengths of a sequence decoding alone, as the `Policy` its decoder asks: its
    handle's policy where it has one (as `--max-batch 1` decodes it), else the planner's for a
    batch of one row. Its outcomes also update the sequence's acceptance rate, which it keeps
    when it goes back into the batch."""

    planner: BatchPlanner
    running: _Running

    def choose(self) -> int:
        r = self.running
        cap = r.cap
        if cap == 0:  # no drafts (plain decoding): no width to plan, on every token
            return 0
        if r.handle.policy is not None:
            return r.handle.policy.choose()
        cap = cap if r.sequence.room() > 0 else 0
        return self.planner.width(1, [cap], [r.rate.rate], 1 + r.fixed) - 1

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        self.running.rate.observe(drafted, accepted)
        if self.running.handle.policy is not None:
            self.running.handle.policy.observe(drafted, accepted, seconds)


class BatchEngine:
    """Runs many generations over one model: `add` sequences, call `step` until `idle`."""

    def __init__(self, model: CausalLM, max_batch: int = 32):
        if max_batch < 1:
            raise ValueError(f"a batch holds at least 1 sequence, got {max_batch}")
        check_batchable(model)
        self.model = model
        self.max_batch = max_batch
        self.planner = BatchPlanner(cached_costs(model))
        self.cache = BatchKVCache.of(model, 1)
        self._waiting: list[_Running] = []  # to prefill, first come first served
        self._prefills = PrefillGroup(model)  # the waiting ones' prefills under way
        self._running: list[_Running] = []  # decoding; running[i] holds cache row i
        self._alone: _Alone | None = None  # the one decoding outside the batch's cache
        self.last_rows = 0  # the last decoding step's rows, padding included (metrics)
        self._shrink = False  # sequences left: fit the cache's rows after the step
        self._deferred = False  # the last round left out its decoding step (`step`)

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._running and self._alone is None

    @property
    def size(self) -> int:
        """Sequences decoding (in the batch, or one alone)."""
        return len(self._running) + (self._alone is not None)

    @property
    def load(self) -> int:
        """Sequences in the engine: decoding, prefilling or waiting for a row."""
        return self.size + len(self._waiting)

    def add(self, handle: Handle) -> None:
        """Queues `handle`'s generation; ValueError (one line) for a prompt it cannot run."""
        session = handle.session
        if session.model is not self.model:
            raise ValueError("the session's model is not the engine's")
        constraint = None
        if handle.grammar is not None:
            constraint = Constraint(handle.grammar, session.tokenizer, self.model.args.vocab_size)
        running = _Running(handle, constraint)
        running.prefill = session.sequence.begin_prefill(handle.prompt, sized=True)
        started = time.perf_counter()
        running.responder = Responder(
            session.tokenizer,
            len(handle.prompt),
            running.prefill.kept,
            handle.max_tokens,
            handle.stop,
            started,
        )
        self._waiting.append(running)

    def step(self) -> list[Handle]:
        """One round: a prefill chunk of up to PREFILL_ROWS waiting sequences in one forward
        (each joins once done and a row is free, first come first served), then one decoding
        step of the batch. Returns the handles that got responses or ended in it; a sequence's
        failure ends it alone (a failing prefill forward, the sequences in it). A round whose
        prefill gave first tokens returns them before decoding, unless the round before did
        too: the first token does not wait for the batch's step, and the running sequences
        wait for at most one such round in a row."""
        touched: dict[int, Handle] = {}
        self.last_rows = 0
        with mx.stream(GENERATION_STREAM):
            alone = [] if self._alone is None else [self._alone.running]
            for running in [*self._waiting, *self._running, *alone]:
                if not running.handle.done and running.handle.cancelled():
                    running.handle.cancelled_out = True
                    self._end(running)
                    touched[id(running.handle)] = running.handle
            stepped = self._alone is not None and bool(self._waiting)
            if stepped:  # others are on their way: its queued step is read, none queued after
                for handle in self._step_alone():
                    touched[id(handle)] = handle
            first = False
            if self._waiting:
                for handle in self._prefill():
                    touched[id(handle)] = handle
                    first = True
            defer = first and not self._deferred
            self._deferred = defer
            if self._alone is not None and not (defer or stepped):
                for handle in self._step_alone():
                    touched[id(handle)] = handle
            if self._running and not defer:
                for handle in self._decode():
                    touched[id(handle)] = handle
            if self._shrink:  # sequences left: a smaller bucket may hold the rest
                self._shrink = False
                self._fit_rows()
            if len(self._running) == 1 and not self._waiting and self._alone is None:
                self._leave_batch()
        return list(touched.values())

    def _prefill(self) -> Iterator[Handle]:
        """The waiting sequences' next chunks in one forward, then the prefilled ones join."""
        group = self._prefills
        # A padded row would write its padding past its end into a ring's window (rings hold
        # RING_ROWS slots past the end): one by one.
        if self.cache.ring_size is not None:
            running = next((r for r in self._waiting if not r.prefill.done), None)
            try:
                if running is not None:
                    running.prefill.chunk()
            except Exception as e:  # this request's, not the batch's
                self._fail(running, e)
                yield running.handle
        else:
            for running in self._waiting:
                if group.full:
                    break
                if not running.prefill.done and running.prefill not in group.members:
                    group.add(running.prefill)
            try:
                group.step(idle=not self._running and self._alone is None)
            except Exception as e:  # the forward's requests', not the batch's
                failed = group.clear()
                for running in [r for r in self._waiting if r.prefill in failed]:
                    self._fail(running, e)
                    yield running.handle
        for running in list(self._waiting):
            if len(self._running) >= self.max_batch:
                break
            if not running.prefill.done:
                continue
            self._waiting.remove(running)
            try:
                self._join(running)
            except Exception as e:  # this request's, not the batch's
                self._fail(running, e)
            yield running.handle

    def _join(self, running: _Running) -> None:
        """The first token, from the prompt's forward; then a row, unless that token ended it,
        or, with no other sequence decoding or waiting, the steps alone (`_go_alone`)."""
        sequence, handle = running.sequence, running.handle
        sequence.start(
            handle.sampling,
            max_tokens=handle.max_tokens,
            typical_acceptance=handle.session.typical_acceptance,
            constraint=running.constraint,
        )
        if self._alone is not None:  # it has company now
            alone, self._alone = self._alone, None
            alone.steps.close()
            self._enter_batch(alone.running)
        if not (self._running or self._waiting) and running.may_decode_alone:
            self._go_alone(running, fresh=True)
            for _ in self._step_alone():  # the first token; the first step queued behind it
                pass
            return
        seeded = running.reseed()
        acceptance, logits, guide = sequence.first()
        ok = finite(logits)
        mx.eval(acceptance.tokens, ok)
        token = acceptance.tokens.tolist()[0]
        if seeded:
            _unseed()
        step = sequence.commit(
            [token], [0], logits, ROOT, guide, None, finite=ok.item(), verified=False
        )
        if not self._emit(running, step):
            self._enter_batch(running)

    def _enter_batch(self, running: _Running) -> None:
        """The next row of the batch's cache takes the sequence's keys."""
        sequence = running.sequence
        running.row = len(self._running)
        self._running.append(running)
        self._fit_rows()
        self.cache.insert(running.row, sequence.cache, sequence.cache.offset)

    def _leave_batch(self) -> None:
        """The batch's last sequence takes its keys back and decodes alone, if it may."""
        running = self._running[0]
        if not running.may_decode_alone:
            return
        self.cache.extract(0, running.sequence.cache, self.cache.offsets[0])
        self._running.pop()
        running.row = -1
        self._fit_rows()
        self._go_alone(running, fresh=False)

    def _go_alone(self, running: _Running, fresh: bool) -> None:
        """Decodes `running` alone from now on, on its own cache: from its first token
        (`fresh`), else after the steps it committed in the batch."""
        decoder, policy = Decoder(running.sequence), _AlonePolicy(self.planner, running)
        start = decoder.run if fresh else decoder.resume
        self._alone = _Alone(running, start(policy, lambda: not self._waiting))

    def _step_alone(self) -> Iterator[Handle]:
        """The lone sequence's next step (queued last round, unless others wait), emitted."""
        assert self._alone is not None
        running = self._alone.running
        try:
            step = next(self._alone.steps, None)
        except Exception as e:  # this request's, not the engine's
            self._fail(running, e)
            yield running.handle
            return
        if step is None:  # no room left: the responses ended it already
            self._end(running)
        else:
            if step.verified:
                self.last_rows = 1 + step.drafted
            self._emit(running, step)
        yield running.handle

    def _decode(self) -> Iterator[Handle]:
        """One verify forward of every running sequence's draft."""
        began, traces = time.perf_counter(), built()
        running = list(self._running)
        caps = [r.cap if r.sequence.room() > 0 else 0 for r in running]
        least = 1 + max((r.fixed for r in running), default=0)
        rates = [r.rate.rate for r in running]
        width = self.planner.width(self.cache.rows, caps, rates, least)
        planned: list[tuple[Draft | None, Guide | None] | None] = []
        thens: dict[int, Then] = {}  # fused rows' next drafts, by id of their `_Running`
        seeded = False
        for r in running:
            try:
                seeded |= r.reseed()
                draft, guide = r.sequence.plan(min(width - 1, r.cap))
                if draft is not None:  # a hybrid's recurrent rows follow chains only
                    self.cache.check_verify(draft.tree.num_nodes, draft.tree.is_chain)
                    then = self._then(r, guide)
                    if then is not None:
                        thens[id(r)] = then
                planned.append((draft, guide))
            except Exception as e:
                planned.append(None)
                self._fail(r, e)
                yield r.handle
        live = [(r, p) for r, p in zip(running, planned, strict=True) if p is not None]
        if not live:
            return
        trees = [ROOT if draft is None else draft.tree for _, (draft, _) in live]
        chains = all(t.is_chain for t in trees)
        n = max(t.num_nodes for t in trees)
        n = n if chains else bucket(n)  # trees of nearby sizes share a compiled forward
        rows = self.cache.rows
        tokens = np.zeros((rows, n), dtype=np.int32)
        for r, _ in live:
            tokens[r.row, 0] = r.sequence.context[-1]
        # Each row's nodes at their depths after its offset, seeing their ancestors (a tree's
        # padding nodes hang off its root; rows no sequence holds see themselves alone). On
        # the device: an EAGLE tree is chosen there.
        depths = [mx.arange(n, dtype=mx.int32)] * rows
        seen = [mx.eye(n, dtype=mx.bool_)] * rows
        batch_tokens = mx.array(tokens)
        for (r, (draft, _)), tree in zip(live, trees, strict=True):
            if tree.num_nodes == 1:
                continue
            padded = tree.padded(n)
            depths[r.row], seen[r.row] = padded.depth_index, padded.ancestors
            # Draft tokens may be lazy (a draft model's): they go in on the device.
            at = mx.array([r.row, 1], dtype=mx.int32)
            row = draft.tokens.astype(mx.int32).reshape(1, -1)
            batch_tokens = mx.slice_update(batch_tokens, row, at, (0, 1))
        offsets = mx.array(self.cache.offsets, dtype=mx.int32)[:, None]
        positions = offsets + mx.stack(depths)
        mask = None if chains else mx.stack(seen)
        taps = tuple(sorted({t for r, _ in live for t in r.sequence.taps}))
        fused = {
            id(r): FusedRow.of(
                r.row,
                n,
                draft.tree,
                draft.tokens,
                draft.logprobs,
                r.sequence.rule,
                tuple(taps.index(t) for t in r.sequence.taps),
                thens[id(r)],
            )
            for r, (draft, _) in live
            if id(r) in thens
        }
        if seeded and fused:  # their draws in the graph follow no other sequence's seed
            _unseed()
        self.cache.prepare(n)
        step = forward(
            self.model, self.cache, batch_tokens, positions, mask, taps, tuple(fused.values())
        )
        out, fused_out = step.model, dict(zip(fused, step.fused, strict=True))
        verdicts: list[tuple[Acceptance, mx.array]] = []
        for (r, (draft, guide)), tree in zip(live, trees, strict=True):
            logits = masked(out.logits[r.row, : tree.num_nodes], guide)
            if id(r) in fused_out:
                acceptance, following = fused_out[id(r)]
                r.sequence.drafter.received(following)
                verdicts.append((acceptance, logits))
                continue
            tokens_in = mx.zeros((0,), mx.int32) if draft is None else draft.tokens
            q = None if draft is None else draft.logprobs
            seeded |= r.reseed()
            verdicts.append((r.sequence.rule(tree, tokens_in, logits, q), logits))
        if seeded:
            _unseed()
        oks = finite(out.logits)  # (B,) per row, read with the verdicts
        mx.eval([a for v, _ in verdicts for a in (v.tokens, v.num_accepted, v.path)], oks)
        oks = oks.tolist()
        seconds = time.perf_counter() - began
        if built() == traces:  # a step that traced a graph prices nothing (decode.py too)
            self.planner.observe(rows, n, seconds)
        self.last_rows = rows * n
        paths = np.tile(np.arange(n, dtype=np.int32), (rows, 1))
        compacting = False
        commits = []
        for (r, (_, guide)), tree, (verdict, logits) in zip(live, trees, verdicts, strict=True):
            accepted = verdict.num_accepted.item()
            path = verdict.path.tolist()[: accepted + 1]
            emitted = verdict.tokens.tolist()[: accepted + 1]
            if path != list(range(accepted + 1)):
                paths[r.row, : accepted + 1] = path
                compacting = True
            commits.append((r, r.row, guide, tree, accepted, path, emitted, logits))
        if compacting:
            self.cache.compact(self.cache.start, mx.array(paths))
        for r, b, guide, tree, accepted, path, emitted, logits in commits:
            try:
                features = None
                if r.sequence.drafter is not None and id(r) not in fused_out:
                    index = [taps.index(t) for t in r.sequence.taps]
                    features = TargetFeatures(out.hidden[b], tuple(out.taps[i][b] for i in index))
                self._commit(
                    r,
                    features,
                    guide,
                    tree,
                    accepted,
                    path,
                    emitted,
                    logits,
                    seconds,
                    oks[b],
                    settled=id(r) in fused_out,
                )
            except Exception as e:  # this request's (its grammar, its drafter), not the batch's
                self._fail(r, e)
            yield r.handle

    def _then(self, running: _Running, guide: Guide | None) -> Then | None:
        """The drafted row's next draft, to run in the step's graph with its rule, as its
        step alone does (`Sequence.then`); None under a grammar's guide, for a seeded request
        (its draws come from its own seed, outside the graph), or when its drafter cannot."""
        if guide is not None or running.handle.sampling.seed is not None:
            return None
        return running.sequence.then()

    def _commit(
        self,
        running: _Running,
        features: TargetFeatures | None,
        guide: Guide | None,
        tree: Tree,
        accepted: int,
        path: list[int],
        emitted: list[int],
        logits: mx.array,
        seconds: float,
        ok: bool,
        settled: bool = False,
    ) -> None:
        """Commits a row's accepted path (its keys are in place in the row: the offset moves
        over them) through `Sequence.commit`, as alone (`features`: the row's, for its
        drafter; `settled`: its drafter drafted in the step already, and takes the count),
        and ends the sequence when that finished it."""
        self.cache.offsets[running.row] += accepted + 1
        step = running.sequence.commit(
            emitted,
            path,
            logits,
            tree,
            guide,
            features,
            settled=settled,
            seconds=seconds,
            finite=ok,
        )
        if guide is None:
            running.rate.observe(step.drafted, accepted)
        self._emit(running, step)

    def _emit(self, running: _Running, step: Step) -> bool:
        """Hands the responses a committed step's tokens, then a forced ending the grammar has
        after them (emitted without a forward, as alone); True (and ended) when done."""
        if self._respond(running, step):
            return True
        ending = running.sequence.ending()
        if ending is not None:
            self._respond(running, ending)
            self._end(running)
            return True
        return False

    def _respond(self, running: _Running, step: Step) -> bool:
        """Feeds a step's tokens to the sequence's responses; True (and ended) when done."""
        sequence, handle = running.sequence, running.handle
        responder = running.responder
        for response in responder.feed(step, sequence.room() < 0, sequence.context_full):
            handle.last = response
            handle.responses.append(response)
        if responder.finished or sequence.room() < 0:
            self._end(running)
            return True
        return False

    def _fail(self, running: _Running, error: Exception) -> None:
        running.handle.error = error
        self._end(running)

    def _end(self, running: _Running) -> None:
        """Takes a sequence out: its keys back to its session's cache, its row to another."""
        handle = running.handle
        handle.done = True
        if self._alone is not None and self._alone.running is running:
            self._alone.steps.close()  # a step it queued is dropped, as alone
            self._alone = None
            return
        if running in self._waiting:
            self._waiting.remove(running)
            self._prefills.remove(running.prefill)
            return
        if running not in self._running:
            return
        row = running.row
        self.cache.extract(row, running.sequence.cache, self.cache.offsets[row])
        last = self._running.pop()
        if last is not running:
            self._running[row] = last
            self.cache.move(last.row, row)
            last.row = row
        running.row = -1
        self._shrink = True

    def _fit_rows(self) -> None:
        """The cache's rows: the smallest bucket that holds the running sequences."""
        need = rows_bucket(len(self._running), self.max_batch)
        if need != self.cache.rows:
            self.cache.resize(need)


def _unseed() -> None:
    """Seeds the generator afresh after a seeded sequence's draws, so that the unseeded ones'
    draws do not repeat from run to run."""
    mx.random.seed(secrets.randbits(63))


def batch_stream(
    engine: BatchEngine, handles: abc.Sequence[Handle]
) -> Iterator[tuple[int, GenerationResponse]]:
    """Runs `handles` to their ends: yields (index, response) as the steps produce them."""
    index = {id(h): i for i, h in enumerate(handles)}
    for h in handles:
        engine.add(h)
    while not engine.idle:
        for h in engine.step():
            for response in h.take():
                yield index[id(h)], response
            if h.error is not None:
                raise h.error
