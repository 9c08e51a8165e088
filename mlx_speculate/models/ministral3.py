"""Ministral 3 (HF `Ministral3ForCausalLM`, model_type `ministral3`): Mistral whose queries are
scaled by 1 + beta * log(1 + floor(position / original_max_position_embeddings)) (Llama 4's
attention temperature, `llama_4_scaling_beta` in `rope_parameters`), YaRN by default, no window
by default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .base import CausalLM, TransformerBlock, attend
from .context import ForwardContext
from .llama import MLP
from .llama import Attention as LlamaAttention
from .mistral import ModelArgs as MistralArgs
from .rope import RotaryEmbedding

# transformers' Ministral3Config rope when a config has none.
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1_000_000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 16384,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}
_SCALING_KEYS = ("llama_4_scaling_beta", "original_max_position_embeddings")


@dataclass
class ModelArgs(MistralArgs):
    # transformers' Ministral3Config defaults (sparse configs rely on them).
    head_dim: int | None = 128
    max_position_embeddings: int = 262_144
    rms_norm_eps: float = 1e-5
    sliding_window: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.rope_parameters is None and self.rope_scaling is None:
            self.rope_parameters = dict(DEFAULT_ROPE)
        missing = [k for k in _SCALING_KEYS if self.rope_config().get(k) is None]
        if missing:
            raise ValueError(f"ministral3 rope_parameters need {' and '.join(missing)}")

    def query_scaling(self) -> tuple[float, int]:
        """(beta, original_max_position_embeddings) of the query scale."""
        params = self.rope_config()
        return float(params["llama_4_scaling_beta"]), int(
            params["original_max_position_embeddings"]
        )


class Attention(LlamaAttention):
    def __init__(self, args: ModelArgs, rope: RotaryEmbedding):
        super().__init__(args, rope)
        self.beta, self.original = args.query_scaling()

    def __call__(self, x: mx.array, ctx: ForwardContext, layer: int) -> mx.array:
        q, k, v = self.heads(x)  # (B, H, L, D)
        L = q.shape[2]
        # By rotary position (a tree's nodes by depth): (L,) or (B, L); the scale commutes
        # with the rotation transformers applies it after.
        positions = ctx.positions
        if positions is None:
            positions = ctx.start[..., None] + mx.arange(L, dtype=mx.int32)
        scale = 1 + self.beta * mx.log(1 + mx.floor(positions.astype(mx.float32) / self.original))
        q = q * scale.reshape(-1, 1, L, 1).astype(q.dtype)
        return self.o_proj(attend(ctx, layer, self._rope, q, k, v, self.scale))


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(
            args, lambda _, rope: TransformerBlock(args, Attention(args, rope), MLP(args))
        )

    def mlx_lm_layout(
        self, config: dict[str, Any], weights: dict[str, mx.array]
    ) -> tuple[dict[str, Any], dict[str, mx.array]]:
        """mlx-lm's `ministral3` reads its rope from `rope_parameters` alone (query scaling
        keys included) and ties embeddings unless told: both written out."""
        args = self.args
        written = {"rope_parameters": args.rope_config(), "rms_norm_eps": args.rms_norm_eps}
        written |= {"tie_word_embeddings": args.tie_word_embeddings, "head_dim": args.head_dim}
        return {**config, **written, "num_key_value_heads": args.num_key_value_heads}, weights
