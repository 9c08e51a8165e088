"""The batch's verify forward, compiled: one graph per (rows, width, attended span, cache
capacity, chain or tree, taps, fused rows), as the single-stream step is (step.py).

Inputs are the (B, N) tokens and rotary positions, each row's start slot (B,), a tree step's
(B, N, N) visibility among the new tokens, and the cache's arrays; outputs are the logits,
hidden states and taps of every row and the cache's arrays with the new keys written at each
row's own slots. Nothing in the graph depends on the host offsets: rows grow by buckets
(engine.BUCKETS), widths are the planner's few, the span takes two sizes an octave
(`KVCache.span`) and the capacity grows a chunk at a time, so the traces stay few.

A fused drafter's row (EAGLE, MTP, DFlash: `FusedRow`) has its acceptance rule and its
drafter's next draft (`step.Then`) traced into the same graph, over its own rows of the
output, as its step alone is: the row needs no drafting call of its own between steps, and
the step stays one compiled call and one host sync.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from ..graphs import compiled, synchronous
from ..models.base import CausalLM, ModelOutput
from ..step import CHAIN_WIDTHS, TREE_WIDTHS, Then, padded_draft, reachable, verify_rows
from ..tree import DeviceTree, PaddedTree, Tree
from ..verify import Acceptance, AcceptanceRule
from .cache import BatchKVCache


@dataclass(frozen=True, eq=False)
class FusedRow:
    """A batch row whose acceptance rule and drafter's next draft run inside the batch step
    (see the module): its draft over its own leading rows of the step (`rows`), padded as its
    step alone pads it (`of`), its rule, its drafter's taps (indices into the step's) and the
    drafter's `Then`."""

    row: int
    tree: PaddedTree  # with static bounds (step.padded_draft)
    drafted: mx.array  # (rows - 1,) int32: its draft tokens, -1 past them (never accepted)
    q: mx.array | None  # (rows, V) its draft's distributions, where its rule reads them
    rule: AcceptanceRule
    taps: tuple[int, ...]
    then: Then

    @classmethod
    def of(
        cls,
        row: int,
        width: int,
        tree: Tree | DeviceTree,
        tokens: mx.array,
        logprobs: mx.array | None,
        rule: AcceptanceRule,
        taps: tuple[int, ...],
        then: Then,
    ) -> FusedRow:
        """Row `row` of a step `width` wide, verifying `tree`'s `tokens` (its draft's
        `logprobs`, None for deterministic picks) by `rule`. Its rows are those its step
        alone would verify (`verify_rows`), at most the batch's width: the drafter's `Then`
        sized its writes by them."""
        rows = min(verify_rows(tree), width)
        padded, drafted, q = padded_draft(tree, rows, tokens, logprobs, rule)
        return cls(row, padded, drafted, q, rule, taps, then)

    @property
    def key(self) -> tuple:
        """What shapes its part of the step's graph."""
        t = self.tree
        shape = (t.num_nodes, t.is_chain, t.depth, t.width)
        return (self.row, shape, self.q is not None, self.rule, self.taps, self.then.key)

    @property
    def static(self) -> _Static:
        t = self.tree
        return _Static(
            self.row,
            t.num_nodes,
            t.depth,
            t.width,
            t.is_chain,
            self.q is not None,
            self.rule,
            self.taps,
            self.then.trace,
        )

    @property
    def inputs(self) -> tuple[mx.array, ...]:
        t = self.tree
        own = (t.parent_index, t.depth_index, t.ancestors, self.drafted)
        return own + (() if self.q is None else (self.q,)) + self.then.inputs


@dataclass(frozen=True)
class _Static:
    """What a fused row's part of the graph is traced from: its `FusedRow` without arrays."""

    row: int
    rows: int
    depth: int
    width: int
    is_chain: bool
    sampled_q: bool
    rule: AcceptanceRule
    taps: tuple[int, ...]
    trace: Callable[..., tuple[mx.array, ...]]


@dataclass(frozen=True)
class BatchOutput:
    """A batch step's lazy results: the target's over every row, and each fused row's
    acceptance and its `Then`'s outputs, in the order of the rows given."""

    model: ModelOutput
    fused: tuple[tuple[Acceptance, tuple[mx.array, ...]], ...] = ()


def forward(
    model: CausalLM,
    cache: BatchKVCache,
    tokens: mx.array,
    positions: mx.array,
    mask: mx.array | None,
    taps: tuple[int, ...],
    fused: tuple[FusedRow, ...] = (),
) -> BatchOutput:
    """The target over (B, N) `tokens` at `positions`, row b's keys written from its start
    slot (`BatchKVCache.prepare` reserved the room and set the starts and span); `mask`: None
    (causal) or (B, N, N) bool; `fused`: rows whose rule and next draft run in the graph too.
    Lazy; the cache takes the written arrays."""
    B, N = tokens.shape
    span = cache.attended
    key = ("batch", B, N, mask is None, taps, tuple(f.key for f in fused))
    # The fused rows' static parts only: the graph (and its pending build) keeps no array of
    # the first call's rows; their arrays come as inputs, in `inputs` order.
    shapes = tuple((f.static, len(f.inputs)) for f in fused)
    build = lambda: _forward_fn(model, cache, mask is None, taps, span, shapes)  # noqa: E731
    fn = compiled(model, key, build, span=span)
    args = (tokens, positions, cache.start) + (() if mask is None else (mask,))
    extra = tuple(a for f in fused for a in f.inputs)
    logits, hidden, taps_out, rows = cache.take_outputs(fn(*args, *extra, *cache.state))
    out = ModelOutput(logits, hidden, tuple(taps_out))
    return BatchOutput(out, tuple((Acceptance(*r[:3]), tuple(r[3:])) for r in rows))


def _forward_fn(
    model: CausalLM,
    cache: BatchKVCache,
    chain: bool,
    taps: tuple[int, ...],
    span: int,
    shapes: tuple[tuple[_Static, int], ...],
) -> Callable:
    def step(tokens, positions, start, *rest):
        mask, rest = (None, rest) if chain else (rest[0], rest[1:])
        view = cache.fresh()
        used = sum(n for _, n in shapes)
        view.adopt(rest[used:])
        view.start, view.attended = start, span
        out = model(tokens, view, positions=positions, mask=mask, taps=taps)
        rows, at = [], 0
        for f, n in shapes:
            rows.append(_fused_row(f, out, rest[at : at + n]))
            at += n
        return out.logits, out.hidden, tuple(out.taps), tuple(rows), *view.state

    return step


def _fused_row(f: _Static, out: ModelOutput, inputs: tuple[mx.array, ...]) -> tuple:
    """A fused row's rule over its rows of `out`, then its `Then`: (path, tokens, accepted
    count, *the Then's outputs)."""
    parent_index, depth_index, ancestors, drafted, *rest = inputs
    q, extra = (rest[0], rest[1:]) if f.sampled_q else (None, rest)
    tree = PaddedTree(f.rows, f.depth, f.width, f.is_chain, parent_index, depth_index, ancestors)
    b, m = f.row, f.rows
    # A slice, not [b]: MLX indexes with an int by a gather (two graph nodes, not one).
    logits = out.logits[b : b + 1, :m].squeeze(0)
    hidden = out.hidden[b : b + 1, :m].squeeze(0)
    row_taps = tuple(out.taps[i][b : b + 1, :m].squeeze(0) for i in f.taps)
    acceptance = f.rule(tree, drafted, logits, q)
    following = f.trace(acceptance, hidden, row_taps, *extra)
    return (acceptance.path, acceptance.tokens, acceptance.num_accepted, *following)


def build(model: CausalLM, rows: int) -> None:
    """Builds the batch step's graphs for `rows` sequences now, in this thread: chains of
    CHAIN_WIDTHS and, where the target's cache follows trees, trees of TREE_WIDTHS, with
    every row at each of DEPTHS within the model's context (step.py: a graph's kernels at one
    depth do not serve every other). What a server runs at start-up: on the CPU each graph
    would otherwise run eagerly until the machine is idle long enough to build it (graphs.py),
    and concurrent requests leave it no idle. Its inputs are laid out as the engine's
    (stacked, contiguous): a compiled kernel is built per layout, and a broadcast one would
    build kernels no step uses."""
    cache = BatchKVCache.of(model, rows)
    shapes = [(n, True) for n in CHAIN_WIDTHS]
    shapes += [(n, False) for n in TREE_WIDTHS if cache.follows_trees]
    with synchronous():
        for depth in reachable(model, max(n for n, _ in shapes)):
            cache.offsets = [depth] * rows
            for n, chain in shapes:
                cache.prepare(n)
                tokens = mx.zeros((rows, n), dtype=mx.int32)
                positions = mx.stack([mx.arange(depth, depth + n, dtype=mx.int32)] * rows)
                mask = None if chain else mx.stack([mx.eye(n, dtype=mx.bool_)] * rows)
                out = forward(model, cache, tokens, positions, mask, ()).model
                mx.eval(out.logits, cache.state)
