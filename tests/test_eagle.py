"""EAGLE drafting: the EAGLE-2 tree against a brute-force expansion, lossless greedy decoding on
tiny targets of every family, prefix reuse, and sampling that follows the target."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_speculate import decode as decoding
from mlx_speculate import graphs
from mlx_speculate.cache import KVCache
from mlx_speculate.decode import Decoder
from mlx_speculate.drafters import EagleGrowth, EagleSpec, TargetFeatures, eagle_grow, make_drafter
from mlx_speculate.drafters.eagle import EagleDrafter
from mlx_speculate.generation import Session
from mlx_speculate.policy.adaptive import FixedPolicy
from mlx_speculate.sampling import SamplingParams
from mlx_speculate.sequence import Sequence
from mlx_speculate.tree import Tree

from .helpers import (
    assert_clear_argmax,
    decode,
    greedy_reference,
    leading_tokens,
    random_eagle_head,
    tiny_config,
    tiny_model,
)
from .markov import MarkovLM, StubTokenizer, assert_follows_marginal, assert_markov

GREEDY = SamplingParams()
PROMPT = [1, 5, 9, 33, 7, 2, 60]
FAMILIES = ("llama", "qwen2", "phi3", "qwen3", "gemma3_text", "mistral", "ministral3", "gemma2")
# Seeds whose greedy continuations of PROMPT keep a clear top-2 margin (asserted, not assumed).
TARGET_SEED = {
    "llama": 0,
    "qwen2": 2,
    "phi3": 1,
    "qwen3": 6,
    "gemma3_text": 0,
    "mistral": 4,
    "ministral3": 6,
    "gemma2": 4,
}
DEEP = {"num_hidden_layers": 6}  # EAGLE-3 taps layers 2 and 3 of six (L//2 = L-3 = 3)


def target_and_head(family: str, version: int, seed: int = 5):
    config = tiny_config(family, **DEEP)
    target = tiny_model(family, seed=TARGET_SEED[family], **DEEP)
    taps = (1, 2, 4) if version == 3 else None
    draft_vocab = 50 if version == 3 else None
    head = random_eagle_head(config, version, seed, draft_vocab=draft_vocab, taps=taps)
    return target, head


# The tree: EAGLE-2's expansion, computed the slow way.


def brute_force_tree(drafter: EagleDrafter, context: list[int], settings: EagleGrowth, k: int):
    """EAGLE-2 (SafeAILab `topK_genrate`) with every node's draft state computed by running the
    head sequentially along its own path on a copy of the committed draft cache. Returns the
    kept nodes as (token path from the root's children) in node order."""
    head, target = drafter.head, drafter.target
    fed = drafter._features.fed
    base_keys = [k_[..., :fed, :] for k_ in drafter.cache.keys]
    base_values = [v[..., :fed, :] for v in drafter.cache.values]

    def state(path_tokens):  # the head's output after feeding the node's ancestors' tokens
        cache = KVCache(head.num_layers)
        cache.keys, cache.values = list(base_keys), list(base_values)
        cache.offset = fed
        out = drafter._last
        for token in path_tokens:
            emb = target.model.embed_tokens(mx.array([[token]]))
            out = head(emb, head.feedback(out)[None, None], cache, from_target=False)[0, 0]
        return out

    def best(out, width):
        scores, ids = eagle_grow.best(head, drafter._project, out[None], width)
        return scores[0].tolist(), ids[0].tolist()

    top_k = min(settings.top_k, k)
    scores, ids = best(drafter._last, top_k)
    candidates = [((t,), s) for t, s in zip(ids, scores, strict=True)]  # (path, score)
    frontier = list(candidates)
    for _ in range(min(settings.depth, k - 1)):
        children = []
        for path, score in frontier:
            child_scores, child_ids = best(state(path), top_k)
            children += [
                ((*path, t), score + s) for t, s in zip(child_ids, child_scores, strict=True)
            ]
        candidates += children
        order = np.argsort([-s for _, s in children], kind="stable")[:top_k]
        frontier = [children[i] for i in order]
    ranked = sorted(range(len(candidates)), key=lambda i: (-candidates[i][1], i))[:k]
    return [candidates[i][0] for i in sorted(ranked)]


def tree_paths(draft):
    tokens = [None, *draft.tokens.tolist()]
    tree = draft.tree if isinstance(draft.tree, Tree) else draft.tree.host()  # device-chosen
    return [tuple(tokens[j] for j in tree.path(i)[1:]) for i in range(1, tree.num_nodes)]


@pytest.mark.parametrize("version", [1, 3])
@pytest.mark.parametrize(
    ("settings", "k"),
    [(EagleGrowth(12, 3, 3), 11), (EagleGrowth(60, 7, 4), 20), (EagleGrowth.chain(5), 5)],
)
def test_tree_is_eagle2s_best_nodes(version, settings, k):
    """Trees, and chains (their own path: one row a level, tables built once)."""
    target, head = target_and_head("llama", version)
    drafter = EagleDrafter(head, target, (1, 2, 4) if version == 3 else (), settings)
    out = target(mx.array([PROMPT]), taps=drafter.taps)
    drafter.extend(TargetFeatures(out.hidden[0], tuple(t[0] for t in out.taps)))
    context = [*PROMPT, int(mx.argmax(out.logits[0, -1]).item())]
    draft = drafter.propose(context, k, GREEDY)
    assert draft.tree.num_nodes == k + 1 and draft.logprobs is None
    assert tree_paths(draft) == brute_force_tree(drafter, context, settings, k)


def test_top_k_one_is_a_chain_without_read_back():
    target, head = target_and_head("llama", 1)
    drafter = EagleDrafter(head, target, (), EagleGrowth.chain(5))
    out = target(mx.array([PROMPT]))
    drafter.extend(TargetFeatures(out.hidden[0]))
    draft = drafter.propose([*PROMPT, 3], 5, GREEDY)
    assert draft.tree.is_chain and draft.size == 5
    assert (
        tree_paths(draft)[-1]
        == brute_force_tree(drafter, [*PROMPT, 3], EagleGrowth.chain(5), 5)[-1]
    )


# Greedy EAGLE == plain greedy.


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("version", [1, 3])
@pytest.mark.parametrize("settings", [EagleGrowth(), EagleGrowth(16, 4, 4), EagleGrowth.chain(4)])
def test_greedy_equals_plain(family, version, settings):
    target, head = target_and_head(family, version)
    reference = greedy_reference(target, PROMPT, 40)
    assert_clear_argmax(target, PROMPT, reference)
    spec = EagleSpec(heads=head, tree=settings)
    drafter = make_drafter(spec, target)
    tokens, steps, _ = decode(target, PROMPT, 40, drafter, FixedPolicy(settings.total - 1))
    assert tokens == reference
    assert sum(s.drafted for s in steps) > 0


def test_adaptive_policy_and_stream_generate_with_eagle():
    target, head = target_and_head("qwen2", 3)
    reference = greedy_reference(target, PROMPT, 30)
    assert_clear_argmax(target, PROMPT, reference)
    session = Session(target, StubTokenizer(), make_drafter(EagleSpec(heads=head), target))
    out = [r.token for r in session.stream(PROMPT, sampling=GREEDY, max_tokens=30)]
    assert out == reference


def test_prefix_reuse_keeps_the_draft_state_right():
    """A second prompt sharing a prefix rewinds the head's cache and features: its output
    equals a fresh decoder's, and the drafts it proposes are the fresh decoder's too."""
    target, head = target_and_head("llama", 1)
    spec = EagleSpec(heads=head, tree=EagleGrowth(16, 4, 4))
    first = [*PROMPT, 11, 12, 13]
    second = [*PROMPT, 40, 41]
    reused = Decoder(Sequence(target, make_drafter(spec, target)))
    reused.sequence.prefill(first)
    for _, _ in zip(range(5), reused.steps(GREEDY, FixedPolicy(15)), strict=False):
        pass
    assert reused.sequence.prefill(second) == len(PROMPT)
    fresh = Decoder(Sequence(target, make_drafter(spec, target)))
    fresh.sequence.prefill(second)
    for a, b, _ in zip(
        reused.steps(GREEDY, FixedPolicy(15)),
        fresh.steps(GREEDY, FixedPolicy(15)),
        range(6),
        strict=False,
    ):
        assert a.tokens == b.tokens and a.drafted == b.drafted


def test_misfit_and_missing_heads_are_refused():
    target = tiny_model("llama", **DEEP)
    with pytest.raises(ValueError, match="no EAGLE heads beside the model"):
        make_drafter(EagleSpec(), target)
    narrow = random_eagle_head(tiny_config("llama", hidden_size=32, num_attention_heads=2), 1)
    with pytest.raises(ValueError, match="hidden size 32, the target's is 64"):
        make_drafter(EagleSpec(heads=narrow), target)
    with pytest.raises(ValueError, match="EAGLE tree needs"):
        EagleGrowth(total=1)


# Sampling: tree rejection keeps the target's distribution with EAGLE trees. The target is a
# Markov chain (logits = table[previous token]) whose hidden state is the token's one-hot, so
# the head reads real features and the emitted sequence must follow the table's transitions.

V = 6


TABLE = np.random.default_rng(0).normal(scale=1.5, size=(V, V))
SAMPLED = 2500


@pytest.mark.parametrize("version", [1, 3])
@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.7, top_k=3, seed=4)],
    ids=["plain", "top_k"],
)
def test_sampling_follows_target(version, sampling):
    config = {
        "hidden_size": V, "intermediate_size": 12, "num_attention_heads": 3,
        "num_key_value_heads": 1, "vocab_size": V, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1 << 20, "rope_theta": 10000.0,
    }  # fmt: skip
    head = random_eagle_head(
        config, version, 2, draft_vocab=4 if version == 3 else None,
        taps=(0, 1, 2) if version == 3 else None,
    )  # fmt: skip
    target = MarkovLM(TABLE)
    drafter = EagleDrafter(head, target, (0, 1, 2) if version == 3 else (), EagleGrowth(8, 3, 2))
    tokens, steps, _ = decode(target, [0], SAMPLED, drafter, FixedPolicy(7), sampling)
    # Both outcomes are exercised: accepted nodes, and rejected siblings / whole levels.
    assert sum(s.accepted for s in steps) > 200
    assert sum(s.accepted < s.drafted for s in steps) > 200
    assert_markov([0, *tokens], TABLE, sampling)


# Fused steps: the verify graph runs the head over the accepted path and grows the next tree.


@pytest.mark.parametrize(
    "settings", [EagleGrowth(16, 4, 4), EagleGrowth.chain(3)], ids=["tree", "k3"]
)
def test_a_step_is_one_compiled_graph_and_one_sync(monkeypatch, settings):
    """After the first proposal, no step calls the head's own growth graph: the catch-up and
    the next tree are traced into the verify graph, one per (tree, span), and each step reads
    the host once. Greedy output stays plain greedy's."""
    target, head = target_and_head("llama", 3)
    graphs._COMPILED.pop(id(target), None)
    reference = greedy_reference(target, PROMPT, 30)
    drafter = EagleDrafter(head, target, (1, 2, 4), settings)
    grows = []
    original = drafter._grow
    monkeypatch.setattr(drafter, "_grow", lambda k: grows.append(k) or original(k))
    decoder = Decoder(Sequence(target, drafter))
    decoder.sequence.prefill(PROMPT)
    syncs = []
    evaluate = mx.eval
    # Reads of step results (a graph's first trace also evaluates the weights it captures).
    read = lambda *a: syncs.append(all(isinstance(x, mx.array) for x in a)) or evaluate(*a)  # noqa: E731
    monkeypatch.setattr(mx, "eval", read)
    tokens, steps = [], []
    for s in decoder.steps(GREEDY, FixedPolicy(settings.total - 1)):
        tokens.extend(s.tokens)
        steps.append(s)
        if len(tokens) >= 30:
            break
    assert tokens[:30] == reference
    assert len(grows) == 1
    assert sum(syncs) == len(steps)
    # A graph's key ends with the head's part (its own span last), then the target's span.
    fused = [key for key in graphs._COMPILED[id(target)] if key[-2][:2] == ("eagle", id(head))]
    spans = {(key[-1], key[-2][-1]) for key in fused}  # (the target's span, the head's)
    # Both span 64 then 96; a step queued on the last one's count (a host bound on its
    # root) reaches the target's next span a step early.
    assert len(spans) == len(fused) <= 3 and {s for pair in spans for s in pair} <= {64, 96}


@pytest.mark.parametrize(
    "settings", [EagleGrowth(16, 4, 4), EagleGrowth.chain(3)], ids=["tree", "k3"]
)
def test_a_step_queued_on_the_last_count_drafts_as_after_the_read(monkeypatch, settings):
    """A fused step queued before the last one is read (`follow`: its root slot and the
    head's path start lazy in that count) drafts the very tokens a step proposed after the
    read does, step for step, and the output is plain greedy's."""
    target, head = target_and_head("llama", 3)
    reference = greedy_reference(target, PROMPT, 40)
    verify = decoding.verify

    def drafts(follows: bool) -> tuple[list, int]:
        """The draft tokens of every verify, and how many steps were queued by `follow`."""
        drafter, verified, followed = EagleDrafter(head, target, (1, 2, 4), settings), [], []
        follow = drafter.follow if follows else lambda *args: None
        monkeypatch.setattr(drafter, "follow", lambda *a: followed.append(d := follow(*a)) or d)
        monkeypatch.setattr(
            decoding, "verify", lambda *a, **k: verified.append(a[4]) or verify(*a, **k)
        )
        tokens, _, _ = decode(target, PROMPT, 40, drafter, FixedPolicy(settings.total - 1))
        assert tokens == reference
        queued = len(followed) - followed.count(None)
        return [None if d is None else d.tolist() for d in verified], queued

    queued, followed = drafts(True)
    read_first, _ = drafts(False)
    assert followed >= len(queued) // 3
    # The followed run queued one more step before the last was read, which ended it.
    assert queued[: len(read_first)] == read_first


def test_fused_sampling_follows_the_target():
    """Fused tree steps on a compiled target stay lossless when sampling: the third token's
    frequencies over many seeded generations match the target's exact marginal. It comes
    from the first verify step or from the one queued on its lazy count (`follow`), whose
    tree was grown inside the first from the path it accepted, and whose root slot and
    path start wait on that count."""
    vocab, prompt, temperature = 13, [1, 5, 9], 0.5
    config = tiny_config("llama", vocab_size=vocab)
    target = tiny_model("llama", seed=0, vocab_size=vocab)
    head = random_eagle_head(config, 1, 3)
    followed = []

    class Counting(EagleDrafter):
        def follow(self, *args):
            draft = super().follow(*args)
            followed.append(draft is not None)
            return draft

    decoder = Decoder(Sequence(target, Counting(head, target, (), EagleGrowth(4, 1, 2))))
    sampling = SamplingParams(temperature=temperature)
    mx.random.seed(0)
    n, thirds = 1500, []
    for _ in range(n):
        thirds.append(leading_tokens(decoder, prompt, sampling, FixedPolicy(3), 3, 16)[2])
    assert sum(followed) > 0.9 * n  # the second verify step was queued on the first's count
    assert_follows_marginal(target, prompt, temperature, 2, thirds)
