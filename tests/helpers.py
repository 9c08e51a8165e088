"""Helpers for tests: tiny seeded models and greedy references."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NoReturn

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from mlx_speculate.decode import Decoder
from mlx_speculate.loading import build_model, model_class
from mlx_speculate.sampling import SamplingParams
from mlx_speculate.sequence import Sequence

# The small real models, tokenizers and EAGLE data in the repository (data/README.md says whence).
DATA = Path(__file__).resolve().parent / "data"
MODELS = DATA / "models"
TOKENIZERS = DATA / "tokenizers"
# The SmolLM2 EAGLE heads (75 MB) are not in the repository: a development checkout has them in
# ../shared/eagle; tests that need them `require(EAGLE_HEADS / ..., BESIDE)`.
EAGLE_HEADS = Path(__file__).resolve().parents[2] / "shared" / "eagle"
BESIDE = "the SmolLM2 EAGLE heads ship beside a development checkout, not in the repository"
# Batched and one-token forwards may round differently: greedy comparisons assert this top-2 gap.
MIN_MARGIN = 1e-3

TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 97,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def assert_float32_close(ours, ref, rtol: float = 1e-4, scaled: float = 1e-5) -> None:
    """Equal up to float32 rounding in another summation order: each element within `rtol` of
    itself or `scaled` of the largest magnitude in `ref`. BLAS kernels (OpenBLAS's per CPU, the
    wheel's) sum in different orders, and a near-zero sum of large terms then moves by a fraction
    of the terms, not of itself: an absolute bound must scale with them."""
    ours, ref = np.asarray(ours, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    np.testing.assert_allclose(ours, ref, rtol=rtol, atol=scaled * max(scale, 1.0))


def require(path: Path, how: str) -> Path:
    """`path` if it exists; otherwise `unavailable`, saying how to get it."""
    if path.exists():
        return path
    unavailable(f"{path} is absent ({how})")


def unavailable(reason: str) -> NoReturn:
    """Skip with `reason`, or fail under CI=true, where a missing input must never pass
    silently."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


# The hybrids' experts: 4, 2 a token, and a shared expert.
HYBRID_MOE = {
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}  # fmt: skip

# What a family needs besides TINY to be tiny and to exercise its own features: Qwen3's
# explicit head_dim (not hidden / heads); Gemma 3's sliding layer 0 (with a small window and a
# fast-turning local RoPE base) beside global layer 1, and an attention scale of its own.
FAMILY_TINY = {
    "qwen3": {"head_dim": 32},
    # Mistral: every layer slides over 6 tokens, fewer than the tests' prompts.
    "mistral": {"sliding_window": 6},
    # Ministral 3: Mistral's window, an explicit head_dim, YaRN from 8 positions and queries
    # scaled anew every 8 positions.
    "ministral3": {
        "head_dim": 32, "sliding_window": 6,
        "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 8, "llama_4_scaling_beta": 0.5,
        },
    },
    # Qwen3-MoE: 4 experts, 2 a token, each half the dense MLP's width.
    "qwen3_moe": {
        "head_dim": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
    },
    # gpt-oss: layer 0 slides over 6 tokens, layer 1 is global; 4 experts, 2 a token.
    "gpt_oss": {
        "head_dim": 16,
        "sliding_window": 6,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 48,
        "max_position_embeddings": 131072,  # YaRN from 4096, x32
    },
    # Gemma 4: sliding layer 0 (window 6, head size 16) beside global layer 1 (head size 32,
    # proportional RoPE), per-layer inputs of width 8.
    "gemma4_text": {
        "head_dim": 16,
        "global_head_dim": 32,
        "sliding_window": 6,
        "vocab_size_per_layer_input": 97,
        "hidden_size_per_layer_input": 8,
    },
    # The hybrids: 4 layers, Gated DeltaNet in layers 0-2 and attention in layer 3 (split over
    # two ranks, rank 0 holds no attention layer); Qwen3-Next's layer 1 dense, the rest experts.
    **{
        model_type: {
            "num_hidden_layers": 4,
            "head_dim": 16,
            "partial_rotary_factor": 0.5,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 12,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            **experts,
        }
        for model_type, experts in {
            "qwen3_next": {**HYBRID_MOE, "mlp_only_layers": [1]},
            "qwen3_5_text": {},
            "qwen3_5_moe_text": HYBRID_MOE,
        }.items()
    },
    # Gemma 2: sliding layer 0 (window 6) beside global layer 1, scores capped at 2 (far below
    # their size, so the cap bites) and logits at 5, tied as its checkpoints are.
    "gemma2": {
        "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 6,
        "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0, "tie_word_embeddings": True,
    },
    "gemma3_text": {
        "head_dim": 32,
        "query_pre_attn_scalar": 24,
        "sliding_window": 6,
        "sliding_window_pattern": 2,
        "rope_local_base_freq": 100.0,
    },
}


def tiny_config(model_type: str = "llama", **overrides: Any) -> dict[str, Any]:
    return {"model_type": model_type, **TINY, **FAMILY_TINY.get(model_type, {}), **overrides}


def random_weights(config: dict[str, Any], seed: int = 0, qk_std: float = 0.3) -> dict:
    """Random float32 weights for `config`; q/k projections get a larger scale so attention
    is far from uniform and rotary bugs show up in the logits."""
    module = model_class(config)
    model = module.Model(module.ModelArgs.from_dict(config))
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    weights = {}
    for k, (name, value) in zip(keys, params, strict=True):
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * mx.random.normal(value.shape, key=k)
        elif any(p in name for p in ("q_proj", "k_proj", "qkv_proj")):
            weights[name] = qk_std * mx.random.normal(value.shape, key=k)
        else:
            weights[name] = (
                0.05 * mx.random.normal(value.shape, key=k) * (2.0 if "embed" in name else 1.0)
            )
    return weights


def tiny_model(model_type: str = "llama", seed: int = 0, **overrides: Any) -> nn.Module:
    config = tiny_config(model_type, **overrides)
    return build_model(config, random_weights(config, seed))


def to_float32(model: nn.Module) -> nn.Module:
    model.update(tree_map(lambda a: a.astype(mx.float32), model.parameters()))
    return model


def greedy_reference(model: nn.Module, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding, one token per forward, with the model's own cache."""
    cache = model.make_cache()
    logits = model(mx.array([prompt]), cache).logits[0, -1]
    out = []
    for _ in range(n):
        token = int(mx.argmax(logits).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache).logits[0, -1]
    return out


def tree_inputs(parents: list[int], offset: int) -> tuple[mx.array, mx.array]:
    """Rotary positions (offset + depth) and the additive (N, offset + N) mask of a tree whose
    node i has parent `parents[i]` (-1 for the root; parents come before children)."""
    n = len(parents)
    depth = [0] * n
    allowed = [[True] * offset + [False] * n for _ in range(n)]
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
        if p >= 0:
            allowed[i][offset:] = allowed[p][offset:]
        allowed[i][offset + i] = True
    mask = mx.where(mx.array(allowed), 0.0, -mx.inf)
    return mx.array([offset + d for d in depth]), mask


def tree_path(parents: list[int], node: int) -> list[int]:
    """Node indices from the root to `node`."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def decode(model, prompt, n, drafter=None, policy=None, sampling=None, **kwargs):
    """The first n tokens the decoding loop emits, its steps, and the decoder."""
    decoder = Decoder(Sequence(model, drafter))
    decoder.sequence.prefill(prompt)
    tokens, steps = [], []
    for step in decoder.steps(sampling or SamplingParams(), policy, **kwargs):
        tokens.extend(step.tokens)
        steps.append(step)
        if len(tokens) >= n:
            break
    return tokens[:n], steps, decoder


def assert_clear_argmax(model, prompt, tokens):
    """The reference tokens are the full forward's argmax with a clear top-2 gap."""
    logits = model(mx.array([prompt + tokens])).logits[0, len(prompt) - 1 : -1]  # (n, V)
    top2 = mx.sort(logits, axis=-1)[:, -2:]
    assert mx.argmax(logits, axis=-1).tolist() == tokens
    assert mx.min(top2[:, 1] - top2[:, 0]).item() > MIN_MARGIN


def eagle_config(target: dict[str, Any], version: int, draft_vocab: int | None = None, **extra):
    """An EAGLE head config for a target config: its sizes and rope, one draft layer."""
    from mlx_speculate.heads.eagle import EagleConfig

    sizes = (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "rms_norm_eps", "max_position_embeddings", "vocab_size", "rope_theta",
    )  # fmt: skip
    layer = {k: target[k] for k in sizes if k in target} | {"num_hidden_layers": 1}
    layer |= extra.pop("layer", {})
    return EagleConfig(version=version, layer=layer, draft_vocab_size=draft_vocab, **extra)


def random_eagle_weights(config, seed: int = 0, qk_std: float = 0.3) -> dict[str, mx.array]:
    """Random float32 weights in the head's parameter names; EAGLE-3's d2t maps the draft
    vocabulary onto a random sorted subset of the target's."""
    from mlx_speculate.heads.eagle import eagle_head

    params = tree_flatten(eagle_head(config).parameters())
    keys = mx.random.split(mx.random.key(seed), len(params) + 1)
    weights = {}
    for k, (name, value) in zip(keys[1:], params, strict=True):
        if name == "d2t":
            rng = np.random.default_rng(seed)
            chosen = np.sort(rng.choice(config.layer["vocab_size"], value.shape[0], False))
            weights[name] = mx.array(chosen - np.arange(value.shape[0]), dtype=mx.int64)
        elif "norm" in name and name.endswith("weight"):
            weights[name] = 1.0 + 0.1 * mx.random.normal(value.shape, key=k)
        elif any(p in name for p in ("q_proj", "k_proj")):
            weights[name] = qk_std * mx.random.normal(value.shape, key=k)
        else:
            weights[name] = 0.1 * mx.random.normal(value.shape, key=k)
    return weights


def random_eagle_head(target: dict[str, Any], version: int, seed: int = 0, **kwargs):
    from mlx_speculate.heads.eagle_format import build_eagle

    config = eagle_config(target, version, **kwargs)
    return build_eagle(config, random_eagle_weights(config, seed))


def leading_tokens(decoder, prompt, sampling, policy, count: int, max_tokens: int = 8) -> list[int]:
    """The first `count` tokens of one generation of up to `max_tokens` after `prompt` (the
    decoder reused)."""
    decoder.sequence.prefill(prompt)
    tokens = []
    for step in decoder.steps(sampling, policy, max_tokens=max_tokens):
        tokens.extend(step.tokens)
        if len(tokens) >= count:
            break
    return tokens[:count]
