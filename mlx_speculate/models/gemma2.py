"""Gemma 2 (HF `Gemma2ForCausalLM`): Gemma 3's block (scaled embeddings, (1 + weight) norms
around attention and MLP, GELU-tanh MLP, `query_pre_attn_scalar`) without q/k norms or a local
RoPE base, with attention scores capped at `attn_logit_softcapping` (tanh) and logits at
`final_logit_softcapping`, and sliding layers alternating with global ones (`layer_types`, or
every even layer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .base import BaseModelArgs, CausalLM, attend
from .context import ForwardContext
from .gemma3 import MLP, RMSNorm, TransformerBlock, check_block
from .llama import Attention as LlamaAttention
from .rope import RotaryEmbedding


@dataclass
class ModelArgs(BaseModelArgs):
    # transformers' Gemma2Config defaults (sparse configs rely on them).
    hidden_size: int = 2304
    num_hidden_layers: int = 26
    intermediate_size: int = 9216
    num_attention_heads: int = 8
    vocab_size: int = 256_000
    num_key_value_heads: int | None = 4
    head_dim: int | None = 256
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    attn_logit_softcapping: float | None = 50.0
    final_logit_softcapping: float | None = 30.0
    hidden_activation: str = "gelu_pytorch_tanh"
    use_bidirectional_attention: bool | None = None

    def __post_init__(self):
        super().__post_init__()
        check_block(self, "Gemma 2")

    def sliding_layers(self) -> tuple[bool, ...]:
        if self.layer_types is not None:
            return tuple(t == "sliding_attention" for t in self.layer_types)
        return tuple(i % 2 == 0 for i in range(self.num_hidden_layers))


class Attention(LlamaAttention):
    def __init__(self, args: ModelArgs, rope: RotaryEmbedding):
        super().__init__(args, rope)
        self.scale = args.query_pre_attn_scalar**-0.5
        self.softcap = args.attn_logit_softcapping

    def __call__(self, x: mx.array, ctx: ForwardContext, layer: int) -> mx.array:
        q, k, v = self.heads(x)
        out = attend(ctx, layer, self._rope, q, k, v, self.scale, softcap=self.softcap)
        return self.o_proj(out)


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(
            args,
            lambda _, rope: TransformerBlock(args, Attention(args, rope), MLP(args)),
            norm=RMSNorm,
            embed_scale=args.hidden_size**0.5,
        )

    def project(self, hidden: mx.array) -> mx.array:
        logits = super().project(hidden)
        cap = self.args.final_logit_softcapping
        return logits if cap is None else mx.tanh(logits / cap) * cap

    def mlx_lm_layout(
        self, config: dict[str, Any], weights: dict[str, mx.array]
    ) -> tuple[dict[str, Any], dict[str, mx.array]]:
        """mlx-lm's `gemma2` needs the sizes transformers defaults and scales queries by 144
        unless told: they are written out. It attends past the window on every layer (alike
        up to `sliding_window` tokens)."""
        names = ("head_dim", "num_key_value_heads", "rms_norm_eps", "query_pre_attn_scalar")
        names += ("attn_logit_softcapping", "final_logit_softcapping", "tie_word_embeddings")
        return {**config, **{k: getattr(self.args, k) for k in names}}, weights
