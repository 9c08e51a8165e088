"""One sequence: a generation's state and the operations every scheduler runs on it.

A `Sequence` holds a context (prompt + emitted tokens; its last token is pending: emitted, not
yet in the target's cache), its own cache and drafter, and, per generation (`start`), the
sampling settings, the acceptance rule, the grammar's constraint and the token limit. Its cache
carries over from prompt to prompt: a new prompt only prefills what follows the prefix it shares
with the last context (a chat's earlier turns, a server session's).

Its operations are all that a scheduler needs: the prefill in chunks (`Prefill`), the first
token (`first`), a step's plan (`plan`: a draft and, under a grammar, its guide), the commit of
a verified step's accepted path (`commit`: context, drafter features, grammar; the `Step`) and a
grammar's forced ending (`ending`). `decode.Decoder` schedules one sequence (compiled, pipelined
and fused steps on the sequence's own cache); `batch.engine.BatchEngine` schedules many, one
forward over a row each of the batch's cache. Both commit through `commit`: the cache slots of
the accepted path are the scheduler's to move (it owns the cache the step ran on), everything
else a step changes is the sequence's.

Prefill chunks are PREFILL_STEP tokens, or, sized (a cancellable prefill's, a batch's), each
sized by the last one's time to about CANCEL_SECONDS, so that a client who leaves holds the model
that long at most on a slow machine: powers of two from CANCELLABLE_STEPS[0] to PREFILL_STEP,
starting at CANCELLABLE_STEPS[1].
"""

from __future__ import annotations

import operator
import time
from collections import abc
from collections.abc import Callable
from dataclasses import dataclass, replace

import mlx.core as mx

from .cache import Checkpoint, KVCache
from .device import GENERATION_STREAM
from .drafters.base import Draft, Drafter, FusedDrafter, PipelinedDrafter, TargetFeatures
from .grammar.constraint import Constraint, Guide, masked, points
from .graphs import eager
from .models.base import CausalLM
from .models.quantized_kv import KVQuantization
from .models.quantized_prefill import prefilling
from .sampling import SamplingParams
from .step import Then
from .tree import ROOT, Tree
from .verify import Acceptance, AcceptanceRule

PREFILL_STEP = 256  # tokens per prefill chunk: short enough to cancel between
CANCEL_SECONDS = 0.5
CANCELLABLE_STEPS = (16, 32)  # the least, and the first


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


def finite(logits: mx.array) -> mx.array:
    """Whether every row of (..., N, V) `logits` is a distribution: no NaN and no +inf (broken
    weights or inputs; a grammar's masked tokens are -inf, which is fine). (...) bool, lazy: a
    scheduler evaluates it with the step's acceptance, so the check costs no sync of its own."""
    return mx.all(logits < mx.inf, axis=(-2, -1))


class PrefillCancelled(Exception):
    """The `cancelled` callback of a prefill asked it to stop."""


def cancellable_step(tokens: int, seconds: float) -> int:
    """The next chunk's size after a chunk of `tokens` took `seconds`: the power of two that
    fits in CANCEL_SECONDS at that rate, within CANCELLABLE_STEPS[0] and PREFILL_STEP."""
    fit = max(1, int(tokens * CANCEL_SECONDS / max(seconds, 1e-9)))
    return max(CANCELLABLE_STEPS[0], min(PREFILL_STEP, 1 << (fit.bit_length() - 1)))


class Prefill:
    """A prompt's prefill in chunks (`Sequence.begin_prefill`): each `chunk` runs the next
    chunk into the sequence's cache and its features into its drafter, evaluated before it
    returns; the last one keeps the logits of the prompt's last position for the first token."""

    def __init__(self, sequence: Sequence, prompt: list[int], kept: int, sized: bool):
        self.sequence, self.prompt, self.kept, self.start = sequence, prompt, kept, kept
        self._sized = sized
        self._size = CANCELLABLE_STEPS[1] if sized else PREFILL_STEP

    @property
    def done(self) -> bool:
        return self.start >= len(self.prompt)

    def reaches_last(self, tokens: int) -> bool:
        """Whether a next chunk of `tokens` tokens runs past the slot before the prompt's last
        token (where the checkpoint is: `Sequence.checkpoint`)."""
        last = len(self.prompt) - 1
        return self.start < last <= self.start + tokens

    def chunk(self) -> None:
        """Runs the next chunk into the sequence's own cache; the one that reaches the prompt's
        last token keeps a checkpoint before it (so that the next prompt may reuse it)."""
        sequence, cache = self.sequence, self.sequence.cache
        chunk = self.prompt[self.start : self.start + self._size]
        reaching = self.reaches_last(len(chunk))
        began = time.perf_counter()
        with mx.stream(GENERATION_STREAM), prefilling(), eager():  # a head drafter's too
            cache.mark([len(self.prompt) - 1] if reaching else None)
            try:
                out = sequence.model(mx.array([chunk]), cache, taps=sequence.taps)
                self.took(TargetFeatures(out.hidden[0], tuple(t[0] for t in out.taps)))
                mx.eval(cache.state)
                if reaching:
                    sequence.checkpoint(len(self.prompt) - 1)
            finally:
                cache.mark(None)
            if self._sized:
                self._size = cancellable_step(len(chunk), time.perf_counter() - began)

    def took(self, features: TargetFeatures) -> None:
        """The next prompt tokens, one per row of `features`, ran into the sequence's keys
        (by `chunk`, or in a batch's prefill forward, batch/prefill.py): its drafter takes
        their features, its context grows over them, and the last one gives the first token's
        logits (only its row is projected: the prefill's own logits are never evaluated)."""
        sequence = self.sequence
        if sequence.drafter is not None:
            sequence.drafter.extend(features)
        self.start += features.hidden.shape[0]
        sequence.context = self.prompt[: self.start]
        if self.done:
            sequence.prefilled(sequence.model.project(features.hidden[-1:]))


class Sequence:
    """One stream of generations over `model` with one drafter (see the module): its context,
    cache and drafter state, and what the generation under way asked for."""

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
        # The generation under way (`start`).
        self.sampling = SamplingParams()
        self.rule = AcceptanceRule(self.sampling)
        self.constraint: Constraint | None = None
        self._limit = 0  # last context length the current generation may reach
        self._prompt_logits: mx.array | None = None  # (1, V) after the prompt, until read
        # A way back to the last prompt's end, which rings and recurrent state lose as the
        # generation goes on (`Checkpoint`): a prompt that repeats it reuses it.
        self._mark: Checkpoint | None = None

    # -- the prompt ---------------------------------------------------------------------------

    def prefill(
        self, prompt: abc.Sequence[int], cancelled: Callable[[], bool] | None = None
    ) -> int:
        """Runs the prompt into the cache (its features into the drafter), keeping the logits
        of its last position for the first token; returns how many prompt tokens were already
        cached from the previous context (all but the last may be).

        Chunks as `begin_prefill` sizes them, each evaluated (a sync) before the next is built.
        `cancelled` is asked before each chunk: when it says so, PrefillCancelled is raised and
        the chunks done stay cached as the context's prefix, for a later prompt to reuse; with
        it, chunks take about CANCEL_SECONDS each. A KeyboardInterrupt lands between chunks."""
        prefill = self.begin_prefill(prompt, sized=cancelled is not None)
        while not prefill.done:
            if cancelled is not None and cancelled():
                raise PrefillCancelled(
                    f"cancelled at {prefill.start} of {len(prefill.prompt)} prompt tokens"
                )
            prefill.chunk()
        return prefill.kept

    def begin_prefill(self, prompt: abc.Sequence[int], sized: bool = False) -> Prefill:
        """A prefill of `prompt` to run a chunk at a time (`Prefill.chunk`), so that other work
        (a batch's decoding steps) can run between chunks; ValueError for a prompt that cannot
        be run. `sized`: chunks of about CANCEL_SECONDS each, else PREFILL_STEP."""
        if len(prompt) == 0:
            raise ValueError("the prompt is empty")
        if len(prompt) > self.max_context:
            model = self.max_context >= self.model.args.max_position_embeddings
            raise ValueError(
                f"the prompt has {len(prompt)} tokens, more than the "
                f"{'model' if model else 'cache'}'s context of {self.max_context}"
            )
        prompt = self._check_ids(prompt)
        kept, mark = self.reusable(prompt), self._mark
        if mark is not None and kept == mark.length and self.cache.restorable(kept) != kept:
            self.cache.return_to(mark)
        else:
            self.cache.truncate(kept)
        if mark is not None and kept < mark.length:  # slots below it will be written again
            self._mark = None
        if self.drafter is not None:
            self.drafter.rewind(kept)
        self._prompt_logits = None
        self.context = prompt[:kept]
        return Prefill(self, prompt, kept, sized)

    def resume(self, tokens: abc.Sequence[int], cache: KVCache) -> None:
        """Starts from `cache`, which holds `tokens` (a prompt-cache file's: prompt_cache/),
        so the next prompt prefills only what follows the prefix it shares with them. A
        drafter that drafts from the target's features (a head) would lack the prefix's:
        ValueError; one that follows the context (draft model, lookup) rebuilds from it."""
        if self.drafter is not None and not self.drafter.follows_context:
            raise ValueError(
                "a prompt-cache file holds the target's cache, not the features a head drafter "
                "(EAGLE, Medusa, DFlash, MTP, an assistant) reads of the cached prompt: use a "
                "draft model, prompt lookup or no drafter with it"
            )
        if len(tokens) > self.max_context:
            raise ValueError(
                f"the cached prompt has {len(tokens)} tokens, more than the context of "
                f"{self.max_context}"
            )
        self.cache, self.context = cache, list(tokens)
        self._prompt_logits, self._mark = None, None
        if self.drafter is not None:
            self.drafter.rewind(0)

    def prefilled(self, logits: mx.array) -> None:
        """The prompt is in the cache; `logits` (1, V) are its last position's."""
        self._prompt_logits = logits

    def checkpoint(self, length: int, mark: Checkpoint | None = None) -> None:
        """Keeps a way back to `length` tokens (the prompt's but its last), so that a prompt
        sharing them reuses them after the generation moved the cache on (`reusable`); `mark`:
        one a batch's prefill took of the sequence's row (batch/prefill.py), else its cache's."""
        self._mark = self.cache.checkpoint(length) if mark is None else mark

    def reusable(self, prompt: abc.Sequence[int]) -> int:
        """How many tokens of `prompt` the cache holds already: the prefix it shares with the
        last context, short of the prompt's last token (whose forward gives the first token), and
        no longer than the cache can roll back to (a hybrid's recurrent state: see state_cache;
        a ring's window: see cache.py), or else the last prompt's end where it is checkpointed."""
        cached = self.context[: self.cache.offset]
        shared, most = 0, min(len(cached), len(prompt) - 1)
        while shared < most and cached[shared] == prompt[shared]:
            shared += 1
        kept = self.cache.restorable(shared)
        mark = self._mark
        if mark is not None and kept < mark.length <= shared and self.cache.returnable(mark):
            return mark.length
        return kept

    def _check_ids(self, prompt: abc.Sequence[int]) -> list[int]:
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

    # -- a generation -------------------------------------------------------------------------

    def start(
        self,
        sampling: SamplingParams,
        *,
        max_tokens: int | None = None,
        typical_acceptance: bool = False,
        constraint: Constraint | None = None,
    ) -> None:
        """Begins a generation after the prefilled prompt: its settings, rule and grammar, and
        at most `max_tokens` tokens (None: up to the context). The scheduler seeds draws."""
        if self._prompt_logits is None:
            raise ValueError("prefill a prompt before decoding")
        self.sampling = sampling
        self.rule = AcceptanceRule(replace(sampling, seed=None), typical_acceptance)
        self.constraint = constraint
        self._limit = len(self.context) - 1 + (max_tokens or self.max_context + 1)

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

    @property
    def cap(self) -> int:
        """The most draft tokens a step of this sequence may verify: its drafter's (0: none)."""
        return 0 if self.drafter is None else self.drafter.max_draft

    def first(self) -> tuple[Acceptance, mx.array, Guide | None]:
        """The first token's lazy choice from the prompt's logits (under a grammar, masked by
        its first guide), those (1, V) logits and the guide; the logits are taken once."""
        if self._prompt_logits is None:
            raise ValueError("prefill a prompt before decoding")
        guide = None if self.constraint is None else self.constraint.first()
        logits, self._prompt_logits = masked(self._prompt_logits, guide), None
        acceptance = self.rule(ROOT, mx.zeros((0,), dtype=mx.int32), logits, None)
        return acceptance, logits, guide

    def plan(self, k: int) -> tuple[Draft | None, Guide | None]:
        """The next step's draft of up to `k` tokens (None: the pending token alone) and, under
        a grammar, its guide (the chain or tree it walked, and the rows' masks)."""
        drafter, constraint = self.drafter, self.constraint
        if constraint is not None and (drafter is None or drafter.follows_context):
            sampling = self.sampling
            propose = None if drafter is None else lambda c, n: drafter.propose(c, n, sampling)
            guide = constraint.guide(self.context, propose, k, self.room())
            return guide.draft, guide
        if constraint is not None:  # a tree drafter
            guide = constraint.tree_guide(lambda: self._propose(k), self.room())
            return guide.draft, guide
        return self._propose(k), None

    def _propose(self, k: int) -> Draft | None:
        """The drafter's draft of up to `k` tokens, cut to what the step may use."""
        if self.drafter is None or k <= 0 or self.room() <= 0:
            return None
        k = min(k, self.context_room())
        draft = self.drafter.propose(self.context, k, self.sampling)
        return None if draft is None else draft.limited(self.room())

    def then(self) -> Then | None:
        """The fused drafter's next draft, to trace into the graph of the step verifying its
        last one (`step.Then`), where that fits: a traceable target and a lossless rule. None
        otherwise, or when the drafter cannot (it then drafts by `propose`). Both schedulers
        ask it once a step's draft is planned without a grammar's guide."""
        fits = self.fused and self.model.traceable and not self.rule.typical
        return self.drafter.then() if fits else None

    def commit(
        self,
        tokens: list[int],
        path: list[int],
        logits: mx.array,
        tree: Tree,
        guide: Guide | None,
        features: TargetFeatures | None,
        *,
        settled: bool = False,
        seconds: float = 0.0,
        traced: bool = False,
        finite: bool = True,
        verified: bool = True,
    ) -> Step:
        """Commits a step's accepted path, whose keys the scheduler has put in place: `tokens`
        (the accepted drafts, then the target's token) at tree nodes `path`, chosen by `logits`
        (one row per node). The drafter learns them: `settled`, it followed the step already
        (a pipelined or fused one) and is told the count; else it takes the path's rows of
        `features` (None: the first token, whose features came with the prompt; or no drafter).
        The grammar consumes them. `verified`: a verify forward chose them (not the prompt's).
        `finite`: whether its logits were (`finite`); else ValueError, and nothing is committed:
        NaN weights would otherwise emit token 0 again and again."""
        if not finite:
            raise ValueError(
                "the model's logits are not finite (NaN or infinity): its weights (or the "
                "activations they give) are broken; check the checkpoint and its dtype"
            )
        n = len(tokens) - 1
        rows = slice(0, n + 1) if path == list(range(n + 1)) else mx.array(path)
        self.context.extend(tokens)
        if settled:
            self.drafter.settle(n)
        elif self.drafter is not None and features is not None:
            self.drafter.rewind(len(self.context) - 1)
            self.drafter.extend(features.rows(rows))
        chosen = logits[rows]
        logprobs = chosen - mx.logsumexp(chosen, axis=-1, keepdims=True)
        drafted = tree.num_nodes - 1 if guide is None else guide.drafted
        forced = () if guide is None else tuple(guide.forced[i] for i in path)
        if self.constraint is not None:
            self.constraint.commit(tokens)
        return Step(tuple(tokens), drafted, logprobs, seconds, verified, forced, traced)

    def ending(self, seconds: float = 0.0) -> Step | None:
        """The ending the grammar forces whole from here, emitted without a forward (the cache
        stays behind the context), or None; the generation ends with it."""
        if self.constraint is None:
            return None
        ending = self.constraint.ending(self.room())
        if not ending:
            return None
        self.context.extend(ending)
        rows = points(mx.array(ending), self.model.args.vocab_size)
        return Step(ending, 0, rows, seconds, False, (True,) * len(ending))
