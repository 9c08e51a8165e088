"""The single-stream scheduler: propose -> verify in one target forward -> accept -> commit,
for one `Sequence` (sequence.py holds its state and the operations every scheduler shares;
batch/engine.py schedules many sequences in one forward).

The sequence's prefill runs the whole prompt; its last row gives the first token, and every
position's features reach the drafter (`Drafter.extend`). Every step verifies a draft tree rooted
at the pending token (emitted, not yet in the target cache): a chain, a tree, or the root alone. One
rule (`verify.py`) picks the accepted path and the target's next token; the commit moves the
path's keys/values into consecutive slots (`KVCache.compact`) and `Sequence.commit` hands its
tokens and features on.

Host syncs per step: one `mx.eval` of the acceptance, then `.item()`/`.tolist()` on it; the
draft, forward and rule are one lazy graph, `mx.async_eval`ed once built. A tree forward reads
its largest position only for rope types that depend on it (models/base.py). Under a grammar,
its host-side matcher builds each step's chain or tree and masks from the tokens read, and
reads a drafter's tokens (and EAGLE's tree) back before the verify forward (constraint.py).
A plain step after a plain one is queued on its lazy token before it is read, and a pipelined
drafter's step on its lazy accepted count (`StepBuilder.follow`, when the worst case fits); its
`settle` tells the drafter the count once read. An EAGLE step is fused (`step.Then`): its
compiled verify graph also runs the head over the accepted path, grows the next tree and
compacts the path's keys, so a step is one call and one sync; the next fused step is queued
on its lazy count too (tree, root slot and the head's path start wait on it); `settle` again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx

from .device import GENERATION_STREAM
from .drafters.base import TargetFeatures
from .grammar.constraint import Constraint, Guide
from .graphs import built
from .policy.adaptive import FixedPolicy, Policy
from .sampling import SamplingParams
from .sequence import Sequence, Step, finite
from .step import Verified, verify
from .tree import ROOT, Tree
from .verify import Acceptance


@dataclass(frozen=True)
class _Pending:
    """A queued step: lazy until `_finish` evaluates it."""

    offset: int | None  # cache slot of the root; None: the one after the step before it
    tree: Tree
    acceptance: Acceptance
    logits: mx.array  # (N, V) one row per tree node
    # (N, ...) rows; None for the prompt's first token, whose features went in at prefill
    features: TargetFeatures | None = None
    guide: Guide | None = None  # under a grammar: its chain and masks (constraint.py)
    draft: mx.array | None = None  # a chain's tokens, which the next chain may follow lazily
    fused: bool = False  # the drafter's next draft and the path's compaction ran in the step


class Decoder:
    """Schedules one `Sequence`'s steps (see the module); the sequence prefills its prompts."""

    def __init__(self, sequence: Sequence):
        self.sequence = sequence
        self._clock = (0.0, 0)  # when the last step finished, and graphs traced by then

    def steps(
        self,
        sampling: SamplingParams,
        policy: Policy | None = None,
        *,
        max_tokens: int | None = None,
        typical_acceptance: bool = False,
        constraint: Constraint | None = None,
    ) -> Iterator[Step]:
        """Yields the first token (from the prompt's forward), then one Step per verify forward
        until the context is full or `max_tokens` tokens were emitted (the last step may
        commit a few more). A `constraint` masks every row with its grammar (constraint.py
        says where that syncs more); an ending it forces whole is a step without a forward."""
        sequence = self.sequence
        sequence.start(
            sampling,
            max_tokens=max_tokens,
            typical_acceptance=typical_acceptance,
            constraint=constraint,
        )
        if sampling.seed is not None:
            mx.random.seed(sampling.seed)  # the one generator every draw comes from
        for result in self.run(policy or FixedPolicy(0)):
            yield result
            if sequence.room() < 0:
                return
            ending = sequence.ending(time.perf_counter() - self._clock[0])
            if ending is not None:
                yield ending
                return

    def run(self, policy: Policy, ahead: Callable[[], bool] = lambda: True) -> Iterator[Step]:
        """The steps of a started generation (`Sequence.start`), the first token's first, until
        no room is left: its caller checks its endings between steps. A step is queued before
        the last one is read only while `ahead()` says so; a step read with none queued behind
        it leaves nothing in flight, so that the caller may stop there and take the sequence on
        elsewhere (the batch engine does, when others join it)."""
        sequence = self.sequence
        self._clock = (time.perf_counter(), built())
        acceptance, logits, guide = sequence.first()
        mx.async_eval(acceptance.tokens, acceptance.num_accepted, acceptance.path)
        first = _Pending(len(sequence.context), ROOT, acceptance, logits, guide=guide)
        yield from self._loop(first, policy, ahead)

    def resume(self, policy: Policy, ahead: Callable[[], bool]) -> Iterator[Step]:
        """As `run`, after the generation's last committed step (steps another scheduler ran)."""
        sequence = self.sequence
        self._clock = (time.perf_counter(), built())
        step = StepBuilder(sequence)(mx.array(sequence.context[-1:]), policy.choose())
        yield from self._loop(step, policy, ahead)

    def _loop(self, step: _Pending, policy: Policy, ahead: Callable[[], bool]) -> Iterator[Step]:
        """Finishes `step` and the steps after it, one yielded at a time (see `run`)."""
        sequence = self.sequence
        queue = StepBuilder(sequence)
        while True:
            upcoming = k = None
            early = ahead()
            plain = step.tree.num_nodes == 1 and sequence.constraint is None
            if early and plain and sequence.room() >= 1:
                # Decided one observation early, so that a plain step can be queued on the
                # lazy token before this one is read.
                k = policy.choose()
                if k == 0:
                    upcoming = queue(step.acceptance.tokens[:1], 0)
            elif early and step.draft is not None:
                # A chain or fused EAGLE step: the next draft and verify are queued on its lazy
                # count, so that building them overlaps this verify (room for the worst case).
                k = policy.choose()
                if 0 < k <= sequence.room() - step.tree.num_nodes:
                    upcoming = queue.follow(step, k)
            result = self._finish(step, followed=upcoming is not None and upcoming.offset is None)
            if result.verified:
                seconds = 0.0 if result.traced else result.seconds  # a trace prices nothing
                policy.observe(result.drafted, result.accepted, seconds)
            yield result
            if sequence.room() < 0:
                return
            if upcoming is None:
                k = policy.choose() if k is None else k
                upcoming = queue(mx.array(sequence.context[-1:]), k)
            step = upcoming

    def _finish(self, step: _Pending, followed: bool = False) -> Step:
        """Reads the step's acceptance (the one sync), moves the accepted path's keys into
        place and commits it (`Sequence.commit`); `followed`: the drafter's next chain is
        queued already (`StepBuilder.follow`)."""
        cache = self.sequence.cache
        acceptance = step.acceptance
        ok = finite(step.logits)
        mx.eval(acceptance.tokens, acceptance.num_accepted, acceptance.path, ok)
        n = acceptance.num_accepted.item()
        # Sliced on the host: a lazy slice would be evaluated behind the step queued next.
        tokens = acceptance.tokens.tolist()[: n + 1]
        path = acceptance.path.tolist()[: n + 1]
        root = step.offset
        if root is None:  # queued before the step ahead was read, which ended at the offset
            root = cache.offset
            cache.advance(step.tree.num_nodes)
        if step.fused:  # the step moved the path's keys in place
            cache.truncate(root + n + 1)
        elif step.tree.num_nodes > 1:  # a plain step's one slot is already in place
            if path != list(range(n + 1)):
                cache.compact(root, acceptance.path[: n + 1])
            cache.truncate(root + n + 1)
        # Wall time since the previous step finished: what the step cost the stream, also
        # when it overlapped the one before; traced, when a graph was traced meanwhile.
        now = (time.perf_counter(), built())
        seconds, traced = now[0] - self._clock[0], now[1] != self._clock[1]
        self._clock = now
        return self.sequence.commit(
            tokens,
            path,
            step.logits,
            step.tree,
            step.guide,
            step.features,
            settled=followed or step.fused,
            seconds=seconds,
            traced=traced,
            finite=ok.item(),
            verified=step.features is not None,  # else the prompt's forward chose it
        )


class StepBuilder:
    """Builds and schedules one step of a sequence: draft, verify forward and acceptance rule,
    all lazy, with the rule and settings of the sequence's generation."""

    def __init__(self, sequence: Sequence):
        self.sequence = sequence

    def __call__(self, pending: mx.array, k: int) -> _Pending:
        with mx.stream(GENERATION_STREAM):
            return self._queue(pending, k)

    def _queue(self, pending: mx.array, k: int) -> _Pending:
        sequence = self.sequence
        draft, guide = sequence.plan(k)
        tree = ROOT if draft is None else draft.tree
        offset = sequence.cache.offset
        then = None if draft is None or guide is not None else self.sequence.then()
        allowed = None if guide is None else guide.allowed
        verified = self._verify(pending, tree, draft, allowed=allowed, then=then)
        chain = None if draft is None or guide is not None or not self._follows() else draft
        return _Pending(
            offset,
            tree,
            verified.acceptance,
            verified.logits,
            TargetFeatures(verified.hidden, verified.taps),
            guide,
            draft=None if chain is None else chain.tokens,
            fused=then is not None,
        )

    def _verify(self, pending, tree, draft, allowed=None, at=None, then=None) -> Verified:
        """`step.verify` of `draft`, scheduled; a fused step's next draft goes to the drafter."""
        sequence = self.sequence
        verified = verify(
            sequence.model,
            sequence.cache,
            pending,
            tree,
            None if draft is None else draft.tokens,
            None if draft is None else draft.logprobs,
            sequence.rule,
            taps=sequence.taps,
            allowed=allowed,
            at=at,
            then=then,
        )
        if then is not None:
            sequence.drafter.received(verified.then)
        acceptance = verified.acceptance
        mx.async_eval(acceptance.tokens, acceptance.num_accepted, acceptance.path)
        return verified

    def _follows(self) -> bool:
        """Whether a step can be queued on the last one's lazy count: the drafter continues
        drafts (`follow`) and the target's step is compiled, so the root slot may be lazy."""
        return self.sequence.pipelined and self.sequence.model.traceable

    def follow(self, step: _Pending, k: int) -> _Pending | None:
        """The step after `step`, queued before `step` is read: its pending token, root slot
        and draft (a draft model's next chain, or the tree EAGLE grew in `step`, fused again)
        are lazy in its accepted count. None when the drafter cannot follow."""
        with mx.stream(GENERATION_STREAM):
            sequence, acceptance = self.sequence, step.acceptance
            accepted = acceptance.num_accepted
            pending = mx.take(acceptance.tokens, accepted.reshape(1))  # (1,)
            draft = sequence.drafter.follow(step.draft, accepted, pending, k, sequence.sampling)
            if draft is None:
                return None
            then = self.sequence.then()
            last = sequence.cache.offset if step.offset is None else step.offset
            at = ((last + 1 + accepted).astype(mx.int32), last + step.tree.num_nodes)
            verified = self._verify(pending, draft.tree, draft, at=at, then=then)
            features = TargetFeatures(verified.hidden, verified.taps)
            return _Pending(
                None,
                draft.tree,
                verified.acceptance,
                verified.logits,
                features,
                draft=draft.tokens,
                fused=then is not None,
            )
