"""Native multi-token prediction (Qwen3-Next, Qwen3.5): the MTP head the checkpoint carries
(heads/mtp.py) drafts a chain of k tokens, run k times, each step reading its own output and the
token it drafted before.

The one-token shift is EAGLE's: position t reads the target's state at t and the embedding of
token t+1, and predicts token t+2. Features of committed positions arrive through `extend`; a
proposal first runs the head over the positions it has not seen (their next tokens are all in
the context, the pending one last), which leaves its output at the last committed position,
whose prediction is the chain's first token. The head's KV cache holds the committed positions;
the chain's steps write past them, and the next proposal (or a rewind) drops them.

Sampling: each token is drawn from the processed distribution (the target's settings) of the
head's logits, and those distributions come back as `Draft.logprobs`, so rejection sampling
stays exact. Catching up and drafting are one compiled graph per (catch-up row bucket, k,
sampling, attended span), with no host sync; a prompt's rows (more than the last bucket) run
through the head once, uncompiled, before it.

A step can be fused (`then`, as EAGLE's and DFlash's): the verify step's graph runs the head
over the accepted path and drafts the next chain below the token the rule chose, so a step is
one compiled call and one host sync, and the next step can be queued on the lazy accepted count
(`follow`) before this one is read.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from ..graphs import compiled
from ..heads.mtp import MtpHead, has_mtp, load_mtp
from ..memo import from_folder
from ..models.base import CausalLM
from ..models.context import build_context
from ..sampling import SamplingParams, pick
from ..step import BUCKETS, Then, bucket, cache_view
from ..tree import Tree
from ..verify import Acceptance
from .base import MAX_DRAFT, Draft, DrafterSpec, FusedDrafter, TargetFeatures
from .features import FeatureQueue, FusedSteps

FAMILIES = "qwen3_next, qwen3_5, qwen3_5_moe"  # what `has_mtp` accepts, for errors


@dataclass(frozen=True, kw_only=True, eq=False)
class MtpSpec(DrafterSpec):
    """Chains drafted by the target's own MTP head. `head`: True for the one in the loaded
    model's folder (`mtp.*`, which `convert` keeps), a model folder that holds it (the original
    checkpoint of a conversion that dropped it), or an `MtpHead`."""

    keywords: ClassVar[dict[str, str | None]] = {"mtp": "head"}
    flags: ClassVar[dict[str, str]] = {"mtp": "--mtp"}

    head: bool | str | Path | MtpHead = True

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--mtp",
            nargs="?",
            const=True,
            default=False,
            metavar="DIR",
            help="draft chains with the model's own multi-token-prediction head (Qwen3-Next, "
            "Qwen3.5: mtp.* in its folder, or in the model folder DIR)",
        )

    @classmethod
    def keywords_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        return {"mtp": args.mtp}

    def resolve(self, target: CausalLM) -> MtpSpec:
        if not has_mtp(target):
            raise ValueError(
                f"{target.args.model_type} models carry no MTP head (native MTP drafts for "
                f"{FAMILIES})"
            )
        head = self.head
        if isinstance(head, MtpHead):
            return self
        if head is True:
            if target.origin.folder is None:
                raise ValueError(
                    "the model was not loaded from a folder: name the folder that holds its MTP "
                    "weights (mtp=DIR)"
                )
            head = target.origin.folder
        if not isinstance(head, str | Path):
            raise ValueError(f"mtp must be True, a model folder or an MtpHead, got {head!r}")
        loaded = from_folder(target, "mtp", head, lambda: load_mtp(head, target))
        return replace(self, head=loaded)

    def build(self, target: CausalLM, tokenizer=None) -> MtpDrafter:
        head = self.resolve(target).head
        if head.args.hidden_size != target.args.hidden_size:
            raise ValueError(
                f"the MTP head reads hidden size {head.args.hidden_size}, the target's is "
                f"{target.args.hidden_size}"
            )
        return MtpDrafter(head, target, self.num_draft_tokens or MAX_DRAFT)


class MtpDrafter(FusedDrafter):
    """Drafts chains with the MTP head from its output at the last committed position.

    A step can be fused (`then`, as EAGLE's): the verify step's graph runs the head over the
    accepted path and drafts the next chain below the token the rule chose, so a step is one
    compiled call and one host sync; `settle` then takes the accepted count, and the next
    `propose` of at most that chain's length returns it (cut). The next fused step can also be
    queued before that count is read (`follow`). Otherwise (the first step, a plain step
    between, a longer chain, other sampling settings) `propose` catches up and drafts in a
    compiled graph of its own."""

    taps: tuple[int, ...] = ()
    follows_context = False

    def __init__(self, head: MtpHead, target: CausalLM, max_draft: int = MAX_DRAFT):
        self.head = head
        self.target = target
        self.max_draft = max_draft
        self.cache = head.make_cache()
        self._features = FeatureQueue(self.cache)  # the target's states: rows are `hidden`
        self._fused = FusedSteps(self._features)  # entries: (the head's last output, draft)
        self._last: mx.array | None = None  # (h,) the head's output at position fed - 1
        # The last proposal's length and sampling (seedless): the next fused chain's.
        self._choice: tuple[int, SamplingParams] | None = None

    def weights(self) -> tuple[nn.Module, ...]:
        return (self.head,)

    def extend(self, features: TargetFeatures) -> None:
        self._features.add(features.hidden)

    def rewind(self, length: int) -> None:
        if self._fused.rewind(length):
            self._last = None

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams) -> Draft | None:
        committed = len(context) - 1
        k = min(k, self.max_draft)
        ready = self._fused.take_ready()
        if k <= 0 or self._features.known != committed:
            return None
        sampling = replace(sampling, seed=None)  # the seed went into the generator already
        if ready is not None and not self._features.waiting:
            draft = self._cut(ready[1], k, sampling)
            if draft is not None:
                return draft
        fed = self._features.fed
        queued = bool(self._fused.queued)  # a queued fused step wrote past `fed`: keep its slots
        if not queued:
            self.cache.truncate(fed)  # the last chain's slots
        m = self._features.waiting  # positions to catch up on
        features = self._features.rows()  # (m, h)
        tokens = mx.array(context[fed + 1 : committed + 1], dtype=mx.int32)  # (m,)
        if m > BUCKETS[-1]:  # a prompt's rows: one forward, whose shape seldom comes again
            if queued:
                return None
            out = self.head(self._embed(tokens)[None], features[None], self.cache)
            self._last, m = out[0, -1], 0
            self._features.mark_fed(committed)
        if m == 0 and self._last is None:
            return None
        return self._chain(m, features, tokens, k, sampling, keep=not queued)

    def then(self) -> Then | None:
        """The next chain, of the last proposal's length and sampling, traced into the verify
        step of the last one (or, after `follow`, of the step queued on its count); None when
        the head cannot be traced. Fixed shapes: every row of the verified chain's path (its
        row bucket at most), then the chain; the path's first slot is an input."""
        start = self._fused.path_start()
        known = start is not None and self._choice is not None and not self._features.waiting
        if not known or not self.head.traceable:
            return None
        head, embed, project = self.head, self._embed, self._project
        k, sampling = self._choice
        end = start[1] + bucket(k + 1) + k  # the path's rows, then the chain after them
        self.cache.reserve(end)
        span = self.cache.span(end)

        def trace(acceptance, hidden, taps, fed, *arrays):
            view = cache_view(head, arrays, fed, span)
            out = catch_up_and_chain(
                head, embed, project, acceptance, hidden, view, fed, k, sampling
            )
            return (*out, *view.state)

        key = ("mtp", id(head), k, sampling, span)
        return Then(key, (start[0], *self.cache.state), trace)

    def received(self, outputs: Sequence[mx.array]) -> None:
        """The fused step's lazy outputs (`Verified.then`)."""
        last, *drafted = self.cache.take_outputs(outputs)
        self._fused.received(last, self._draft(*drafted))

    def follow(
        self,
        drafted: mx.array,
        accepted: mx.array,
        pending: mx.array,
        k: int,
        sampling: SamplingParams,
    ) -> Draft | None:
        """The chain the fused step being verified drafted, for the step queued on the count
        of drafts it `accepted` (an int32 scalar) before that count is read: the next `then`
        runs the head over a path from the slot after them. None unless exactly that step is
        unsettled and the next chain is no longer and samples alike."""
        sole = self._fused.sole()
        if sole is None or not self.head.traceable or self._choice is None:
            return None
        most = self._choice[0]  # the followed step's draft length
        draft = self._cut(sole[1], min(k, self.max_draft), replace(sampling, seed=None))
        if draft is None:
            return None
        self._fused.follow(accepted, most)
        return draft

    def settle(self, accepted: int) -> None:
        """The oldest fused step accepted `accepted` drafts: the head has run over those
        positions and the root's, and its chain follows them (unless a step queued on this
        one's count took it already)."""
        self._last, _ = self._fused.settle(accepted)

    def _cut(self, draft: Draft, k: int, sampling: SamplingParams) -> Draft | None:
        """A fused chain's first k tokens when it holds as many and was drawn with `sampling`
        (seedless); the next fused chain is then of k. None when it cannot serve."""
        if self._choice is None or k > draft.size or self._choice[1] != sampling:
            return None
        self._choice = (k, sampling)
        if k == draft.size:
            return draft
        logprobs = None if draft.logprobs is None else draft.logprobs[:k]
        return Draft(draft.tokens[:k], Tree.chain(k), logprobs)

    def _draft(self, tokens: mx.array, logprobs: mx.array | None = None) -> Draft:
        return Draft(tokens, Tree.chain(tokens.shape[0]), logprobs)

    def _chain(
        self,
        m: int,
        features: mx.array | None,
        tokens: mx.array,
        k: int,
        sampling: SamplingParams,
        keep: bool = True,
    ) -> Draft:
        """Catches up on the m positions from the fed ones (padded to their row bucket; none: from
        `_last`) and drafts k tokens from the last of them, in one compiled graph whose inputs
        are the first slot (an array), the rows and the head's cache, read over its span.
        `keep`: the cache and the fed count take its writes (not while a fused step is queued,
        whose writes they hold)."""
        rows = bucket(m) if m else 0
        start = self._features.fed
        committed = start + m
        end = max(start + rows, committed + k - 1)  # past every slot it writes
        self.cache.reserve(end)
        span = self.cache.span(end)
        key = ("mtp", id(self.target), rows, k, sampling)
        head, embed, project = self.head, self._embed, self._project

        def build() -> Callable:
            return _draft_fn(head, embed, project, rows, k, sampling, span)

        fn = compiled(head, key, build, traced=head.traceable, span=span)
        if rows:
            h = features.shape[-1]
            padded = mx.concatenate([features, mx.zeros((rows - m, h), features.dtype)])
            ids = mx.concatenate([tokens, mx.zeros((rows - m,), mx.int32)])
            inputs = (padded, ids, mx.array(m - 1, mx.int32))
        else:
            inputs = (self._last,)
        out = fn(mx.array(start, mx.int32), *inputs, *self.cache.state)
        outputs = 2 if sampling.greedy else 3
        draft = self._draft(*out[1:outputs])
        if keep:
            self.cache.set_arrays(out[outputs:])
            self.cache.advance(committed + k - 1 - self.cache.offset)
            self._last = out[0]
            self._features.mark_fed(committed)
            self._choice = (k, sampling)
        return draft

    def _embed(self, tokens: mx.array) -> mx.array:
        return self.target.model.embed_tokens(tokens)

    def _project(self, out: mx.array) -> mx.array:
        return self.target.project(out)


def _draft_fn(
    head: MtpHead,
    embed: Callable[[mx.array], mx.array],
    project: Callable[[mx.array], mx.array],
    rows: int,
    k: int,
    sampling: SamplingParams,
    span: int,
) -> Callable:
    """The graph of `MtpDrafter._chain`: (start, rows' states (R, h), their next tokens (R,),
    the last real row) or (start, the head's last output (h,)), then the cache's arrays ->
    (the output at the last committed position, the k tokens, [their (k, V) distributions when
    sampling], the cache's arrays)."""

    def fn(start, *inputs):
        if rows:
            features, tokens, index, *arrays = inputs
        else:
            last, *arrays = inputs
        view = cache_view(head, arrays, start, span)
        first = start
        if rows:
            out = head(embed(tokens)[None], features[None], view).squeeze(0)  # (R, h)
            last, first = mx.take(out, index, axis=0), start + index + 1
        drafted = chain(head, embed, project, last, view, first, k, sampling)
        return (last, *drafted, *view.state)

    return fn


def chain(
    head: MtpHead,
    embed: Callable[[mx.array], mx.array],
    project: Callable[[mx.array], mx.array],
    last: mx.array,
    cache,
    first: mx.array,
    k: int,
    sampling: SamplingParams,
) -> tuple[mx.array, ...]:
    """k tokens after the pending one from `last` (h,), the head's output at the slot before
    `first`: token i + 1 is picked from the head's output after step i, which reads token i
    and the output before it at slot `first + i - 1`. Returns the tokens (k,) and, when
    sampling, the processed log-probabilities each was drawn from (k, V). The steps' rotations
    and causal masks are built once for all of them."""
    token, logprobs = pick(project(last).astype(mx.float32), sampling)
    tokens, rows = [token.reshape(1)], [logprobs]
    hidden = last.reshape(1, 1, -1)
    cache.start = first
    if k > 1:
        steps = build_context(head.rope, cache, k - 1, None, None, None, (False,), last.dtype)
    for i in range(k - 1):
        ctx = steps.row(i, head.rope, last.dtype)
        hidden = head(embed(tokens[-1][None]), hidden, cache, ctx)  # (1, 1, h)
        token, logprobs = pick(project(hidden[0, 0]).astype(mx.float32), sampling)
        tokens.append(token.reshape(1))
        rows.append(logprobs)
    drafted = mx.concatenate(tokens)
    return (drafted,) if sampling.greedy else (drafted, mx.stack(rows))


def catch_up_and_chain(
    head: MtpHead,
    embed: Callable[[mx.array], mx.array],
    project: Callable[[mx.array], mx.array],
    acceptance: Acceptance,
    hidden: mx.array,
    cache,
    fed: mx.array,
    k: int,
    sampling: SamplingParams,
) -> tuple[mx.array, ...]:
    """After a verify step's rule (traced in its graph): the head runs over the verified
    chain's path, which sits from slot `fed` on, and drafts the next k tokens from its
    output at the last accepted row. Fixed shapes: every path row runs; rows past the
    accepted count write slots the chain overwrites or never attends, and the count selects
    the last real row. Position `fed + i` reads the target's state of path row i and the
    embedding of the token emitted after it. Returns (that output (h,), `chain`'s arrays)."""
    n = acceptance.num_accepted
    rows = hidden[: acceptance.path.shape[0]]  # (D + 1, h): a chain's path is its first rows
    tokens = mx.maximum(acceptance.tokens, 0)  # a rejected sampled path may hold -1 padding
    cache.start = fed
    out = head(embed(tokens)[None], rows[None], cache).squeeze(0)  # (D + 1, h)
    last = mx.take(out, n, axis=0)  # (h,)
    return last, *chain(head, embed, project, last, cache, fed + n + 1, k, sampling)
