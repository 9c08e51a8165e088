"""Phi-3 / Phi-3.5 / Phi-4-mini (HF `Phi3ForCausalLM`): fused qkv and gate/up projections."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .base import BaseModelArgs, CausalLM, TransformerBlock, attend
from .context import ForwardContext
from .fast_exp import silu


@dataclass
class ModelArgs(BaseModelArgs):
    rms_norm_eps: float = 1e-5  # transformers' Phi3Config default

    def sliding_layers(self) -> tuple[bool, ...]:
        # transformers applies `sliding_window` to every Phi-3 layer when it is set.
        return (self.sliding_window is not None,) * self.num_hidden_layers


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, rope):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        self._rope = rope
        qkv = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, qkv, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)

    def __call__(self, x: mx.array, ctx: ForwardContext, layer: int) -> mx.array:
        B, L, _ = x.shape
        q_end = self.n_heads * self.head_dim
        k_end = q_end + self.n_kv_heads * self.head_dim
        q, k, v = mx.split(self.qkv_proj(x), [q_end, k_end], axis=-1)
        q = q.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, D)
        k = k.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.o_proj(attend(ctx, layer, self._rope, q, k, v, self.scale))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(silu(gate) * up)


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(
            args, lambda _, rope: TransformerBlock(args, Attention(args, rope), MLP(args))
        )
