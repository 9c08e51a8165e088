"""Tiny Gemma 4 targets and drafts for the decoding tests (no torch: the batch and method tests
build them too)."""

from __future__ import annotations

import mlx.core as mx

from mlx_speculate.loading import build_model

from .helpers import random_weights, tiny_config

S, F = "sliding_attention", "full_attention"
# Routers far from uniform, experts of a size that shows.
SCALES = {"router.scale": 1.0, "per_expert_scale": 1.0}
MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16}
# Layers 3 and 4 write no keys: 3 reads sliding layer 2's, 4 global layer 1's.
SHARED = {"num_hidden_layers": 5, "layer_types": [S, F, S, S, F], "num_kv_shared_layers": 2}
# Everything at once, for the decoding tests: per-layer inputs, KV sharing, values from keys,
# experts, a window of 6 shorter than the prompts.
DEEP = {
    **SHARED, **MOE, "attention_k_eq_v": True, "num_global_key_value_heads": 1,
    "use_double_wide_mlp": True, "final_logit_softcapping": 10.0,
}  # fmt: skip
TARGET_SEED = 4  # its greedy continuations keep a clear top-2 margin (asserted)


def gemma4_weights(config, seed: int) -> dict[str, mx.array]:
    """random_weights with layer scales, router input scales and per-expert scales near 1
    (its generic small values would shrink the residual stream at every layer)."""
    weights = random_weights(config, seed)
    for name, value in weights.items():
        if name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):
            weights[name] = 1.0 + 4.0 * value  # value: 0.05 times a standard normal
    return weights


def tiny_gemma4(seed: int, **overrides):
    config = tiny_config("gemma4_text", **overrides)
    return build_model(config, gemma4_weights(config, seed))


def related_gemma4(seed: int, other: int, mix: float = 0.1, **overrides):
    """A draft that often agrees with tiny_gemma4(seed) and often not (families.related_draft
    with these weights)."""
    config = tiny_config("gemma4_text", **overrides)
    near, far = gemma4_weights(config, seed), gemma4_weights(config, other)
    return build_model(config, {k: v + mix * (far[k] - v) for k, v in near.items()})
