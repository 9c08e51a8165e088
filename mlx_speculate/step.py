"""Compiled verify and draft steps: fixed shapes, one graph per row bucket.

A verify step runs the target over a draft tree padded to a row bucket (`BUCKETS`, then multiples
of 64; a chain of at most `EXACT_CHAIN` nodes runs unpadded) and applies the
acceptance rule, both inside one `mx.compile` graph whose inputs are the tokens, the tree's
arrays, the cache slot start and the cache storage (and the random state, so sampling stays
seeded). Nothing in it depends on the host offset: a graph is traced once per (rows, capacity,
rule, tree depth and width bounds, attended span) and reused until the cache grows a chunk or
the step's last slot passes the span (`KVCache.span`: two sizes an octave).
Padding nodes carry the draft token -1 (their input token is 0), see only their ancestors and
are never accepted; the host advances the cache by the real node count.

Models that cannot be traced (`CausalLM.traceable`: rope frequencies that depend on the largest
position, dynamic NTK and longrope) run the same step uncompiled.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import mlx.core as mx

from .cache import KVCache, KVCodec
from .graphs import compiled, synchronous
from .models.base import CausalLM
from .models.quantized_prefill import prefilling
from .sampling import SamplingParams, pick
from .tree import DeviceTree, PaddedTree, Tree
from .verify import Acceptance, AcceptanceRule

# Half-octave steps past 8: on a CPU a verify's cost grows with its rows, so a tree padded
# to the next power of two would pay for many rows it does not use.
BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
# Chains up to this many rows verify unpadded, one graph per exact row count: a draft model's
# or lookup's k is mostly fixed, so the few graphs are reused, and on an overhead-bound target
# a bucket's padding rows are a large share of the step.
EXACT_CHAIN = 8

# Cache offsets a start-up build verifies at (`build`, batch/step.py's too): the cache's start,
# within its first storage chunk (`KVCache.step` slots) and past it. The kernels MLX fuses
# for a graph differ between these (it collapses an array's dimensions by their strides,
# which the span and the capacity change); steps further on share the last one's.
DEPTHS = (0, 160, 320)
# The widths a start-up build verifies: a chain of one row, of two and of more fuse kernels of
# their own, while longer chains share the four-row one's, as trees of every width share
# theirs (their sizes are inputs of the graph, never constants in its kernels).
CHAIN_WIDTHS = (1, 2, 4)
TREE_WIDTHS = (4,)
# The acceptance rules a start-up build verifies under: greedy decoding's, and one sampled
# rule's, whose kernels serve every temperature, top-p and min-p (`graphs.variable`).
BUILT_RULES = (AcceptanceRule(SamplingParams()), AcceptanceRule(SamplingParams(temperature=1.0)))
# What a start-up build's shapes are (a server's `graphs.ahead` names its builds by them, so
# that a change to them builds again on a machine that built the ones before).
BUILT_SHAPES = (DEPTHS, CHAIN_WIDTHS, TREE_WIDTHS)


def bucket(n: int) -> int:
    """The rows a forward of n tokens is padded to."""
    return next((b for b in BUCKETS if n <= b), -(-n // BUCKETS[-1]) * BUCKETS[-1])


def verify_rows(tree: Tree | DeviceTree) -> int:
    """The rows a verify step of `tree` runs: a short chain's own node count, else its bucket."""
    n = tree.num_nodes
    return n if tree.is_chain and n <= EXACT_CHAIN else bucket(n)


@dataclass(frozen=True)
class Verified:
    """A verify step's lazy results; rows are the padded tree's."""

    acceptance: Acceptance
    logits: mx.array  # (rows, V)
    hidden: mx.array  # (rows, hidden)
    taps: tuple[mx.array, ...]  # (rows, hidden) each
    then: tuple[mx.array, ...] = ()  # what a `Then` traced after the rule returned


@dataclass(frozen=True)
class Then:
    """Work traced into a verify step's graph after its rule, so that a drafter's next draft
    needs no call of its own: `trace(acceptance, hidden, taps, *inputs)` returns arrays
    (`Verified.then`); `key` names what shapes its graph besides the step's own key. The
    step also moves a tree's accepted path into consecutive cache slots (the caller only
    truncates to root + accepted + 1)."""

    key: tuple
    inputs: tuple[mx.array, ...]
    trace: Callable[..., tuple[mx.array, ...]]


def verify(
    model,
    cache: KVCache,
    pending: mx.array,
    tree: Tree,
    draft: mx.array | None,
    draft_logprobs: mx.array | None,
    rule: AcceptanceRule,
    *,
    taps: tuple[int, ...] = (),
    allowed: mx.array | None = None,
    at: tuple[mx.array, int] | None = None,
    then: Then | None = None,
) -> Verified:
    """Queues one verify step (lazy): `pending` (1,) and `draft` (N - 1,) tokens of `tree`,
    accepted by `rule`; `allowed` (N, V) bool, a grammar's mask per row: the rule sees
    forbidden tokens at -inf.

    Fixed shapes: every array is padded to `verify_rows(tree)` rows (the q rows too) and the
    cache is read whole; no host sync. Writes the padded rows from the cache offset and
    advances the offset by N; or, with `at` (a lazy root slot and a host bound on it), from
    that slot, leaving the offset to the caller (a step queued before the last one is read).
    `then`: work traced after the rule, see `Then`. A model that cannot be traced
    (`CausalLM.traceable`) runs the same step eagerly."""
    n = tree.num_nodes
    rows = verify_rows(tree)
    cache.check_verify(rows, tree.is_chain)  # before tracing: a refusal inside would not undo
    padded, drafted, q = padded_draft(tree, rows, draft, draft_logprobs, rule)
    inputs = mx.concatenate([pending.astype(mx.int32), mx.maximum(drafted, 0)])[None]
    args = [inputs, drafted, padded.parent_index, padded.depth_index, padded.ancestors]
    sampled_q = q is not None
    if sampled_q:
        args.append(q)
    if allowed is not None:  # padding rows allow everything (they are never read)
        ones = mx.ones((rows - n, allowed.shape[-1]), mx.bool_)
        args.append(mx.concatenate([allowed, ones]))
    masked = allowed is not None
    shape = (rows, padded.is_chain, padded.depth, padded.width)
    span = _reserve(model, cache, (cache.offset if at is None else at[1]) + rows)
    codec = cache.codec  # after `_reserve`, which may have switched it
    key = ("verify", shape, sampled_q, masked, rule, taps, codec)
    key += () if then is None else (then.key,)
    fn = compiled(
        model,
        key,
        lambda: _verify_fn(model, padded, rule, taps, sampled_q, masked, span, then, codec),
        traced=model.traceable,
        span=span,
    )
    start = mx.array(cache.offset, dtype=mx.int32) if at is None else at[0]
    extra = () if then is None else then.inputs
    out = cache.take_outputs(fn(start, *args, *extra, *cache.state))
    if at is None:
        cache.advance(n)
    path, tokens, num_accepted, logits, hidden, *rest = out
    acceptance = Acceptance(path, tokens, num_accepted)
    t = len(taps)
    return Verified(acceptance, logits, hidden, tuple(rest[:t]), tuple(rest[t:]))


def padded_draft(
    tree: Tree | DeviceTree,
    rows: int,
    draft: mx.array | None,
    draft_logprobs: mx.array | None,
    rule: AcceptanceRule,
) -> tuple[PaddedTree, mx.array, mx.array | None]:
    """A verify step's draft over `rows` >= tree.num_nodes rows: the tree padded with static
    bounds (`_bounded`), its draft tokens (rows - 1,) with -1 past them (never accepted), and
    where `rule` reads them, the draft's distributions (rows, V), zeros past them. The single
    step and a batch's fused rows (batch/step.py) pad alike, so their graphs agree."""
    pad = rows - tree.num_nodes
    drafted = mx.zeros((0,), mx.int32) if draft is None else draft.astype(mx.int32)
    drafted = mx.concatenate([drafted, mx.full((pad,), -1, mx.int32)])
    q = None
    if draft_logprobs is not None and rule.reads_draft:
        q = draft_logprobs.astype(mx.float32)
        q = mx.concatenate([q, mx.zeros((rows - q.shape[0], q.shape[-1]), mx.float32)])
    return _bounded(tree.padded(rows)), drafted, q


def _bounded(padded: PaddedTree) -> PaddedTree:
    """The padded tree with static bounds for its depth and width rather than its own, so
    that drafts of nearby sizes and shapes share one traced graph (a trace costs several
    steps, and the adaptive policy and lookup trees vary both): a padded chain is a chain of
    rows - 1 nodes, a tree's bounds are powers of two (at most rows - 1)."""
    rows = padded.num_nodes
    if padded.is_chain:
        return replace(padded, depth=rows - 1, width=1)
    depth = min(1 << (padded.depth - 1).bit_length(), rows - 1)
    width = min(1 << (padded.width - 1).bit_length(), rows - 1)
    return replace(padded, depth=depth, width=width)


def _verify_fn(
    model,
    shape: PaddedTree,
    rule: AcceptanceRule,
    taps: tuple[int, ...],
    sampled_q: bool,
    masked: bool,
    span: int,
    then: Then | None,
    codec: KVCodec | None = None,
) -> Callable:
    def step(start, inputs, drafted, parent_index, depth_index, ancestors, *rest):
        q, rest = (rest[0], rest[1:]) if sampled_q else (None, rest)
        allowed, rest = (rest[0], rest[1:]) if masked else (None, rest)
        extra = 0 if then is None else len(then.inputs)
        extra, arrays = rest[:extra], rest[extra:]
        tree = PaddedTree(
            shape.num_nodes,
            shape.depth,
            shape.width,
            shape.is_chain,
            parent_index,
            depth_index,
            ancestors,
        )
        view = cache_view(model, arrays, start, span, codec)
        positions = mask = None
        if not shape.is_chain:  # a chain (and its padding) needs the causal default
            positions, mask = start + depth_index, ancestors
        out = model(inputs, view, positions=positions, mask=mask, taps=taps)
        # squeeze(0), not [0]: MLX indexes with an int by a gather (two graph nodes, not one)
        logits, hidden = out.logits.squeeze(0), out.hidden.squeeze(0)  # (rows, V), (rows, h)
        if allowed is not None:
            logits = mx.where(allowed, logits, -mx.inf)
        acceptance = rule(tree, drafted, logits, q)
        taps_out = tuple(t.squeeze(0) for t in out.taps)
        following = ()
        if then is not None:
            following = then.trace(acceptance, hidden, taps_out, *extra)
            if not shape.is_chain and view is not None:
                view.compact(start, acceptance.path)
        return (
            acceptance.path,
            acceptance.tokens,
            acceptance.num_accepted,
            logits,
            hidden,
            *taps_out,
            *following,
            *(view.state if view is not None else ()),
        )

    return step


def _reserve(model, cache: KVCache, length: int) -> int:
    """Storage for `length` slots in every layer; returns the slots a step writing below
    `length` attends to (`KVCache.span`)."""
    cache.reserve(length)
    return cache.span(length)


def cache_view(model, arrays, start, span: int, codec: KVCodec | None = None) -> KVCache | None:
    """The cache a traced forward writes into: a view over the step's cache inputs, whose
    attention reads the leading `span` slots; `codec`: the live cache's quantization."""
    cache = model.make_cache()
    cache.adopt(arrays)
    cache.start, cache.attended, cache.codec = start, span, codec
    return cache


def decode(
    model,
    cache: KVCache,
    tokens: mx.array,
    k: int,
    sampling: SamplingParams,
    shared: int,
    vocab: int,
) -> tuple[mx.array, mx.array | None]:
    """A drafter's chain: feeds `tokens` (L,) to `model`, then picks k tokens one after the
    other, each fed back for the next, among the first `shared` ids of a `vocab`-sized
    vocabulary (the target's). Returns the tokens (k,) and, when sampling, the processed
    log-probabilities each was drawn from (k, vocab). The cache advances by L + k - 1: the
    last token is not fed.

    Fixed shapes: the k forwards are one compiled graph per (row bucket of L, k); L is padded
    to its bucket (the padding comes after the real tokens, so causal attention keeps it out of
    their rows, and the next forward overwrites its slots); the cache is read whole; every
    token is fed back on the device: no host sync."""
    n = tokens.shape[0]
    inputs = mx.concatenate([tokens.astype(mx.int32), mx.zeros((bucket(n) - n,), mx.int32)])
    start = mx.array(cache.offset, dtype=mx.int32)
    out = decode_at(model, cache, inputs, n - 1, (start, cache.offset), k, sampling, shared, vocab)
    cache.advance(n + k - 1)
    return out


def decode_at(
    model: CausalLM,
    cache: KVCache,
    inputs: mx.array,
    last: int | mx.array,
    at: tuple[mx.array, int],
    k: int,
    sampling: SamplingParams,
    shared: int,
    vocab: int,
) -> tuple[mx.array, mx.array | None]:
    """`decode` of bucket-padded `inputs` (R,) whose last real one is `last`, written from the
    slot `at[0]` (lazy; `at[1]` a host bound on it), so that a chain can be queued before the
    count it starts from is read. The cache's offset is left to the caller."""
    rows = inputs.shape[0]
    sampling = replace(sampling, seed=None)
    span = _reserve(model, cache, at[1] + rows + k)
    codec = cache.codec
    key = ("decode", k, sampling, shared, vocab, codec)
    build = lambda: _decode_fn(model, k, sampling, shared, vocab, span, codec)  # noqa: E731
    fn = compiled(model, key, build, traced=model.traceable, span=span)
    last = mx.array(last, dtype=mx.int32)
    picked, logprobs = cache.take_outputs(fn(at[0], last, inputs[None], *cache.state))
    return picked, None if sampling.greedy else logprobs


def _decode_fn(
    model,
    k: int,
    sampling: SamplingParams,
    shared: int,
    vocab: int,
    span: int,
    codec: KVCodec | None,
) -> Callable:
    def step(start, last, inputs, *arrays):
        view = cache_view(model, arrays, start, span, codec)
        logits = mx.take(model(inputs, view).logits.squeeze(0), last, axis=0)  # the last real row
        picked, rows = [], []
        for i in range(k):
            if i > 0:
                view.start = start + last + i  # the slot after the previous token
                logits = model(picked[-1][None], view).logits[0, 0]
            row = _widened(logits[:shared].astype(mx.float32), vocab)
            token, logprobs = pick(row, sampling)
            picked.append(token.reshape(1))
            rows.append(row if logprobs is None else logprobs)
        return mx.concatenate(picked), mx.stack(rows), *view.state

    return step


def _widened(logits: mx.array, vocab: int) -> mx.array:
    """(shared,) -> (vocab,): ids past the shared range get -inf, so they are never proposed."""
    pad = vocab - logits.shape[-1]
    if pad == 0:
        return logits
    return mx.concatenate([logits, mx.full((pad,), -mx.inf, mx.float32)])


def reachable(model: CausalLM, rows: int) -> list[int]:
    """The DEPTHS a step of `rows` rows fits after within `model`'s context."""
    return [d for d in DEPTHS if d + rows <= model.args.max_position_embeddings]


def build(model: CausalLM, rules: Sequence[AcceptanceRule] = BUILT_RULES) -> None:
    """Builds the verify step's graphs under each of `rules` now, in this thread: chains of
    CHAIN_WIDTHS and, where the cache follows trees, trees of TREE_WIDTHS, at each of DEPTHS
    within the model's context. What a server runs at start-up: on the CPU a request's step
    whose kernels are not built yet compiles them inside the request (seconds each), and a
    graph's kernels at one depth do not serve every other (see DEPTHS)."""
    cache = model.make_cache()
    trees = [Tree.chain(n - 1) for n in CHAIN_WIDTHS]
    if cache.follows_trees:
        trees += [Tree((-1, 0, *range(n - 2))) for n in TREE_WIDTHS]  # two branches
    pending = mx.ones((1,), dtype=mx.int32)
    with synchronous():
        for depth in reachable(model, max(t.num_nodes for t in trees)):
            if depth > cache.offset:  # the prompt's forward, as a prefill's (a quantized
                with prefilling():  # model's wide matmuls dequantize: many times faster)
                    model(mx.zeros((1, depth - cache.offset), dtype=mx.int32), cache)
            mark = cache.checkpoint(depth)
            for rule, tree in itertools.product(rules, trees):
                drafted = mx.ones((tree.num_nodes - 1,), dtype=mx.int32)
                out = verify(model, cache, pending, tree, drafted, None, rule)
                # Evaluated as the decoding loop does, the acceptance first: the kernels MLX
                # fuses for a graph's outputs evaluated apart differ from those for all at once.
                acceptance = out.acceptance
                mx.async_eval(acceptance.tokens, acceptance.num_accepted, acceptance.path)
                mx.eval(out.logits, cache.state)
                if mark is None:
                    cache.truncate(depth)
                else:
                    cache.return_to(mark)
