"""Models against transformers (float64, eager), cached decoding, trees and real checkpoints."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_speculate.loading import build_model, load, load_model

from .helpers import TINY, greedy_reference, random_weights, tiny_config, tree_inputs, tree_path

REL, ABS = 1e-5, 1e-4  # float32 against float64 lands near 1e-6 relative


@dataclass(frozen=True)
class Variant:
    model_type: str
    overrides: dict[str, Any] = field(default_factory=dict)
    rope: dict[str, Any] = field(default_factory=dict)  # rope settings besides theta
    theta: float = 10000.0
    length: int = 10  # prompt length
    prefill: int = 6  # cached decoding: prefill this many tokens, then one token per step


def longrope(n: int) -> dict[str, Any]:
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(n)],
        "long_factor": [1.0 + 1.5 * i for i in range(n)],
    }


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}

VARIANTS = {
    "llama-mha": Variant("llama", {"num_key_value_heads": 4}),
    "llama-gqa": Variant("llama"),
    "llama-bias": Variant("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-tied": Variant("llama", {"tie_word_embeddings": True}),
    "llama-linear": Variant("llama", rope={"rope_type": "linear", "factor": 4.0}),
    # The prompt crosses max_position_embeddings, so the NTK base is recomputed per forward.
    "llama-dynamic": Variant(
        "llama",
        {"max_position_embeddings": 32},
        {"rope_type": "dynamic", "factor": 2.0},
        length=36,
        prefill=30,
    ),
    # head_dim 16, theta 5e5, original 64: wavelengths 6, 32 and >= 167 hit all three bands.
    "llama3": Variant(
        "llama", rope={**LLAMA3, "original_max_position_embeddings": 64}, theta=500000.0
    ),
    "qwen2": Variant("qwen2"),
    "qwen2-tied": Variant("qwen2", {"tie_word_embeddings": True}),
    "qwen2-window-off": Variant(
        "qwen2",
        {"use_sliding_window": False, "sliding_window": 4, "max_window_layers": 0},
    ),
    "qwen2-window": Variant(
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
        length=12,
        prefill=8,
    ),
    "phi3": Variant("phi3"),
    "phi3-window": Variant("phi3", {"sliding_window": 6}, length=12, prefill=8),
    "phi3-longrope-short": Variant(
        "phi3", {"original_max_position_embeddings": 64}, longrope(8), length=24, prefill=20
    ),
    "phi3-longrope-long": Variant(
        "phi3", {"original_max_position_embeddings": 16}, longrope(8), length=20, prefill=14
    ),
    "phi3-partial": Variant("phi3", rope={"partial_rotary_factor": 0.5}),
    "phi3-partial-longrope": Variant(
        "phi3",
        {"original_max_position_embeddings": 16},
        {**longrope(4), "partial_rotary_factor": 0.5},
        length=20,
        prefill=14,
    ),
}


def variant_config(variant: Variant, form: str) -> dict[str, Any]:
    """The variant's config.json in the transformers 5.x form or the legacy form."""
    config = tiny_config(variant.model_type, **variant.overrides)
    del config["rope_theta"]
    rope = dict(variant.rope)
    if form == "rope_parameters":
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": variant.theta, **rope}
        return config
    config["rope_theta"] = variant.theta
    if "partial_rotary_factor" in rope:
        config["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    if rope:
        rope_type = rope.pop("rope_type")
        config["rope_scaling"] = {"type": rope_type, **rope}
    return config


def hf_model(config: dict[str, Any], weights: dict[str, mx.array]):
    """transformers' model for `config` in float64 with eager attention and `weights` loaded."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    # Phi-3's default pad/eos ids (32000) lie outside a tiny vocabulary.
    config = {"pad_token_id": None, "eos_token_id": None, **config}
    hf_config = AutoConfig.for_model(**config, attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(hf_config).double().eval()
    state = {k: torch.from_numpy(np.array(v, dtype=np.float64)) for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected
    assert missing == (["lm_head.weight"] if hf_config.tie_word_embeddings else [])
    return model


def hf_forward(model, tokens: np.ndarray, cache=None, hidden: bool = False):
    import torch

    with torch.no_grad():
        return model(
            torch.from_numpy(tokens),
            past_key_values=cache,
            use_cache=cache is not None,
            output_hidden_states=hidden,
        )


def assert_close(ours: mx.array, ref, rel: float = REL, atol: float = ABS) -> None:
    """Max |ours - ref| below `rel` of max |ref| and below `atol`."""
    ref = np.asarray(ref, dtype=np.float64)
    err = float(np.abs(np.array(ours, dtype=np.float64) - ref).max())
    scale = float(np.abs(ref).max())
    assert err < rel * scale and err < atol, f"max abs error {err:.3g} (relative {err / scale:.3g})"


def prompt(length: int, seed: int = 0, vocab: int = TINY["vocab_size"]) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (1, length))


@pytest.mark.parametrize("form", ["rope_parameters", "legacy"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_prompt_matches_transformers(name, form):
    """A full-prompt forward gives transformers' logits, final hidden and the hidden states
    entering the tapped layers (transformers' hidden_states[i])."""
    variant = VARIANTS[name]
    config = variant_config(variant, form)
    weights = random_weights(config)
    ref = hf_model(config, weights)
    tokens = prompt(variant.length)
    last = len(ref.model.layers) - 1
    expected = hf_forward(ref, tokens, hidden=True)

    out = build_model(config, weights)(mx.array(tokens), taps=(last, 1, 0))
    assert_close(out.logits, expected.logits)
    assert_close(out.hidden, expected.hidden_states[-1])  # HF's last entry is post-norm
    assert_close(out.taps[0], expected.hidden_states[last])
    assert_close(out.taps[1], expected.hidden_states[1])
    assert_close(out.taps[2], expected.hidden_states[0])  # the embeddings


@pytest.mark.parametrize("form", ["rope_parameters", "legacy"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_cached_decoding_matches_transformers(name, form):
    """Prefill then one token per step gives transformers' logits at every step (its cache too)."""
    from transformers import DynamicCache

    variant = VARIANTS[name]
    config = variant_config(variant, form)
    weights = random_weights(config)
    ref = hf_model(config, weights)
    model = build_model(config, weights)
    tokens = prompt(variant.length)
    ref_cache, cache = DynamicCache(config=ref.config), model.make_cache()
    steps = [(0, variant.prefill)] + [(t, t + 1) for t in range(variant.prefill, variant.length)]
    for start, end in steps:
        expected = hf_forward(ref, tokens[:, start:end], ref_cache).logits
        assert_close(model(mx.array(tokens[:, start:end]), cache).logits, expected)
    assert cache.offset == variant.length


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "phi3"])
def test_missing_keys_take_transformers_defaults(model_type):
    """A config with only the required sizes behaves like transformers' defaults for it."""
    config = {"model_type": model_type, "vocab_size": 97, "hidden_size": 64}
    config |= {"num_hidden_layers": 2, "intermediate_size": 96, "num_attention_heads": 4}
    config |= {"num_key_value_heads": 2}  # Qwen2Config's default (32) exceeds the 4 heads
    # Without max_window_layers, transformers' default (28) keeps both layers full attention.
    config |= {"use_sliding_window": True, "sliding_window": 4} if model_type == "qwen2" else {}
    weights = random_weights(config)
    tokens = prompt(12)
    expected = hf_forward(hf_model(config, weights), tokens).logits
    assert_close(build_model(config, weights)(mx.array(tokens)).logits, expected)


def test_rope_theta_inside_rope_parameters_is_used(tmp_path):
    """Only `rope_parameters.rope_theta` (no top-level key, mlx-lm 0.32 reads 1e4) sets the base."""
    config = tiny_config()
    del config["rope_theta"]
    config["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "default"}
    weights = random_weights(config)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    (tmp_path / "config.json").write_text(json.dumps(config))
    tokens = prompt(32)
    expected = hf_forward(hf_model(config, weights), tokens).logits.numpy()

    ours = load_model(tmp_path)[0](mx.array(tokens)).logits
    assert_close(ours, expected)
    config["rope_parameters"]["rope_theta"] = 10000.0
    wrong = np.array(build_model(config, weights)(mx.array(tokens)).logits)
    assert np.abs(wrong - expected).max() > 1e-2 * np.abs(expected).max()


# Tree verification: one forward over a tree equals sequential forwards along each path.

PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]  # depth 3, branching 2: leaves 4, 6, 7


@pytest.mark.parametrize(
    "model_type, overrides",
    [("llama", {}), ("qwen2", {}), ("phi3", {}), ("phi3", {"sliding_window": 8})],
    ids=["llama", "qwen2", "phi3", "phi3-window"],  # window 8 < prefix 10 + tree depth
)
def test_tree_forward_matches_paths(model_type, overrides):
    """Every tree node's logits equal a cached forward along its root-to-node path."""
    model = build_model(config := tiny_config(model_type, **overrides), random_weights(config))
    prefix = mx.array(prompt(10, seed=1))
    nodes = mx.array(prompt(len(PARENTS), seed=2))
    cache = model.make_cache()
    model(prefix, cache)
    positions, mask = tree_inputs(PARENTS, cache.offset)
    tree = model(nodes, cache, positions=positions, mask=mask).logits[0]
    for leaf in (4, 6, 7):
        path = tree_path(PARENTS, leaf)
        cache = model.make_cache()
        model(prefix, cache)
        sequential = model(nodes[:, path], cache).logits[0]
        assert_close(tree[mx.array(path)], sequential)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "phi3"])
@pytest.mark.parametrize("shape", ["(B, L)", "(L,)"])
def test_explicit_consecutive_positions_equal_default(model_type, shape):
    """Positions equal to the consecutive default give the same logits as positions=None."""
    model = build_model(config := tiny_config(model_type), random_weights(config))
    tokens = mx.array(prompt(12))
    caches = [model.make_cache(), model.make_cache()]
    for cache in caches:
        model(tokens[:, :5], cache)
    positions = mx.arange(5, 12) if shape == "(L,)" else mx.arange(5, 12)[None]
    default = model(tokens[:, 5:], caches[0]).logits
    explicit = model(tokens[:, 5:], caches[1], positions=positions).logits
    assert mx.array_equal(default, explicit)


# Real checkpoints from ../shared/models.

FOLDERS = ["stories260K-llama", "stories260K-qwen2", "stories260K-phi3", "llama2xs281K-llama"]
PROMPTS = ["Once upon a time", "Lily and Tom went to the park. They saw a big dog", "The sun"]


@pytest.mark.parametrize("folder", FOLDERS)
def test_checkpoint_matches_transformers(shared_models, folder):
    """Each real checkpoint gives transformers' float64 logits on a few prompts."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model, tokenizer = load(shared_models / folder)
    ref = AutoModelForCausalLM.from_pretrained(
        shared_models / folder, dtype=torch.float64, attn_implementation="eager"
    ).eval()
    for text in PROMPTS:
        tokens = np.array([tokenizer.encode(text)])
        assert tokens[0, 0] == 1 and tokens.shape[1] > 3
        assert_close(model(mx.array(tokens)).logits, hf_forward(ref, tokens).logits)


def greedy_text_ids(shared_models: Path) -> list[int]:
    _, tokenizer = load(shared_models / "stories260K-llama")
    text = (shared_models / "stories260K-llama" / "greedy-from-bos.txt").read_text()
    return tokenizer.encode(text, add_special_tokens=False)


def test_stories_layouts_agree(shared_models):
    """The Llama, Qwen2 and Phi-3 layouts of stories260K give the same logits."""
    tokens = mx.array([[1] + greedy_text_ids(shared_models)[:63]])
    logits = [
        load_model(shared_models / f"stories260K-{a}")[0](tokens).logits
        for a in ("llama", "qwen2", "phi3")
    ]
    for other in logits[1:]:
        assert mx.abs(other - logits[0]).max().item() <= 2e-5


def test_stories_greedy_from_bos(shared_models):
    """Greedy decoding of stories260K from BOS reproduces the published 256-token story."""
    model, tokenizer = load(shared_models / "stories260K-llama")
    ids = greedy_reference(model, [1], 256)
    expected = (shared_models / "stories260K-llama" / "greedy-from-bos.txt").read_text()
    assert tokenizer.decode(ids) + "\n" == expected  # the file ends with a newline
