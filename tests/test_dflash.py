"""DFlash block drafters: the block against z-lab's math written out plainly, DDTree trees
against a brute-force beam, lossless greedy decoding (chains and trees) on tiny targets,
prefix reuse, sampling that follows the target, z-lab's checkpoint layout, and one-line
errors for drafters that do not fit."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_speculate.decode import Decoder
from mlx_speculate.drafters import DFlashSpec, TargetFeatures, make_drafter, spec_from_keywords
from mlx_speculate.drafters import dflash as dflash_module
from mlx_speculate.drafters.base import FusedDrafter
from mlx_speculate.drafters.dflash import DFlashDrafter
from mlx_speculate.generate import main
from mlx_speculate.generation import Session
from mlx_speculate.graphs import compiled
from mlx_speculate.heads.dflash import DFlashConfig, DFlashHead, default_layer_ids
from mlx_speculate.heads.dflash_format import load_dflash, save_dflash
from mlx_speculate.loading import load
from mlx_speculate.policy.adaptive import FixedPolicy
from mlx_speculate.sampling import SamplingParams
from mlx_speculate.sequence import Sequence
from mlx_speculate.train.objectives import dflash_anchors
from mlx_speculate.tree import Tree

from .helpers import (
    MODELS,
    assert_clear_argmax,
    decode,
    greedy_reference,
    leading_tokens,
    tiny_config,
    tiny_model,
)
from .markov import MarkovLM, assert_follows_marginal, assert_markov

GREEDY = SamplingParams()
PROMPT = [1, 5, 9, 33, 7, 2, 60]
DEEP = {"num_hidden_layers": 6}
# Seeds whose greedy continuations of PROMPT keep a clear top-2 margin (asserted, not assumed).
TARGET_SEED = {
    "llama": 0,
    "qwen2": 2,
    "qwen3": 6,
    "gemma3_text": 0,
    "mistral": 4,
    "ministral3": 6,
    "gemma2": 4,
}


def dflash_config(target: dict, block: int = 5, ids=(1, 3), layers: int = 2, **layer):
    sizes = (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "vocab_size", "rms_norm_eps", "max_position_embeddings", "rope_theta",
    )  # fmt: skip
    settings = {k: target[k] for k in sizes if k in target}
    settings |= {"num_hidden_layers": layers, "head_dim": 16} | layer
    return DFlashConfig(
        layer=settings,
        block_size=block,
        target_layer_ids=tuple(ids),
        mask_token_id=target["vocab_size"] - 1,
        num_target_layers=target["num_hidden_layers"],
    )


def random_head(config: DFlashConfig, seed: int = 1) -> DFlashHead:
    """Random float32 weights; q/k get a larger scale so attention is far from uniform."""
    head = DFlashHead(config)
    params = tree_flatten(head.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    weights = {}
    for key, (name, value) in zip(keys, params, strict=True):
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * mx.random.normal(value.shape, key=key)
        elif "q_proj" in name or "k_proj" in name:
            weights[name] = 0.4 * mx.random.normal(value.shape, key=key)
        else:
            weights[name] = 0.2 * mx.random.normal(value.shape, key=key)
    head.load_weights(list(weights.items()))
    mx.eval(head.parameters())
    return head


def target_and_head(family: str = "llama", seed: int = 1, **settings):
    config = tiny_config(family, **DEEP)
    target = tiny_model(family, seed=TARGET_SEED[family], **DEEP)
    return target, random_head(dflash_config(config, **settings), seed)


# The block: z-lab's DFlashDraftModel written out plainly, with no cache.


def rotate(x: mx.array, positions: mx.array, theta: float) -> mx.array:
    """HF rotate-half RoPE of (B, H, L, D) at `positions` (L,)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (mx.arange(0, d, 2, dtype=mx.float32) / d)
    angles = positions.astype(mx.float32)[:, None] * inv[None]  # (L, D/2)
    cos, sin = mx.cos(mx.concatenate([angles] * 2, -1)), mx.sin(mx.concatenate([angles] * 2, -1))
    half = mx.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * cos + half * sin


def reference_logits(head: DFlashHead, target, context: list[int]) -> mx.array:
    """(B - 1, V) the block's logits after `context` (its last token pending): the target's
    layer outputs of every committed position, fc + hidden_norm, then each layer's queries
    from the block, keys and values from the context rows and the block, no mask."""
    config, args = head.config, head.args
    committed, block = len(context) - 1, config.block_size
    out = target(mx.array([context[:-1]]), taps=tuple(i + 1 for i in config.target_layer_ids))
    rows = head.hidden_norm(head.fc(mx.concatenate(list(out.taps), axis=-1)))  # (1, c, h)
    x = target.model.embed_tokens(mx.array([[context[-1]] + [config.mask_token_id] * (block - 1)]))
    positions = mx.arange(committed + block)
    theta = args.rope_theta
    for layer in head.layers:
        attn = layer.self_attn
        normed = layer.input_layernorm(x)
        both = mx.concatenate([rows, normed], axis=1)  # (1, c + B, h)
        n, kv, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
        q = attn.q_norm(attn.q_proj(normed).reshape(1, block, n, d)).transpose(0, 2, 1, 3)
        k = attn.k_norm(attn.k_proj(both).reshape(1, -1, kv, d)).transpose(0, 2, 1, 3)
        v = attn.v_proj(both).reshape(1, -1, kv, d).transpose(0, 2, 1, 3)
        q, k = rotate(q, positions[committed:], theta), rotate(k, positions, theta)
        k, v = mx.repeat(k, n // kv, axis=1), mx.repeat(v, n // kv, axis=1)
        weights = mx.softmax((q @ k.transpose(0, 1, 3, 2)) * d**-0.5, axis=-1)
        x = x + attn.o_proj((weights @ v).transpose(0, 2, 1, 3).reshape(1, block, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return target.project(head.norm(x))[0, 1:]


UNFILTERED = SamplingParams(temperature=1.0)


def drafted_rows(drafter: DFlashDrafter, context: list[int]) -> mx.array:
    """The drafter's (B - 1, V) log-probabilities of a sampled chain after `context`."""
    draft = drafter.propose(context, drafter.block - 1, UNFILTERED)
    assert draft.tree.is_chain and draft.logprobs.shape[0] == drafter.block - 1
    return draft.logprobs


def assert_rows_close(ours: mx.array, logits: mx.array) -> None:
    expected = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    assert mx.max(mx.abs(ours - expected)).item() < 1e-4 * max(1.0, mx.max(mx.abs(expected)).item())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_block_is_zlabs_forward_at_every_step(family):
    """After the prompt and after each verify step (extends, rewinds, reused cache slots),
    a block's distributions are the plain forward's over the whole context."""
    target, head = target_and_head(family)
    drafter = DFlashDrafter(head, target, 1)
    decoder = Decoder(Sequence(target, drafter))
    decoder.sequence.prefill(PROMPT)
    steps = decoder.steps(GREEDY, FixedPolicy(3))
    for _ in range(6):
        next(steps)
        context = list(decoder.sequence.context)
        assert_rows_close(drafted_rows(drafter, context), reference_logits(head, target, context))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_training_blocks_are_zlabs_blocks(family):
    """Training's forward (blocks side by side over one conversation's context rows, no
    cache) gives each block the distributions z-lab's forward gives it after the context
    before its anchor: the objective trains the blocks the drafter drafts."""
    target, head = target_and_head(family)
    tokens = [*PROMPT, 3, 11, 4, 8, 20, 17, 5, 40]
    anchors = mx.array([1, 4, 7, 9, 13], dtype=mx.int32)  # the last block runs off the end
    S, T = head.config.block_size, len(tokens)
    out = target(mx.array([tokens]), taps=head.config.taps)
    rows = head.context(mx.concatenate(list(out.taps), axis=-1))  # (1, T, h)
    positions = (anchors[:, None] + mx.arange(S))[None]  # (1, A, S)
    inputs = mx.full(positions.shape, head.config.mask_token_id, dtype=mx.int32)
    inputs[..., 0] = mx.array(tokens)[anchors]
    visible = (mx.arange(T)[None, :] < anchors[:, None])[None]  # (1, A, T)
    A = anchors.shape[0]
    embeds = target.model.embed_tokens(inputs.reshape(1, A * S))
    hidden = head.blocks(embeds, rows, positions.reshape(1, A * S), visible)
    logits = target.project(hidden).reshape(A, S, -1)[:, 1:]
    for j, a in enumerate(anchors.tolist()):
        expected = reference_logits(head, target, tokens[: a + 1])
        ours = logits[j] - mx.logsumexp(logits[j], axis=-1, keepdims=True)
        assert_rows_close(ours, expected)


def test_training_anchors_are_distinct_answer_tokens():
    """Anchors fall on answer tokens followed by another, each at most once a draw; a row
    with fewer such tokens than blocks marks the rest as none; draws differ by key and the
    held-out draw (no key) is fixed."""
    answer = mx.zeros((3, 32), dtype=mx.uint8)
    answer[0, 5:30] = 1  # 24 candidates
    answer[1, 10:14] = 1  # 3 candidates: 10, 11, 12
    answer[2, 0:32] = 1  # 31 candidates (the last token has none after it)
    anchors, keep = dflash_anchors(answer, 8, mx.random.key(3))
    for row, allowed in enumerate((range(5, 29), range(10, 13), range(0, 31))):
        chosen = np.array(anchors[row])[np.array(keep[row])].tolist()
        assert len(chosen) == min(8, len(allowed)) == len(set(chosen))
        assert set(chosen) <= set(allowed)
    other, _ = dflash_anchors(answer, 8, mx.random.key(4))
    assert not mx.array_equal(anchors, other)
    fixed = [dflash_anchors(answer, 8, None)[0] for _ in range(2)]
    assert mx.array_equal(*fixed)


def primed(drafter: DFlashDrafter, target) -> list[int]:
    """The drafter after PROMPT's features; the context with 3 pending."""
    out = target(mx.array([PROMPT]), taps=drafter.taps)
    drafter.extend(TargetFeatures(out.hidden[0], tuple(t[0] for t in out.taps)))
    return [*PROMPT, 3]


def test_greedy_chain_is_each_positions_argmax():
    target, head = target_and_head()
    drafter = DFlashDrafter(head, target, 1)
    context = primed(drafter, target)
    draft = drafter.propose(context, 3, GREEDY)
    assert draft.tree == Tree.chain(3) and draft.logprobs is None
    expected = mx.argmax(reference_logits(head, target, context), axis=-1)[:3]
    assert draft.tokens.tolist() == expected.tolist()


# DDTree: the best nodes of the product tree of per-position top-k tokens.


def brute_force_tree(logits: mx.array, top_k: int, k: int) -> list[tuple[int, ...]]:
    """The beam the drafter runs, on the host: every level's candidates are the top_k best
    nodes of the level above times the position's top_k tokens; the best k of all candidates
    (ties to the earlier), as token paths in candidate order."""
    scores = np.asarray(logits - mx.logsumexp(logits, axis=-1, keepdims=True), np.float64)
    depth = min(scores.shape[0], k)
    ranked = [np.argsort(-scores[d], kind="stable")[:top_k] for d in range(depth)]
    candidates = [((int(t),), scores[0][t]) for t in ranked[0]]
    frontier = list(candidates)
    for d in range(1, depth):
        children = [(p + (int(t),), s + scores[d][t]) for p, s in frontier for t in ranked[d]]
        candidates += children
        order = np.argsort([-s for _, s in children], kind="stable")[:top_k]
        frontier = [children[i] for i in order]
    best = sorted(range(len(candidates)), key=lambda i: (-candidates[i][1], i))[:k]
    return [candidates[i][0] for i in sorted(best)]


def tree_paths(draft) -> list[tuple[int, ...]]:
    tokens = [None, *draft.tokens.tolist()]
    tree = draft.tree if isinstance(draft.tree, Tree) else draft.tree.host()
    return [tuple(tokens[j] for j in tree.path(i)[1:]) for i in range(1, tree.num_nodes)]


@pytest.mark.parametrize(("top_k", "k"), [(2, 3), (3, 10), (4, 20), (2, 14)])
def test_tree_is_the_beams_best_nodes(top_k, k):
    target, head = target_and_head(block=6)
    drafter = DFlashDrafter(head, target, top_k)
    context = primed(drafter, target)
    draft = drafter.propose(context, k, GREEDY)
    assert draft.tree.num_nodes == k + 1 and draft.logprobs is None
    expected = brute_force_tree(reference_logits(head, target, context), top_k, k)
    assert tree_paths(draft) == expected


# Greedy DFlash == plain greedy.


@pytest.mark.parametrize("family", list(TARGET_SEED))
@pytest.mark.parametrize(("top_k", "k"), [(1, 4), (1, 2), (3, 12), (2, 30)])
def test_greedy_equals_plain(family, top_k, k):
    target, head = target_and_head(family)
    reference = greedy_reference(target, PROMPT, 40)
    assert_clear_argmax(target, PROMPT, reference)
    drafter = make_drafter(DFlashSpec(drafter=head, top_k=top_k), target)
    tokens, steps, _ = decode(target, PROMPT, 40, drafter, FixedPolicy(k))
    assert tokens == reference
    assert sum(s.drafted for s in steps) >= 10 * min(k, drafter.max_draft)


def small_vocabulary():
    """A 13-token target, where random drafts are often right, a random block-4 drafter for
    it, a prompt and the target's next 60 greedy tokens (a clear argmax each)."""
    config = tiny_config("llama", vocab_size=13, **DEEP)
    target = tiny_model("llama", seed=0, vocab_size=13, **DEEP)
    head = random_head(dflash_config(config, block=4), 1)
    prompt = [1, 5, 9]
    reference = greedy_reference(target, prompt, 60)
    assert_clear_argmax(target, prompt, reference)
    return target, head, prompt, reference


def test_greedy_accepts_drafts_on_a_small_vocabulary():
    """A 13-token target, where random drafts are often right: accepted chains and tree
    paths commit as plain decoding would."""
    target, head, prompt, reference = small_vocabulary()
    for top_k, k, accepted in ((1, 3, 1), (3, 9, 10)):
        drafter = make_drafter(DFlashSpec(drafter=head, top_k=top_k), target)
        tokens, steps, _ = decode(target, prompt, 60, drafter, FixedPolicy(k))
        assert tokens == reference
        assert sum(s.accepted for s in steps) >= accepted


class CyclingPolicy(FixedPolicy):
    """Draft lengths `ks` in turn, each for `every` steps."""

    def __init__(self, ks: tuple[int, ...], every: int):
        super().__init__(ks[0])
        self.ks, self.every, self.steps = ks, every, 0

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        self.steps += 1
        self.k = self.ks[self.steps // self.every % len(self.ks)]


@pytest.mark.parametrize(("top_k", "ks", "accepted"), [(1, (3, 2), 1), (3, (9, 6), 5)])
def test_steps_after_the_first_are_fused(monkeypatch, top_k, ks, accepted):
    """On a compiled target each verify step's graph drafts the next block: the drafter runs
    a graph of its own only for the first step and when a tree's size changes (a chain is
    cut to any length), and the output stays plain greedy's."""
    target, head, prompt, reference = small_vocabulary()
    drafter = make_drafter(DFlashSpec(drafter=head, top_k=top_k), target)
    assert isinstance(drafter, FusedDrafter)
    own_graphs = []
    counted = lambda *args, **kw: own_graphs.append(args[1]) or compiled(*args, **kw)  # noqa: E731
    monkeypatch.setattr(dflash_module, "compiled", counted)
    tokens, steps, _ = decode(target, prompt, 60, drafter, CyclingPolicy(ks, every=5))
    assert tokens == reference
    assert len(steps) > 12 and sum(s.accepted for s in steps) >= accepted
    # the first token, then a step drafted by `propose`, then fused ones; a tree of a new
    # size (every fifth step) is drafted by `propose` once more
    changes = 0 if top_k == 1 else -(-len(steps) // 5)
    assert 1 <= len(own_graphs) <= 1 + changes


def test_adaptive_policy_and_stream_generate_with_dflash():
    from .markov import StubTokenizer

    target, head = target_and_head("qwen2")
    reference = greedy_reference(target, PROMPT, 30)
    assert_clear_argmax(target, PROMPT, reference)
    session = Session(target, StubTokenizer(), make_drafter(DFlashSpec(drafter=head), target))
    out = [r.token for r in session.stream(PROMPT, sampling=GREEDY, max_tokens=30)]
    assert out == reference


def test_prefix_reuse_keeps_the_draft_state_right():
    """A second prompt sharing a prefix rewinds the drafter's cache and features: it drafts
    what a fresh drafter drafts, step for step."""
    target, head = target_and_head()
    spec = DFlashSpec(drafter=head, top_k=2)
    first, second = [*PROMPT, 11, 12, 13], [*PROMPT, 40, 41]
    reused = Decoder(Sequence(target, make_drafter(spec, target)))
    reused.sequence.prefill(first)
    for _, _ in zip(range(5), reused.steps(GREEDY, FixedPolicy(6)), strict=False):
        pass
    assert reused.sequence.prefill(second) == len(PROMPT)
    fresh = Decoder(Sequence(target, make_drafter(spec, target)))
    fresh.sequence.prefill(second)
    for a, b, _ in zip(
        reused.steps(GREEDY, FixedPolicy(6)),
        fresh.steps(GREEDY, FixedPolicy(6)),
        range(6),
        strict=False,
    ):
        assert a.tokens == b.tokens and a.drafted == b.drafted


# Sampling: sampled chains (rejection sampling with the drafts' rows) and deterministic trees
# keep the target's distribution. The Markov target's features are one-hots of the tokens.

V = 6
TABLE = np.random.default_rng(0).normal(scale=1.5, size=(V, V))
MARKOV = {
    "hidden_size": V, "intermediate_size": 12, "num_attention_heads": 2,
    "num_key_value_heads": 1, "vocab_size": V, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1 << 20, "rope_theta": 10000.0, "num_hidden_layers": 6,
}  # fmt: skip


@pytest.mark.parametrize(
    ("top_k", "k", "sampling"),
    [
        (1, 3, SamplingParams(temperature=1.0, seed=3)),
        (1, 3, SamplingParams(temperature=0.7, top_k=3, seed=4)),
        (2, 6, SamplingParams(temperature=1.0, seed=5)),
    ],
    ids=["chain", "chain-top_k", "tree"],
)
def test_sampling_follows_a_markov_target(top_k, k, sampling):
    config = dflash_config(MARKOV, block=4, ids=(0, 2), layers=1, head_dim=4)
    head = random_head(config, 2)
    drafter = DFlashDrafter(head, MarkovLM(TABLE), top_k)
    tokens, steps, _ = decode(MarkovLM(TABLE), [0], 2500, drafter, FixedPolicy(k), sampling)
    assert sum(s.accepted for s in steps) > 200  # accepted drafts and rejections alike
    assert sum(s.accepted < s.drafted for s in steps) > 200
    assert_markov([0, *tokens], TABLE, sampling)


@pytest.mark.parametrize(("top_k", "k"), [(1, 3), (2, 6)], ids=["chain", "tree"])
def test_sampled_drafts_follow_the_targets_marginal(top_k, k):
    """The third token of many seeded generations on a compiled tiny target matches its
    exact marginal: it comes from the first verify step's accepted drafts (drawn from the
    block's rows, or the tree's picks) or the second's, whose draft the first step's graph
    made (fused)."""
    vocab, prompt, temperature = 13, [1, 5, 9], 0.5
    config = tiny_config("llama", vocab_size=vocab, **DEEP)
    target = tiny_model("llama", seed=0, vocab_size=vocab, **DEEP)
    head = random_head(dflash_config(config, block=4), 3)
    decoder = Decoder(Sequence(target, DFlashDrafter(head, target, top_k)))
    sampling = SamplingParams(temperature=temperature)
    mx.random.seed(0)
    thirds = [
        leading_tokens(decoder, prompt, sampling, FixedPolicy(k), 3, 16)[2] for _ in range(1500)
    ]
    assert_follows_marginal(target, prompt, temperature, 2, thirds)


# z-lab's layout.

# The keys z-lab's DFlashDraftModel holds (model.py, model_mlx.py) for a 2-layer drafter.
ZLAB_KEYS = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{name}.weight"
    for i in range(2)
    for name in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "self_attn.q_norm",
        "self_attn.k_norm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    )  # fmt: skip
}
# What z-lab's MLX loader (`load_draft`) reads from config.json, key by key.
ZLAB_CONFIG = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta",
    "max_position_embeddings", "block_size", "num_target_layers",
)  # fmt: skip


def test_saved_drafter_is_zlabs_layout_and_loads_back(tmp_path):
    target, head = target_and_head()
    folder = save_dflash(head, tmp_path / "drafter")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert set(mx.load(str(folder / "model.safetensors"))) == ZLAB_KEYS
    raw = json.loads((folder / "config.json").read_text())
    assert all(key in raw for key in ZLAB_CONFIG)
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["dflash_config"]["target_layer_ids"] == [1, 3]
    assert raw["dflash_config"]["mask_token_id"] == 96 and raw["block_size"] == 5
    loaded = load_dflash(folder, target)
    assert loaded.config.block_size == 5 and loaded.config.target_layer_ids == (1, 3)
    assert loaded.config.num_target_layers == 6
    assert loaded.args.rope_config() == head.args.rope_config()
    rows = []
    for h in (head, loaded):
        drafter = DFlashDrafter(h, target, 1)
        rows.append(drafted_rows(drafter, primed(drafter, target)))
    assert mx.array_equal(rows[0], rows[1])


def test_zlab_config_forms(tmp_path):
    """block_size at the top level (z-lab's first releases) or in dflash_config (later
    ones); no target_layer_ids: z-lab's default spread over the target's layers."""
    target, head = target_and_head()
    folder = save_dflash(head, tmp_path / "drafter")
    raw = json.loads((folder / "config.json").read_text())
    del raw["dflash_config"]["block_size"]
    (folder / "config.json").write_text(json.dumps(raw))
    assert load_dflash(folder, target).config.block_size == 5
    del raw["block_size"]
    raw["dflash_config"] |= {"block_size": 7}
    del raw["dflash_config"]["target_layer_ids"]
    (folder / "config.json").write_text(json.dumps(raw))
    config = load_dflash(folder, target).config
    assert config.block_size == 7 and config.target_layer_ids == default_layer_ids(6, 2) == (1, 3)
    assert default_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # z-lab's Qwen3-4B drafter
    assert default_layer_ids(28, 1) == (14,)


# One-line errors.


def one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


def test_misfit_drafters_are_refused():
    target = tiny_model("llama", **DEEP)
    config = tiny_config("llama", **DEEP)
    cases = [
        (dflash_config(tiny_config("llama", hidden_size=32, **DEEP)), "hidden size 32"),
        (dflash_config(tiny_config("llama", vocab_size=50, **DEEP)), "vocabulary of 50"),
        (dflash_config(config, ids=(1, 5)), "readable layers are 0 to 4"),
        (dflash_config(tiny_config("llama", num_hidden_layers=36)), "36-layer target"),
    ]
    for bad, words in cases:
        with pytest.raises(ValueError, match=words) as error:
            make_drafter(DFlashSpec(drafter=random_head(bad)), target)
        one_line(error)
    with pytest.raises(ValueError, match="no DFlash drafter beside the model"):
        make_drafter(DFlashSpec(), target)
    with pytest.raises(ValueError, match="dflash_top_k must be an integer >= 1"):
        spec_from_keywords(dflash=True, dflash_top_k=0)
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        dflash_config(config, block=1)


def test_bad_drafter_folders_are_refused(tmp_path):
    target, head = target_and_head()
    with pytest.raises(FileNotFoundError, match="does not exist") as error:
        load_dflash(tmp_path / "nowhere", target)
    one_line(error)
    folder = save_dflash(head, tmp_path / "drafter")
    raw = json.loads((folder / "config.json").read_text())

    def broken(change, words, kind=ValueError):
        copy = tmp_path / f"broken{len(list(tmp_path.iterdir()))}"
        save_dflash(head, copy)
        change(copy)
        with pytest.raises(kind, match=words) as error:
            make_drafter(DFlashSpec(drafter=str(copy)), target)
        one_line(error)

    def config(**changes):
        return lambda p: (p / "config.json").write_text(json.dumps(raw | changes))

    broken(lambda p: (p / "model.safetensors").unlink(), "no \\*.safetensors", FileNotFoundError)
    broken(lambda p: (p / "config.json").unlink(), "no config.json", FileNotFoundError)
    broken(config(architectures=["DFlash2DraftModel"]), "DFlash 2 drafter")
    broken(config(architectures=["LlamaForCausalLM"]), "is not a DFlash drafter")
    broken(config(dflash_config={"target_layer_ids": [1, 3]}), "no dflash_config.mask_token_id")
    broken(config(dflash_config=None), "no dflash_config")
    broken(config(num_hidden_layers=3), "weights do not fit the DFlash drafter")
    broken(lambda p: (p / "config.json").write_text("{"), "not valid JSON")


# The CLI.


def test_generate_dflash_prints_its_speculation_line(tmp_path, capsys):
    """`generate --dflash DIR` on stories260K with a random drafter: plain greedy's text,
    and the Speculation line."""
    model, tokenizer = load(MODELS / "stories260K-llama")
    args = model.args
    target = {
        "hidden_size": args.hidden_size, "intermediate_size": 128, "num_attention_heads": 8,
        "num_key_value_heads": 4, "vocab_size": args.vocab_size, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512, "rope_theta": 10000.0, "num_hidden_layers": 5,
    }  # fmt: skip
    folder = save_dflash(random_head(dflash_config(target, ids=(1, 2), layers=1)), tmp_path / "d")
    prompt = "Lily and Tom went to the park."
    reference = greedy_reference(model, tokenizer.encode(prompt), 30)
    code = main([
        "--ignore-chat-template", "--prompt", prompt, "--model",
        str(MODELS / "stories260K-llama"), "--dflash", str(folder),
        "--num-draft-tokens", "3", "-m", "30", "--verbose",
    ])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0
    assert out == tokenizer.decode(reference) + "\n"
    assert "Speculation:" in err and "tokens per target forward" in err
    code = main(["--prompt", "x", "--model", str(MODELS / "stories260K-llama"),
                 "--dflash", str(tmp_path / "missing")])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and "does not exist" in err
