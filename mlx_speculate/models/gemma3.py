"""Gemma 3 text (HF `Gemma3ForCausalLM`, model_type `gemma3_text`) and the language model of
`gemma3` folders (`Gemma3ForConditionalGeneration`: `text_config`, `language_model` prefixes).

Embeddings times sqrt(hidden), RMSNorms scaling by (1 + weight), norms before and after both
attention and MLP, q/k norms, attention scaled by `query_pre_attn_scalar`, a GELU-tanh MLP, and
sliding-window layers with their own RoPE base interleaved with global ones (`layer_types`, or
every `sliding_window_pattern`-th layer global).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .activations import gelu_approx
from .base import BaseModelArgs, CausalLM
from .context import ForwardContext
from .llama import MLP as LlamaMLP
from .qwen3 import Attention as Qwen3Attention
from .rope import LAYER_TYPES, RotaryEmbedding, rope_parameters
from .wrapper import under_language_model, unwrap

# Checkpoint prefixes of the language model inside `gemma3` folders (transformers >= 4.52, then
# older transformers and mlx-vlm) and the parts of those folders that are not text.
_PREFIXES = (("model.language_model.", "model."), ("language_model.", ""))
_NOT_TEXT = ("vision_tower", "multi_modal_projector")
_NOT_TEXT += tuple(f"model.{p}" for p in _NOT_TEXT)


@dataclass
class ModelArgs(BaseModelArgs):
    # transformers' Gemma3TextConfig defaults (sparse `text_config`s rely on them).
    hidden_size: int = 2304
    num_hidden_layers: int = 26
    intermediate_size: int = 9216
    num_attention_heads: int = 8
    vocab_size: int = 262_208
    num_key_value_heads: int | None = 4
    head_dim: int | None = 256
    max_position_embeddings: int = 131_072
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    tie_word_embeddings: bool = True
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    sliding_window_pattern: int = 6
    final_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    use_bidirectional_attention: bool | None = False

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        if config.get("model_type") == "gemma3":
            config = {**(config.get("text_config") or {}), "model_type": "gemma3"}
        return super().from_dict(config)

    def __post_init__(self):
        super().__post_init__()
        check_block(self, "Gemma 3")

    def _nested_rope(self, layer_type: str) -> dict[str, Any] | None:
        """transformers 5's per-layer-type `rope_parameters`, if the config has that form."""
        nested = self.rope_parameters or {}
        if not LAYER_TYPES & nested.keys():
            return None
        return nested.get(layer_type) or {}

    def rope_config(self) -> dict[str, Any]:
        """Global layers: `rope_theta` with `rope_scaling` (e.g. linear x8 in 4B and up)."""
        full = self._nested_rope("full_attention")
        if full is None:
            return super().rope_config()
        return rope_parameters({"rope_parameters": {"rope_theta": self.rope_theta, **full}})

    def local_rope_config(self) -> dict[str, Any]:
        """Sliding layers: unscaled RoPE at `rope_local_base_freq`."""
        local = self._nested_rope("sliding_attention") or {}
        return rope_parameters(
            {"rope_parameters": {"rope_theta": self.rope_local_base_freq, **local}}
        )

    def sliding_layers(self) -> tuple[bool, ...]:
        if self.layer_types is not None:
            return tuple(t == "sliding_attention" for t in self.layer_types)
        pattern = self.sliding_window_pattern
        return tuple((i + 1) % pattern != 0 for i in range(self.num_hidden_layers))


def check_block(args: Any, family: str) -> None:
    """Raises a one-line ValueError for what a Gemma 2 or 3 `ModelArgs` (`family` names it) asks
    of the block they share and this package does not run: another activation than
    GELU-tanh, bidirectional attention, or `layer_types` of another length than the layers."""
    if args.hidden_activation != "gelu_pytorch_tanh":
        raise ValueError(
            f"{family} hidden_activation {args.hidden_activation!r} is not supported "
            "(supported: gelu_pytorch_tanh)"
        )
    if args.use_bidirectional_attention:
        raise ValueError(f"{family} with use_bidirectional_attention is not a causal LM")
    if args.layer_types is not None and len(args.layer_types) != args.num_hidden_layers:
        raise ValueError(
            f"layer_types names {len(args.layer_types)} layers, the model has "
            f"{args.num_hidden_layers}"
        )


class RMSNorm(nn.Module):
    """Scales by (1 + weight), in float32 like transformers, then back to the input dtype."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        scale = 1.0 + self.weight.astype(mx.float32)
        return mx.fast.rms_norm(x.astype(mx.float32), scale, self.eps).astype(x.dtype)


class Attention(Qwen3Attention):
    def __init__(self, args: ModelArgs, rope: RotaryEmbedding):
        super().__init__(args, rope)
        self.scale = args.query_pre_attn_scalar**-0.5
        self.q_norm = RMSNorm(args.head_dim, eps=args.rms_norm_eps)
        self.k_norm = RMSNorm(args.head_dim, eps=args.rms_norm_eps)


class MLP(LlamaMLP):
    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps)
        self.post_feedforward_layernorm = RMSNorm(dim, eps)

    def __call__(self, x: mx.array, ctx: ForwardContext, layer: int) -> mx.array:
        r = self.self_attn(self.input_layernorm(x), ctx, layer)
        h = x + self.post_attention_layernorm(r)
        r = self.mlp(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(r)


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        local = RotaryEmbedding(
            args.head_dim, args.local_rope_config(), args.max_position_embeddings
        )
        if local.depends_on_length:  # the forward finds the largest position for the global one
            raise ValueError(f"sliding_attention rope_type {local.rope_type!r} is not supported")
        sliding = args.sliding_layers()

        def block(i: int, rope: RotaryEmbedding) -> TransformerBlock:
            return TransformerBlock(args, Attention(args, local if sliding[i] else rope), MLP(args))

        super().__init__(args, block, norm=RMSNorm, embed_scale=args.hidden_size**0.5)

    def project(self, hidden: mx.array) -> mx.array:
        logits = super().project(hidden)
        cap = self.args.final_logit_softcapping
        return logits if cap is None else mx.tanh(logits / cap) * cap

    def mlx_lm_layout(
        self, config: dict[str, Any], weights: dict[str, mx.array]
    ) -> tuple[dict[str, Any], dict[str, mx.array]]:
        return mlx_lm_layout(config, weights)

    def rename(self, name: str) -> str | None:
        name = unwrap(name, _PREFIXES, _NOT_TEXT)
        return None if name is None else super().rename(name)


def mlx_lm_layout(
    config: dict[str, Any], weights: dict[str, mx.array]
) -> tuple[dict[str, Any], dict[str, mx.array]]:
    """What mlx-lm's `gemma3` model reads from a converted `gemma3` folder: the language model's
    names under `language_model.` (quantization overrides too), and the top-level
    `vocab_size`, which it copies into the text config (else its default, 262208, would
    replace the checkpoint's). Other folders are returned as they are."""
    if config.get("model_type") != "gemma3":
        return config, weights
    config = {**config, "vocab_size": ModelArgs.from_dict(config).vocab_size}
    return under_language_model(config, weights)
