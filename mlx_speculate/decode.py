"""The one decoding loop: propose -> verify in one target forward -> accept -> commit.

The prefill runs the whole prompt; its last row gives the first token, and every position's
features reach the drafter (`Drafter.extend`). Every step verifies a draft tree rooted at the
pending token (emitted, not yet in the target cache): a chain, a tree, or the root alone. One
rule (`verify.py`) picks the accepted path and the target's next token; the commit moves the
path's keys/values into consecutive slots (`KVCache.compact`) and hands its features on.

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

import operator
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import mlx.core as mx

from .cache import KVCache
from .device import GENERATION_STREAM
from .drafters.base import Draft, Drafter, FusedDrafter, PipelinedDrafter, TargetFeatures
from .grammar.constraint import Constraint, Guide, masked, points
from .graphs import built
from .models.base import CausalLM
from .models.quantized_kv import KVQuantization
from .policy.adaptive import FixedPolicy, Policy
from .prefill import Prefill, PrefillCancelled
from .sampling import SamplingParams
from .step import Then, Verified, verify
from .tree import ROOT, Tree
from .verify import Acceptance, AcceptanceRule


@dataclass(frozen=True)
class Step:
    """The tokens one target forward committed."""

    tokens: tuple[int, ...]  # accepted draft tokens, then the target's own token
    drafted: int  # tokens the drafter proposed (tree: nodes below the root)
    logprobs: mx.array  # (len(tokens), V) target log-probabilities that chose each token
    seconds: float
    verified: bool = True  # False: no verify forward (the first token, a forced ending)
    forced: tuple[bool, ...] = ()  # per token, under a grammar: it forced the token
    traced: bool = False  # a graph was traced in its time, so it prices nothing

    @property
    def accepted(self) -> int:
        """How many of `tokens` came from the draft (tokens a grammar forced apart)."""
        return len(self.tokens) - 1 - sum(self.forced[: len(self.tokens) - 1])


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
    """Runs the loop for a stream of prompts. `context` is prompt + emitted tokens; its last
    token is pending. A new prompt reuses the cached prefix it shares with the last context."""

    def __init__(
        self,
        model: CausalLM,
        drafter: Drafter | None = None,
        max_context: int | None = None,
        kv: KVQuantization | None = None,
    ):
        """`max_context`: the context's bound (a cache's max_kv_size), at most the model's;
        `kv`: the cache's quantization (models/quantized_kv.py), None for float keys."""
        self.model = model
        self.drafter = drafter
        most = model.args.max_position_embeddings
        bad = isinstance(max_context, bool) or not isinstance(max_context, int | None)
        if bad or (max_context is not None and max_context < 1):
            raise ValueError(f"max_kv_size must be a positive integer, got {max_context!r}")
        self.max_context = min(max_context or most, most)
        self.cache: KVCache = model.make_cache()
        self.cache.quantize_from(kv)
        self.taps = drafter.taps if drafter is not None else ()
        # What the drafter offers beyond proposing (drafters/base.py), read once.
        self.pipelined = isinstance(drafter, PipelinedDrafter)
        self.fused = isinstance(drafter, FusedDrafter)
        self.context: list[int] = []
        self._clock = (0.0, 0)  # when the last step finished, and graphs traced by then
        self._limit = 0  # last context length the current generation may reach
        self._prompt_logits: mx.array | None = None  # (1, V) after the prompt, until read

    def prefill(self, prompt: Sequence[int], cancelled: Callable[[], bool] | None = None) -> int:
        """Runs the prompt into the cache (its features into the drafter), keeping the logits
        of its last position for the first token; returns how many prompt tokens were already
        cached from the previous context (all but the last may be).

        Chunks as prefill.py sizes them, each evaluated (a sync) before the next is built; their
        shapes vary with the prompt. `cancelled` is asked before each chunk: when it says so,
        PrefillCancelled is raised and the chunks done stay cached as the context's prefix, for
        a later prompt to reuse; with it, chunks take about CANCEL_SECONDS each (prefill.py). A
        KeyboardInterrupt lands between chunks too."""
        prefill = self.begin_prefill(prompt, sized=cancelled is not None)
        while not prefill.done:
            if cancelled is not None and cancelled():
                raise PrefillCancelled(
                    f"cancelled at {prefill.start} of {len(prefill.prompt)} prompt tokens"
                )
            prefill.chunk()
        return prefill.kept

    def begin_prefill(self, prompt: Sequence[int], sized: bool = False) -> Prefill:
        """A prefill of `prompt` to run a chunk at a time (`Prefill.chunk`), so that other work
        (a batch's decoding steps) can run between chunks; ValueError for a prompt that cannot
        be run. `sized`: chunks of about CANCEL_SECONDS each, else PREFILL_STEP (prefill.py)."""
        if len(prompt) == 0:
            raise ValueError("the prompt is empty")
        if len(prompt) > self.max_context:
            model = self.max_context >= self.model.args.max_position_embeddings
            raise ValueError(
                f"the prompt has {len(prompt)} tokens, more than the "
                f"{'model' if model else 'cache'}'s context of {self.max_context}"
            )
        prompt = self._check_ids(prompt)
        kept = self.reusable(prompt)
        self.cache.truncate(kept)
        if self.drafter is not None:
            self.drafter.rewind(kept)
        self._prompt_logits = None
        self.context = prompt[:kept]
        return Prefill(self, prompt, kept, sized)

    def take_prompt_logits(self) -> mx.array:
        """The (1, V) logits after the prompt, once (the first token is chosen from them)."""
        if self._prompt_logits is None:
            raise ValueError("prefill a prompt before decoding")
        logits, self._prompt_logits = self._prompt_logits, None
        return logits

    def limit(self, max_tokens: int | None) -> None:
        """Bounds the generation starting now to `max_tokens` tokens (None: the context)."""
        self._limit = len(self.context) - 1 + (max_tokens or self.max_context + 1)

    def reusable(self, prompt: Sequence[int]) -> int:
        """How many tokens of `prompt` the cache holds already: the prefix it shares with the
        last context, short of the prompt's last token (whose forward gives the first token), and
        no longer than the cache can roll back to (a hybrid's recurrent state: see state_cache)."""
        cached = self.context[: self.cache.offset]
        kept, most = 0, min(len(cached), len(prompt) - 1)
        while kept < most and cached[kept] == prompt[kept]:
            kept += 1
        return self.cache.restorable(kept)  # recurrent state: only what the cache can restore

    def _check_ids(self, prompt: Sequence[int]) -> list[int]:
        """The ids as ints, each inside the vocabulary: the embedding would read past its end
        (garbage, or a crash) otherwise."""
        try:
            ids = [operator.index(t) for t in prompt]
        except TypeError:
            raise ValueError("token ids must be integers") from None
        vocab = self.model.args.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the model's vocabulary (0 to {vocab - 1})")
        return ids

    def room(self) -> int:
        """How many draft tokens the next step may use; -1 when no step is left. A step writes
        its root and draft nodes from cache slot len(context) - 1 on (the context limit bounds
        their number) and emits its accepted drafts and one more (the tokens wanted bound how
        many drafts it may accept: the draft's depth)."""
        # A step stops short of a planned quantization's start (KVCache.before_switch).
        switch = self.cache.before_switch(len(self.context) - 1)
        return min(self.context_room(), self._limit - len(self.context), switch)

    def context_room(self) -> int:
        """How many draft nodes the next step's verify forward can hold in the context."""
        return self.max_context - len(self.context)

    @property
    def context_full(self) -> bool:
        """Whether the context limit, rather than the tokens wanted, ended the steps."""
        return self.max_context - len(self.context) < 0

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
        if self._prompt_logits is None:
            raise ValueError("prefill a prompt before decoding")
        policy = policy or FixedPolicy(0)
        if sampling.seed is not None:
            mx.random.seed(sampling.seed)  # the one generator every draw comes from
        self.limit(max_tokens)
        self._clock = (time.perf_counter(), built())
        rule = AcceptanceRule(replace(sampling, seed=None), typical_acceptance)
        queue = StepBuilder(self, sampling, rule, constraint)
        guide = None if constraint is None else constraint.first()
        logits, self._prompt_logits = masked(self._prompt_logits, guide), None
        acceptance = queue.accept(ROOT, mx.zeros((0,), dtype=mx.int32), logits, None)
        step = _Pending(len(self.context), ROOT, acceptance, logits, guide=guide)
        while True:
            upcoming = k = None
            if step.tree.num_nodes == 1 and self.room() >= 1 and constraint is None:
                # Decided one observation early, so that a plain step can be queued on the
                # lazy token before this one is read.
                k = policy.choose()
                if k == 0:
                    upcoming = queue(step.acceptance.tokens[:1], 0)
            elif step.draft is not None:
                # A chain or fused EAGLE step: the next draft and verify are queued on its lazy
                # count, so that building them overlaps this verify (room for the worst case).
                k = policy.choose()
                if 0 < k <= self.room() - step.tree.num_nodes:
                    upcoming = queue.follow(step, k)
            result = self._finish(step, followed=upcoming is not None and upcoming.offset is None)
            if constraint is not None:
                constraint.commit(result.tokens)
            if result.verified:
                seconds = 0.0 if result.traced else result.seconds  # a trace prices nothing
                policy.observe(result.drafted, result.accepted, seconds)
            yield result
            if self.room() < 0:
                return
            if constraint is not None and (ending := constraint.ending(self.room())):
                self.context.extend(ending)  # no forward: the cache stays behind the context
                rows = points(mx.array(ending), self.model.args.vocab_size)
                seconds = time.perf_counter() - self._clock[0]
                yield Step(ending, 0, rows, seconds, False, (True,) * len(ending))
                return
            if upcoming is None:
                k = policy.choose() if k is None else k
                upcoming = queue(mx.array(self.context[-1:]), k)
            step = upcoming

    def _finish(self, step: _Pending, followed: bool = False) -> Step:
        """Reads the step's acceptance (the one sync) and commits the accepted path;
        `followed`: the drafter's next chain is queued already (`StepBuilder.follow`)."""
        acceptance = step.acceptance
        mx.eval(acceptance.tokens, acceptance.num_accepted, acceptance.path)
        n = acceptance.num_accepted.item()
        # Sliced on the host: a lazy slice would be evaluated behind the step queued next.
        tokens = acceptance.tokens.tolist()[: n + 1]
        path = acceptance.path.tolist()[: n + 1]
        root = step.offset
        if root is None:  # queued before the step ahead was read, which ended at the offset
            root = self.cache.offset
            self.cache.advance(step.tree.num_nodes)
        if step.fused:  # the step moved the path's keys in place
            self.cache.truncate(root + n + 1)
        elif step.tree.num_nodes > 1:  # a plain step's one slot is already in place
            if path != list(range(n + 1)):
                self.cache.compact(root, acceptance.path[: n + 1])
            self.cache.truncate(root + n + 1)
        rows = slice(0, n + 1) if path == list(range(n + 1)) else mx.array(path)
        logits = step.logits[rows]
        self.context.extend(tokens)
        if followed or step.fused:
            self.drafter.settle(n)
        elif self.drafter is not None and step.features is not None:
            self.drafter.rewind(len(self.context) - 1)
            self.drafter.extend(step.features.rows(rows))
        # Wall time since the previous step finished: what the step cost the stream, also
        # when it overlapped the one before; traced, when a graph was traced meanwhile.
        now = (time.perf_counter(), built())
        seconds, traced = now[0] - self._clock[0], now[1] != self._clock[1]
        self._clock = now
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        guide = step.guide
        drafted = step.tree.num_nodes - 1 if guide is None else guide.drafted
        forced = () if guide is None else tuple(guide.forced[i] for i in path)
        verified = step.features is not None  # else the first token or a forced ending
        return Step(tuple(tokens), drafted, logprobs, seconds, verified, forced, traced)


class StepBuilder:
    """Builds and schedules one step: draft, verify forward and acceptance rule, all lazy."""

    def __init__(
        self,
        decoder: Decoder,
        sampling: SamplingParams,
        rule: AcceptanceRule,
        constraint: Constraint | None = None,
    ):
        self.decoder = decoder
        self.sampling = sampling  # what sampled drafts follow
        self.rule = rule  # chosen once per generation
        self.constraint = constraint

    def __call__(self, pending: mx.array, k: int) -> _Pending:
        with mx.stream(GENERATION_STREAM):
            return self._queue(pending, k)

    def plan(self, k: int) -> tuple[Draft | None, Guide | None]:
        """The step's draft of up to `k` tokens (None: the pending token alone) and, under a
        grammar, its guide (the chain or tree it walked, and the rows' masks)."""
        decoder, drafter = self.decoder, self.decoder.drafter
        if self.constraint is not None and (drafter is None or drafter.follows_context):
            sampling = self.sampling
            propose = None if drafter is None else lambda c, n: drafter.propose(c, n, sampling)
            guide = self.constraint.guide(decoder.context, propose, k, decoder.room())
            return guide.draft, guide
        if self.constraint is not None:  # a tree drafter
            guide = self.constraint.tree_guide(lambda: self._propose(k), decoder.room())
            return guide.draft, guide
        return self._propose(k), None

    def _queue(self, pending: mx.array, k: int) -> _Pending:
        decoder = self.decoder
        draft, guide = self.plan(k)
        tree = ROOT if draft is None else draft.tree
        offset = decoder.cache.offset
        then = None if draft is None or guide is not None else self._then()
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
        decoder = self.decoder
        verified = verify(
            decoder.model,
            decoder.cache,
            pending,
            tree,
            None if draft is None else draft.tokens,
            None if draft is None else draft.logprobs,
            self.rule,
            taps=decoder.taps,
            allowed=allowed,
            at=at,
            then=then,
        )
        if then is not None:
            decoder.drafter.received(verified.then)
        acceptance = verified.acceptance
        mx.async_eval(acceptance.tokens, acceptance.num_accepted, acceptance.path)
        return verified

    def _propose(self, k: int) -> Draft | None:
        """The drafter's draft of up to `k` tokens, cut to what the step may use."""
        decoder = self.decoder
        if decoder.drafter is None or k <= 0 or decoder.room() <= 0:
            return None
        k = min(k, decoder.context_room())
        draft = decoder.drafter.propose(decoder.context, k, self.sampling)
        return None if draft is None else draft.limited(decoder.room())

    def _then(self) -> Then | None:
        """EAGLE's next draft, traced into this step's graph (`step.Then`), on a real target."""
        decoder = self.decoder
        fits = decoder.fused and decoder.model.traceable and not self.rule.typical
        return decoder.drafter.then() if fits else None

    def _follows(self) -> bool:
        """Whether a step can be queued on the last one's lazy count: the drafter continues
        drafts (`follow`) and the target's step is compiled, so the root slot may be lazy."""
        decoder = self.decoder
        return (
            decoder.pipelined and decoder.model.traceable
        )

    def follow(self, step: _Pending, k: int) -> _Pending | None:
        """The step after `step`, queued before `step` is read: its pending token, root slot
        and draft (a draft model's next chain, or the tree EAGLE grew in `step`, fused again)
        are lazy in its accepted count. None when the drafter cannot follow."""
        with mx.stream(GENERATION_STREAM):
            decoder, acceptance = self.decoder, step.acceptance
            accepted = acceptance.num_accepted
            pending = mx.take(acceptance.tokens, accepted.reshape(1))  # (1,)
            draft = decoder.drafter.follow(step.draft, accepted, pending, k, self.sampling)
            if draft is None:
                return None
            then = self._then()
            last = decoder.cache.offset if step.offset is None else step.offset
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

    def accept(
        self, tree: Tree, tokens: mx.array, logits: mx.array, draft: Draft | None
    ) -> Acceptance:
        """The rule's lazy result, scheduled at once: a later step queued on top of it must
        not make reading this one wait for both."""
        acceptance = self.rule(tree, tokens, logits, None if draft is None else draft.logprobs)
        mx.async_eval(acceptance.tokens, acceptance.num_accepted, acceptance.path)
        return acceptance

