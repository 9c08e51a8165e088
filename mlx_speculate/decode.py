"""The one decoding loop: propose -> verify in one target forward -> accept -> commit.

Plain decoding is this loop with no drafter (or a step where the drafter proposes nothing):
the target then verifies just the pending token and the rule emits one token.

Host synchronisation, per step:
  1. `mx.eval` of the acceptance result, then `.item()`/`.tolist()` on the already-evaluated
     arrays. Draft-model proposals, the target forward and the chain acceptance rules are all
     lazy and run as one graph; the cache writes are evaluated as inputs of the attention.
  2. Tree acceptance reads the per-node target distributions on the host after that same eval.
  3. Only when the rope type depends on the largest position (dynamic NTK, longrope) does a tree
     forward read that position back (models/base.py).
When a plain step follows a plain one (always without a drafter; with one, when the policy
chooses 0), step t+1 is queued with `mx.async_eval` before step t's token is read, as mlx-lm
does, so host work overlaps the next forward.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .cache import KVCache
from .drafters import Draft, Drafter, TargetState
from .models.base import CausalLM
from .policy import FixedPolicy, Policy
from .sampling import SamplingParams, log_probs, sample
from .verify import (
    greedy_accept,
    greedy_tree_accept,
    rejection_accept,
    tree_rejection_accept,
    typical_tree_accept,
)

PREFILL_STEP = 512


@dataclass(frozen=True)
class Step:
    """The tokens one target forward committed."""

    tokens: tuple[int, ...]  # accepted draft tokens, then the target's own token
    drafted: int  # tokens the drafter proposed (tree: nodes below the root)
    accepted: int  # how many of `tokens` came from the draft
    logprobs: mx.array  # (len(tokens), V) target log-probabilities that chose each token
    seconds: float


@dataclass(frozen=True)
class _Pending:
    """A queued step: lazy until `_finish` evaluates it."""

    offset: int
    draft: Draft | None
    tokens: mx.array  # (k + 1,) chain: emitted candidates; tree: the verified inputs
    num_accepted: mx.array | None  # () drafted chains only
    logits: mx.array  # (k + 1, V)
    target_logprobs: mx.array | None  # processed, sampling only
    hidden: mx.array  # (k + 1, hidden)
    layer_hidden: tuple[mx.array, ...]


class Decoder:
    """Runs the loop for one prompt. `context` is prompt + emitted tokens; its last token is
    pending: emitted but not yet in the target cache."""

    def __init__(
        self,
        model: CausalLM,
        sampling: SamplingParams,
        drafter: Drafter | None = None,
        policy: Policy | None = None,
        max_context: int | None = None,
        typical_acceptance: bool = False,
    ):
        self.model = model
        self.sampling = sampling
        self.drafter = drafter
        self.policy = policy or FixedPolicy(0)
        self.max_context = max_context or model.args.max_position_embeddings
        self.cache: KVCache = model.make_cache()
        self.hidden_layers = drafter.hidden_layers if drafter is not None else ()
        # Medusa's typical acceptance for trees when sampling: LOSSY, opt-in only.
        self.typical_acceptance = typical_acceptance
        self.context: list[int] = []
        # Tree acceptance samples on the host after the step's one sync.
        self.rng = np.random.default_rng(sampling.seed)
        self._clock = 0.0  # when the last step finished

    def prefill(self, prompt: Sequence[int]) -> None:
        """Puts all but the last prompt token in the cache."""
        if len(prompt) == 0:
            raise ValueError("the prompt is empty")
        if len(prompt) > self.max_context:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens, more than the model's context of "
                f"{self.max_context}"
            )
        self.context = list(prompt)
        for start in range(0, len(prompt) - 1, PREFILL_STEP):
            chunk = prompt[start : min(start + PREFILL_STEP, len(prompt) - 1)]
            self.model(mx.array([chunk]), self.cache)
            mx.eval(self.cache.state)

    def room(self) -> int:
        """How many draft tokens fit before the context limit."""
        return self.max_context - len(self.context)

    def _queue(self, pending: mx.array, k: int, state: TargetState | None) -> _Pending:
        draft = None
        if self.drafter is not None and k > 0:
            draft = self.drafter.propose(self.context, min(k, self.room()), state)
            if draft is not None and draft.size == 0:
                draft = None
        offset = self.cache.offset
        inputs = pending if draft is None else mx.concatenate([pending, draft.tokens])
        positions = mask = None
        if draft is not None and draft.tree is not None:
            positions = draft.tree.positions(offset)
            mask = draft.tree.attention_mask(offset)
        out = self.model(
            inputs[None], self.cache, positions=positions, mask=mask,
            hidden_layers=self.hidden_layers,
        )
        logits = out.logits[0]  # (k + 1, V)
        target_logprobs = None if self.sampling.greedy else log_probs(logits, self.sampling)
        tokens, num_accepted = inputs, None  # trees are accepted on the host in `_finish`
        if draft is None:
            # Nothing to verify: the target's own token, without building a rule's graph.
            greedy = self.sampling.greedy
            tokens = mx.argmax(logits, axis=-1) if greedy else sample(target_logprobs)
        elif draft.tree is None:
            if self.sampling.greedy:
                acceptance = greedy_accept(draft.tokens, logits)
            else:
                draft_logprobs = draft.logprobs
                if draft_logprobs is None:
                    raise ValueError("a sampled chain draft needs the draft's logprobs")
                acceptance = rejection_accept(draft.tokens, draft_logprobs, target_logprobs)
            tokens, num_accepted = acceptance.tokens, acceptance.num_accepted
        # Scheduled on its own as soon as it is built: a later step queued on top of it must
        # not make reading this one wait for both.
        mx.async_eval(tokens, *([] if num_accepted is None else [num_accepted]))
        return _Pending(
            offset,
            draft,
            tokens,
            num_accepted,
            logits,
            target_logprobs,
            out.hidden[0],
            tuple(h[0] for h in out.layer_hidden),
        )

    def _finish(self, step: _Pending) -> tuple[Step, TargetState]:
        draft = step.draft
        if draft is not None and draft.tree is not None:
            path, tokens = self._accept_tree(step)
            rows = mx.array(path)
        else:
            if step.num_accepted is None:
                mx.eval(step.tokens)
                n = 0
            else:
                mx.eval(step.tokens, step.num_accepted)
                n = step.num_accepted.item()
            tokens = step.tokens[: n + 1].tolist()
            if draft is not None and n < draft.size:
                self.cache.truncate(step.offset + n + 1)
            rows = slice(0, n + 1)  # a chain keeps a prefix of its rows
        state = TargetState(step.hidden[rows], tuple(h[rows] for h in step.layer_hidden))
        logits = step.logits[rows]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        self.context.extend(tokens)
        if self.drafter is not None:
            self.drafter.rewind(len(self.context) - 1)
        # Wall time since the previous step finished: what the step cost the stream, also
        # when it overlapped the one before.
        now = time.perf_counter()
        seconds, self._clock = now - self._clock, now
        drafted = 0 if draft is None else draft.size
        result = Step(tuple(tokens), drafted, len(tokens) - 1, logprobs, seconds)
        self.policy.observe(drafted, len(tokens) - 1, seconds)
        return result, state

    def _accept_tree(self, step: _Pending) -> tuple[list[int], list[int]]:
        tree = step.draft.tree
        draft_logprobs = step.draft.logprobs
        scores = step.logits if self.sampling.greedy else step.target_logprobs
        extra = [] if draft_logprobs is None else [draft_logprobs]
        mx.eval(scores, step.tokens, *extra)
        node_tokens = np.array(step.tokens)  # the verified inputs: root, then the draft nodes
        if self.sampling.greedy:
            result = greedy_tree_accept(tree.parents, node_tokens, np.array(scores))
        elif self.typical_acceptance:
            result = typical_tree_accept(tree.parents, node_tokens, np.array(scores))
        else:
            result = tree_rejection_accept(
                tree.parents,
                node_tokens,
                np.array(scores),
                None if draft_logprobs is None else np.array(draft_logprobs),
                self.rng,
            )
        path = list(result.path)
        self.cache.compact(step.offset, [step.offset + i for i in path])
        return path, [int(node_tokens[i]) for i in path[1:]] + [int(result.next_token)]

    def steps(self) -> Iterator[Step]:
        """Yields one Step per target forward until the context is full."""
        self._clock = time.perf_counter()
        step = self._queue(mx.array(self.context[-1:]), 0, None)
        while True:
            upcoming = k = None
            if step.draft is None and self.room() > 1:
                # Decided one observation early, so that a plain step can be queued on the
                # lazy token before this one is read.
                k = self.policy.choose()
                if k == 0:
                    upcoming = self._queue(step.tokens[:1], 0, None)
            result, state = self._finish(step)
            yield result
            if self.room() <= 0:
                return
            if upcoming is None:
                k = self.policy.choose() if k is None else k
                upcoming = self._queue(mx.array(self.context[-1:]), k, state)
            step = upcoming
