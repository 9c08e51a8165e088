"""Compiled fixed-shape steps: row buckets, padded trees equal unpadded ones, one graph reused
across offsets, seeded sampling, and draft rows as long as the padded tree."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_speculate import graphs, step
from mlx_speculate.decode import Decoder
from mlx_speculate.drafters.draft_model import DraftModelDrafter
from mlx_speculate.policy.adaptive import FixedPolicy
from mlx_speculate.sampling import SamplingParams, log_probs
from mlx_speculate.sequence import Sequence
from mlx_speculate.tree import Tree
from mlx_speculate.verify import AcceptanceRule, greedy_accept, rejection_accept

from .gemma4_models import tiny_gemma4
from .helpers import decode, greedy_reference, leading_tokens, tiny_model
from .markov import assert_follows_marginal, chi_square_limit

GREEDY = AcceptanceRule(SamplingParams())

PARENTS = (-1, 0, 0, 1, 1, 2)  # 6 nodes: padded to 8 rows


def test_buckets():
    assert [step.bucket(n) for n in (1, 2, 3, 5, 9, 33, 64, 65, 130)] == [
        1, 2, 4, 8, 12, 48, 64, 128, 192,
    ]  # fmt: skip


def test_short_chains_verify_unpadded():
    """A chain of at most EXACT_CHAIN nodes runs its own row count; longer ones and trees
    (host or device-chosen) pad to their bucket."""
    assert [step.verify_rows(Tree.chain(k)) for k in (0, 1, 4, 7, 8, 12)] == [1, 2, 5, 8, 12, 16]
    assert step.verify_rows(Tree(PARENTS)) == 8


@pytest.mark.parametrize("parents", [PARENTS, Tree.chain(5).parents], ids=["tree", "chain"])
def test_padded_verify_equals_the_eager_forward_and_rule(parents):
    """The compiled step over a padded tree gives the unpadded forward's logits on the real
    rows and the same acceptance; the cache advances by the real node count."""
    tree = Tree(parents)
    model = tiny_model("llama", seed=3)
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 97, 9).tolist()
    nodes = rng.integers(0, 97, tree.num_nodes).tolist()
    eager, compiled = model.make_cache(), model.make_cache()
    for cache in (eager, compiled):
        model(mx.array([prefix]), cache)
    offset = eager.offset
    positions = None if tree.is_chain else tree.positions(offset)
    mask = None if tree.is_chain else tree.attention_mask(offset)
    logits = model(mx.array([nodes]), eager, positions=positions, mask=mask).logits[0]
    # Drafts equal to the argmax along node 1's line, so that something is accepted.
    best = np.array(mx.argmax(logits, axis=-1))
    drafts = [int(best[tree.parents[i]]) if i in (1, 3) else nodes[i] for i in range(1, len(nodes))]
    eager.truncate(offset)
    inputs = mx.array([[nodes[0], *drafts]])
    logits = model(inputs, eager, positions=positions, mask=mask).logits[0]
    want = greedy_accept(tree, mx.array(drafts), logits)
    got = step.verify(
        model, compiled, mx.array(nodes[:1]), tree, mx.array(drafts), None, GREEDY
    )
    n = tree.num_nodes
    assert got.logits.shape[0] == step.verify_rows(tree) == (n if tree.is_chain else 8)
    np.testing.assert_allclose(np.array(got.logits[:n]), np.array(logits), rtol=1e-4, atol=1e-5)
    assert got.acceptance.num_accepted.item() == want.num_accepted.item() >= 1
    accepted = want.num_accepted.item() + 1
    assert got.acceptance.path[:accepted].tolist() == want.path[:accepted].tolist()
    assert got.acceptance.tokens[:accepted].tolist() == want.tokens[:accepted].tolist()
    assert compiled.offset == offset + n


def test_padding_nodes_are_never_accepted():
    """A padded tree whose padding rows would match the target (token 0 everywhere is the
    argmax) still accepts no padding node: their draft token is -1."""
    tree = Tree.chain(2)
    padded = tree.padded(8)
    logits = mx.zeros((8, 5)).at[:, 0].add(1.0)  # argmax 0 at every row
    drafts = mx.array([0, 0, -1, -1, -1, -1, -1])
    assert greedy_accept(padded, drafts, logits).num_accepted.item() == 2
    sampled = rejection_accept(padded, drafts, log_probs(logits, SamplingParams(temperature=1)))
    assert sampled.num_accepted.item() <= 2


def test_one_graph_serves_every_offset():
    """Plain greedy steps at 40 offsets trace the verify graph once (plus the decode graph
    of nothing: plain decoding has no drafter)."""
    model = tiny_model("llama", seed=0)
    graphs._COMPILED.pop(id(model), None)
    decode(model, [1, 5, 9], 40)
    assert len(graphs._COMPILED[id(model)]) == 1


def test_lazy_weights_are_computed_once():
    """A weight still lazy when a step is compiled (random, cast or quantized in memory) is
    evaluated first, not computed again inside every call: a random same-size draft model
    took seconds per proposal when each call regenerated its weights."""
    model = tiny_model("llama", seed=0)
    noise = mx.random.normal((2048, 2048), key=mx.random.key(0))  # 16 MB, lazy
    weight = model.model.layers[0].mlp.down_proj.weight
    model.model.layers[0].mlp.down_proj.weight = weight + 0 * noise.sum()
    cache = model.make_cache()
    model(mx.array([[1, 5, 9]]), cache)
    for _ in range(2):
        mx.eval(step.decode(model, cache, mx.array([9]), 3, SamplingParams(), 97, 97)[0])
        cache.truncate(3)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(step.decode(model, cache, mx.array([9]), 3, SamplingParams(), 97, 97)[0])
    assert mx.get_peak_memory() - before < 4 * 2**20


def test_drafts_of_nearby_sizes_share_a_graph():
    """Chains past `EXACT_CHAIN` rows (9 to 11 drafts: one row bucket) share one verify graph,
    and so do trees of one bucket whose depth and width round up to the same powers of two:
    the adaptive policy and lookup trees vary both, and each trace costs several steps."""
    model = tiny_model("llama", seed=0)
    graphs._COMPILED.pop(id(model), None)
    cache = model.make_cache()
    model(mx.array([[1, 5, 9]]), cache)
    trees = [Tree.chain(k) for k in (9, 10, 11)]
    trees += [Tree((-1, 0, 1, 2, 0)), Tree((-1, 0, 1, 2, 3, 0)), Tree((-1, 0, 1, 0, 3, 4))]
    for tree in trees:
        drafts = mx.ones((tree.num_nodes - 1,), mx.int32)
        out = step.verify(model, cache, mx.array([9]), tree, drafts, None, GREEDY)
        mx.eval(out.acceptance.tokens)
        cache.truncate(3)
    assert len(graphs._COMPILED[id(model)]) == 2


def test_steps_across_attention_spans_equal_plain_decoding():
    """Draft-model steps from slot 3 to past 256 cross the spans 64, 96, 128, 192, 256 and 384
    (attention reads only the leading span of the 256-slot cache, then of 512): each span
    traces its own graphs and the tokens stay those of one-token eager forwards."""
    model = tiny_model("llama", seed=0, max_position_embeddings=1024)
    draft = tiny_model("llama", seed=7, num_hidden_layers=1, max_position_embeddings=1024)
    graphs._COMPILED.pop(id(model), None)
    tokens, _, decoder = decode(model, [1, 5, 9], 270, DraftModelDrafter(draft, 97), FixedPolicy(3))
    assert tokens == greedy_reference(model, [1, 5, 9], 270)
    spans = {key[-1] for key in graphs._COMPILED[id(model)]}
    assert spans == {64, 96, 128, 192, 256, 384}
    assert decoder.sequence.cache.capacity == 512


def test_seeded_sampling_repeats():
    """The random state goes through the compiled graphs: one seed, one output."""
    model = tiny_model("llama", seed=0)
    draft = tiny_model("llama", seed=7, num_hidden_layers=1)
    sampling = SamplingParams(temperature=1.0, seed=11)
    runs = [
        decode(model, [1, 5, 9], 30, DraftModelDrafter(draft, 97), FixedPolicy(3), sampling)[0]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    other = SamplingParams(temperature=1.0, seed=12)
    assert decode(model, [1, 5, 9], 30, None, None, other)[0] != runs[0]


def test_draft_rows_of_a_cut_chain():
    """A sampled draft cut to the room left keeps a row per kept node (N rows, not N - 1),
    which the padded step takes; the first emitted token still follows the target."""
    model = tiny_model("llama", seed=0)
    cache = model.make_cache()
    model(mx.array([[1, 5, 9]]), cache)
    offset = cache.offset
    sampling = SamplingParams(temperature=1.0)
    tree = Tree.chain(1)  # padded to 2 rows; q has 2 rows
    q = log_probs(mx.random.normal((2, 97), key=mx.random.key(1)), sampling)
    target = mx.softmax(model(mx.array([[1, 5, 9, 9]])).logits[0, -1])
    mx.random.seed(0)
    n = 1500
    firsts = []
    for _ in range(n):
        cache.truncate(offset)
        draft = mx.random.categorical(q[0])[None].astype(mx.int32)
        result = step.verify(model, cache, mx.array([9]), tree, draft, q, AcceptanceRule(sampling))
        firsts.append(result.acceptance.tokens[0].item())
    observed = np.bincount(firsts, minlength=97)
    expected = n * np.array(target, dtype=np.float64)
    statistic = float(((observed - expected) ** 2 / expected).sum())
    assert statistic < chi_square_limit(96)


@pytest.mark.parametrize("fed", [1, 3])
def test_chained_draft_equals_eager_greedy_steps(fed):
    """k draft tokens from one compiled graph (each fed back on the device) are the eager
    one-token-at-a-time argmaxes; the cache holds every fed token (not the last draft), and a
    second chain from there goes on exactly as the eager decoding does."""
    model = tiny_model("llama", seed=5)
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, 97, 7).tolist()
    eager, compiled = model.make_cache(), model.make_cache()
    for cache in (eager, compiled):
        model(mx.array([prefix[:-fed]]), cache)
    inputs, expected = prefix[-fed:], []
    for _ in range(9):
        inputs = [int(mx.argmax(model(mx.array([inputs]), eager).logits[0, -1]).item())]
        expected.append(inputs[0])
    first, q = step.decode(model, compiled, mx.array(prefix[-fed:]), 4, SamplingParams(), 97, 97)
    assert q is None and first.tolist() == expected[:4]
    assert compiled.offset == len(prefix) + 3
    second, _ = step.decode(model, compiled, first[-1:], 5, SamplingParams(), 97, 97)
    assert second.tolist() == expected[4:]


def test_followed_chains_sample_the_target():
    """Chains queued on the last step's lazy count (`_Queue.follow`) stay lossless when
    sampling: the fourth token's frequencies over many seeded generations match the target's
    exact marginal. The first token comes from the prompt's forward; with k = 1 the fourth
    comes from the first verify step or from a followed one, whose pending token and draft
    depend on how many the step before accepted."""
    vocab, prompt, temperature = 13, [1, 5, 9], 0.25
    target = tiny_model("llama", seed=0, vocab_size=vocab)
    draft = tiny_model("llama", seed=7, num_hidden_layers=1, vocab_size=vocab)
    sampling = SamplingParams(temperature=temperature)
    settled = []

    class Counting(DraftModelDrafter):
        def settle(self, accepted: int) -> None:
            settled.append(accepted)  # a followed chain's step was read
            super().settle(accepted)

    decoder = Decoder(Sequence(target, Counting(draft, vocab)))
    mx.random.seed(0)
    n, fourths = 2000, []
    for _ in range(n):
        fourths.append(leading_tokens(decoder, prompt, sampling, FixedPolicy(1), 4)[3])
    assert sum(a > 0 for a in settled) > 0.2 * n  # followed steps after an accepted draft
    assert_follows_marginal(target, prompt, temperature, 3, fourths)


def test_a_call_with_new_input_shapes_counts_as_a_trace():
    """mx.compile traces a function again when an input's shape changes (a cache's storage
    grew), which costs what a first call does: `built()` counts both."""
    model = tiny_model("llama", seed=0)
    fn = graphs.compiled(model, ("shapes",), lambda: lambda x: (x + 1,))
    before = graphs.built()
    fn(mx.zeros((2,)))
    fn(mx.ones((2,)))
    assert graphs.built() == before + 1
    fn(mx.zeros((3,)))
    assert graphs.built() == before + 2


def test_a_step_that_traced_a_graph_prices_nothing():
    """A step during which a graph was built (a new size or attention span: its first call
    traces it) says so, and the policy sees no time for it: a trace costs many steps, and a
    size tried rarely would be priced by it. Steps that reuse their graphs are timed."""
    model = tiny_model("llama", seed=0, max_position_embeddings=1024)
    draft = tiny_model("llama", seed=7, num_hidden_layers=1, max_position_embeddings=1024)
    graphs._COMPILED.pop(id(model), None)
    graphs._COMPILED.pop(id(draft), None)

    class Recorder(FixedPolicy):
        def observe(self, drafted, accepted, seconds):
            observed.append(seconds)

    observed = []
    decoder = Decoder(Sequence(model, DraftModelDrafter(draft, model.args.vocab_size)))
    decoder.sequence.prefill(list(range(1, 9)))
    steps = []
    for s in decoder.steps(SamplingParams(), Recorder(3), max_tokens=90):
        before = graphs.built()
        steps.append(s)
        assert graphs.built() == before  # reading a step builds nothing
    verified = [s for s in steps if s.verified]
    assert verified[0].traced  # the first step traced its graphs
    assert any(s.traced for s in verified[1:])  # a later attention span traced another
    assert sum(not s.traced for s in verified) > len(verified) // 2
    assert observed == [0.0 if s.traced else s.seconds for s in verified]
    assert all(s.seconds > 0 for s in verified)


def test_compiled_graphs_read_the_weights_as_inputs():
    """A compiled graph takes a model's weights as inputs where one is a scalar: a graph inlines
    its scalar constants, so Gemma 4's per-layer `layer_scalar` made a kernel per layer, each
    compiled by the backend's JIT on a model's first request. A weight set after the first
    call (here a layer's scalar) is what the next call reads, and no trace is added."""
    model = tiny_gemma4(seed=0)
    fn = graphs.compiled(model, ("weights",), lambda: lambda x: (model(x).logits,))
    tokens = mx.array([[1, 5, 9]])
    first = fn(tokens)[0]
    before = graphs.built()
    layer = model.model.layers[0]
    layer.layer_scalar = 2 * layer.layer_scalar
    want = model(tokens).logits
    got = fn(tokens)[0]
    assert graphs.built() == before
    assert not mx.allclose(first, want).item()
    assert mx.allclose(got, want, atol=1e-5).item()
