"""A grammar's state for one generation, and what it makes of each decoding step.

The decoding loop asks a `Constraint` for a `Guide` per step (`guide`, or `first` for the
token the prompt's forward chooses), masks the verify forward's rows with `Guide.allowed` and
hands the emitted tokens back (`commit`). Everything else stays in the loop.

The constrained distribution at a position is the target's, renormalised over the tokens the
grammar allows there (the mask is applied to the logits, before temperature and the top-k /
top-p / min-p filters), except where the grammar forces a token: there that token follows with
certainty. Forced tokens are llguidance's fast-forward tokens (the canonical tokens of bytes
the grammar fixes, such as `{"name": "` in a schema's object) and any position where a single
token is allowed (the EOS once the grammar is complete, say).

A step's chain, from the pending token: the forced run; then the drafter's tokens (proposed
after the context and that run) while the grammar allows them; then the forced run after the
last one. Each node's row gets the mask of the grammar's state there (a point mass where a
token is forced), found by walking one matcher along the chain and rolling it back. So:
- a forced token is accepted with certainty by every rule (its row is a point mass), so it is
  emitted without being sampled, as part of this forward's input: one forward emits the whole
  forced run plus what it accepts and samples after it;
- a drafter token the grammar forbids is never accepted. The chain stops before it, except
  for a sampled draft (a draft model at temperature > 0), where it stays as a last node that
  the rule rejects with certainty: that rejection is what makes the token drawn there follow
  the residual max(0, p - q), which keeps speculative sampling exact (cutting it would draw
  from p instead, biased by the draft's mass on forbidden tokens). A drafter token at a
  forced position is the forced token or the end of the drafter's part of the chain.
- EOS is allowed only where the grammar accepts the output; the chain ends after one.
Prompt lookup's drafts are trees: one hangs below the forced run and is walked depth first
as a tree drafter's is (below), forced runs below its leaves included.

A tree drafter's step (Medusa, EAGLE: `tree_guide`): the heads draft from the target's
features at the pending position, so a forced run cannot come first. Where the grammar
forces the next token, the step is the forced run alone (no draft; the drafter drafts again
from the run's end). Otherwise the drafter's tree is walked depth first with the matcher,
each node getting the mask of the grammar's state after its path; a node the grammar forbids
is never accepted: with deterministic children (top-k heads) it is cut with its subtree,
which changes nothing for the rule (its token has no mass under the mask: accepting it has
probability 0 and rejecting it leaves the residual as it was); with sampled children it
stays as a leaf that the rule rejects with certainty, as a chain's does. Below an EOS
nothing is kept. Below a kept node after which the grammar forces tokens the drafter did not
draft (after a key's last free token, say), the forced run joins the tree as a chain of
certain nodes (deterministic trees): accepted with the node, so the target samples after the
run in the same forward instead of a forward for the run alone.

Where the grammar forces the whole rest of the output up to its EOS (`ending`), the loop
emits it without a forward.


Host synchronisation added per constrained step (on top of the loop's own, in decode.py):
  1. the matcher runs on the host, so the next step is built only once this one's tokens are
     read: a constrained plain step cannot be queued on the previous step's lazy token;
  2. a draft model's proposal, or a tree drafter's tokens and tree (EAGLE's device tree), is
     read back (`tolist`) after drafting and before the verify forward, to be walked;
  3. the masks are built on the host (numpy) and copied in as one (N, V) bool array.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import llguidance
import mlx.core as mx
import numpy as np

from ..drafters.base import Draft
from ..tree import Tree
from . import Grammar, GrammarError, first_line, ll_tokenizer


@dataclass(frozen=True)
class Guide:
    """What the grammar makes of one step: the chain to verify and its rows' masks."""

    draft: Draft | None  # the chain below the pending token; None: the pending token alone
    allowed: mx.array  # (N, V) bool: row i, the tokens allowed after node i
    forced: tuple[bool, ...]  # (N,) row i's token is forced (its mask is a point)
    drafted: int  # the drafter's tokens in the chain (forced positions not counted)


@dataclass(frozen=True)
class _Walk:
    """A draft tree as the grammar leaves it (`Constraint._walk`): its kept nodes (ascending,
    the root first; forced runs numbered after the drafter's nodes), their tree, tokens (the
    root's excluded), masks and points, and how many of them the drafter drafted."""

    kept: tuple[int, ...]
    shape: Tree
    tokens: list[int]
    masks: list[np.ndarray]
    forced: tuple[bool, ...]
    drafted: int


class Constraint:
    """One generation's matcher: its state is the grammar after every emitted token."""

    def __init__(self, grammar: Grammar, tokenizer, vocab_size: int):
        if not isinstance(grammar, Grammar):
            raise TypeError(f"grammar must be a Grammar, got {type(grammar).__name__}")
        self._tokenizer = ll_tokenizer(tokenizer)
        self._matcher = llguidance.LLMatcher(self._tokenizer, grammar.source, log_level=0)
        if self._matcher.is_error():
            raise ValueError(
                f"the {grammar.description} is invalid for this tokenizer: "
                f"{self._matcher.get_error().splitlines()[0]}"
            )
        self.vocab_size = vocab_size
        self._eos = frozenset(self._tokenizer.eos_tokens)
        self.finished = False  # an EOS was emitted

    def first(self) -> Guide:
        """The mask of the first token, which the prompt's forward chooses."""
        allowed, forced = self._row()
        return Guide(None, mx.array(allowed[None]), (forced is not None,), 0)

    def guide(
        self,
        context: Sequence[int],
        propose: Callable[[list[int], int], Draft | None] | None,
        k: int,
        room: int,
    ) -> Guide:
        """The step's chain (at most `room` nodes below the pending token) and its masks.
        `propose(context, k)` drafts up to k tokens after a context (None: no drafter)."""
        matcher, walked = self._matcher, 0
        rows, forced, chain, q_rows = [], [], [], []  # q_rows: draft row per node, -1 a point
        drafted = 0

        def step(token: int, q_row: int) -> bool:
            """Appends `token`; False when the chain must end after it."""
            nonlocal walked
            chain.append(token)
            q_rows.append(q_row)
            if token in self._eos:  # nothing follows an EOS: the row is never read
                rows.append(np.ones(self.vocab_size, dtype=bool))
                forced.append(False)
                return False
            self._consume(token)
            walked += 1
            allowed, point = self._row()
            rows.append(allowed)
            forced.append(point is not None)
            return True

        def run_forced() -> bool:
            while forced[-1] and len(chain) < room:
                token = int(np.flatnonzero(rows[-1])[0])
                if token in self._eos:  # the target's own token after the chain is this EOS
                    break
                if not step(token, -1):
                    return False
            return True

        allowed, point = self._row()
        rows.append(allowed)
        forced.append(point is not None)
        live = run_forced()
        budget = min(k, room - len(chain))
        draft = propose(list(context) + chain, budget) if live and propose and budget > 0 else None
        if draft is not None and not draft.tree.is_chain:  # lookup's tree, below the run
            grafted = self._graft(chain, rows, forced, draft, room)
            matcher.rollback(walked)
            return grafted
        sampled = draft is not None and draft.logprobs is not None
        if draft is not None:
            for j, token in enumerate(draft.tokens.tolist()[:budget]):  # sync: the draft
                if forced[-1]:
                    if not (token < self.vocab_size and rows[-1][token]):
                        break  # the drafter went another way: its later tokens follow that
                    live = step(token, -1)
                elif token < self.vocab_size and rows[-1][token]:
                    drafted += 1
                    live = step(token, j)
                else:
                    if sampled:  # a last node, rejected with certainty (see the docstring)
                        drafted += 1
                        chain.append(token)
                        q_rows.append(j)
                        rows.append(np.ones(self.vocab_size, dtype=bool))
                        forced.append(False)
                        live = False
                    break
                if not live:
                    break
        if live:
            run_forced()
        matcher.rollback(walked)
        return Guide(
            self._draft(chain, q_rows, draft if sampled else None),
            mx.array(np.stack(rows)),
            tuple(forced),
            drafted,
        )

    def tree_guide(self, propose: Callable[[], Draft | None], room: int) -> Guide:
        """A tree drafter's step: the forced run where the grammar forces the next token (at
        most `room` nodes), else `propose()`'s tree less what the grammar forbids, with the
        forced runs below its nodes (no deeper than `room`)."""
        allowed, point = self._row()
        if point is not None:
            return self.guide((), None, 0, room)
        draft = propose()
        if draft is None:
            return Guide(None, mx.array(allowed[None]), (False,), 0)
        walk = self._walk(draft, allowed, room)
        logprobs = draft.logprobs
        if logprobs is not None:  # by parent: the kept nodes that had children keep theirs
            logprobs = logprobs[mx.array([i for i in walk.kept if i < logprobs.shape[0]])]
        pruned = None
        if walk.tokens:
            pruned = Draft(mx.array(walk.tokens, dtype=mx.int32), walk.shape, logprobs)
        return Guide(pruned, mx.array(np.stack(walk.masks)), walk.forced, walk.drafted)

    def _graft(
        self, chain: list[int], rows: list[np.ndarray], forced: list[bool], draft: Draft, room: int
    ) -> Guide:
        """A chain drafter's tree (prompt lookup's: deterministic picks) walked below the
        step's forced run (`chain`, its masks `rows`), as `tree_guide` walks a head's."""
        walk = self._walk(draft, rows[-1], room - len(chain))
        base = len(chain)  # the tree's root is the run's last node
        parents = [*Tree.chain(base).parents, *(p + base for p in walk.shape.parents[1:])]
        nodes = chain + walk.tokens
        return Guide(
            Draft(mx.array(nodes, dtype=mx.int32), Tree(tuple(parents))) if nodes else None,
            mx.array(np.stack(rows + walk.masks[1:])),
            tuple(forced) + walk.forced[1:],
            walk.drafted,
        )

    def _walk(self, draft: Draft, allowed: np.ndarray, room: int) -> _Walk:
        """Depth first along a draft tree with the matcher (rolled back after), from a root
        whose mask is `allowed`: what the grammar forbids is cut with its subtree (or, with
        sampled children, kept as a leaf rejected with certainty), and below a deterministic
        tree's kept leaves the forced runs join as certain nodes, no deeper than `room`."""
        tree = draft.tree if isinstance(draft.tree, Tree) else draft.tree.host()
        tokens = draft.tokens.tolist()  # sync: the tree, walked on the host
        sampled = draft.logprobs is not None
        anything = np.ones(self.vocab_size, dtype=bool)  # the row of a node never accepted
        rows: dict[int, tuple[np.ndarray, bool]] = {0: (allowed, False)}
        # Node -> parent, token, depth; forced runs below the drafter's nodes join as N, N+1...
        parents, depths = dict(enumerate(tree.parents)), dict(enumerate(tree.depths))
        token_of = dict(enumerate([-1, *tokens]))
        cap = max(room, tree.num_nodes - 1)  # nodes below the root: what the context holds

        def force_below(node: int) -> None:
            """The forced run after `node` as a chain below it: certain nodes, accepted with
            it, so the target samples after the run in this same forward."""
            walked = 0
            while rows[node][1] and depths[node] < room and len(rows) <= cap:
                token = int(np.flatnonzero(rows[node][0])[0])
                if token in self._eos:  # the target's own token after the run is this EOS
                    break
                self._consume(token)
                walked += 1
                child = len(parents)
                parents[child], depths[child], token_of[child] = node, depths[node] + 1, token
                row, forced = self._row()
                rows[child] = (row, forced is not None)
                node = child
            self._matcher.rollback(walked)

        def visit(node: int) -> None:
            for child in tree.children(node):
                token = tokens[child - 1]
                if not (0 <= token < self.vocab_size and rows[node][0][token]):
                    if sampled:  # a leaf rejected with certainty (see the docstring)
                        rows[child] = (anything, False)
                    continue
                if token in self._eos:  # nothing follows an EOS: its row is never read
                    rows[child] = (anything, False)
                    continue
                self._consume(token)
                row, forced = self._row()
                rows[child] = (row, forced is not None)
                visit(child)
                self._matcher.rollback(1)
            if not sampled and not any(child in rows for child in tree.children(node)):
                force_below(node)

        visit(0)
        kept = sorted(rows)  # parents come before children: the drafter's nodes, then runs
        index = {node: i for i, node in enumerate(kept)}
        return _Walk(
            tuple(kept),
            Tree((-1, *(index[parents[i]] for i in kept[1:]))),
            [token_of[i] for i in kept[1:]],
            [rows[i][0] for i in kept],
            tuple(rows[i][1] for i in kept),
            sum(0 < i < tree.num_nodes for i in kept),
        )

    def ending(self, room: int) -> tuple[int, ...] | None:
        """The rest of the output where the grammar forces all of it: the forced run (at most
        `room` tokens) and the forced EOS after it. Emitted without a forward: every token
        is certain, and nothing follows an EOS. None where something is left to choose."""
        run: list[int] = []  # consumed by the matcher, rolled back at the end
        try:
            while True:
                _, point = self._row()
                if point is None:
                    return None
                if point in self._eos:
                    return (*run, point)
                if len(run) >= room:
                    return None
                self._consume(point)
                run.append(point)
        finally:
            self._matcher.rollback(len(run))

    def commit(self, tokens: Sequence[int]) -> None:
        """The step emitted `tokens`: the matcher moves past them."""
        for token in tokens:
            if self.finished:
                return
            if token in self._eos:
                self.finished = True
            else:
                self._consume(int(token))

    def _consume(self, token: int) -> None:
        """The matcher moves past `token`; GrammarError where the grammar cannot (an engine
        limit reached, say: a grammar that only recurses)."""
        if not self._matcher.consume_token(token):
            raise GrammarError(
                f"the grammar cannot go on after token {token}: "
                f"{first_line(self._matcher.get_error())}"
            )

    def _row(self) -> tuple[np.ndarray, int | None]:
        """(V,) bool tokens allowed next, and the forced token, if any."""
        if self.finished:
            raise ValueError("the grammar's output is complete (an EOS was emitted)")
        ff = self._matcher.compute_ff_tokens()
        if ff and ff[0] < self.vocab_size:
            allowed = np.zeros(self.vocab_size, dtype=bool)
            allowed[ff[0]] = True
            return allowed, ff[0]
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little").astype(bool)[: self.vocab_size]
        if len(allowed) < self.vocab_size:  # the model's vocabulary is padded
            allowed = np.pad(allowed, (0, self.vocab_size - len(allowed)))
        count = int(allowed.sum())
        if count == 0:
            why = f" ({first_line(self._matcher.get_error())})" if self._matcher.is_error() else ""
            raise GrammarError(f"the grammar allows no token of the model's vocabulary here{why}")
        return allowed, int(np.flatnonzero(allowed)[0]) if count == 1 else None

    def _draft(self, chain: list[int], q_rows: list[int], sampled: Draft | None) -> Draft | None:
        """The chain as a Draft; a sampled draft's rows by parent, points where forced."""
        if not chain:
            return None
        tokens = mx.array(chain, dtype=mx.int32)
        logprobs = None
        if sampled is not None:
            rows = sampled.logprobs[mx.array([max(r, 0) for r in q_rows], dtype=mx.int32)]
            is_point = mx.array([r < 0 for r in q_rows])[:, None]
            logprobs = mx.where(is_point, points(tokens, rows.shape[-1]), rows)
        return Draft(tokens, Tree.chain(len(chain)), logprobs)


def points(tokens: mx.array, vocab_size: int) -> mx.array:
    """(N, V) log-probabilities of certainty: row i puts all its mass on tokens[i]."""
    return mx.where(mx.arange(vocab_size) == tokens[:, None], 0.0, -mx.inf)


def masked(logits: mx.array, guide: Guide | None) -> mx.array:
    """The rows with the tokens the grammar forbids at -inf."""
    return logits if guide is None else mx.where(guide.allowed, logits, -mx.inf)
