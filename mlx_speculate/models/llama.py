"""Llama 2 / 3 / 3.1 / 3.2 (HF `LlamaForCausalLM`)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .base import BaseModelArgs, CausalLM, TransformerBlock, attend
from .context import ForwardContext
from .fast_exp import silu


@dataclass
class ModelArgs(BaseModelArgs):
    pass


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, rope):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        self._rope = rope
        dim = args.hidden_size
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=args.o_bias)

    def heads(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The (B, H, L, D) queries, keys and values of `x`, before RoPE (the families that
        change only what attention does with them share this)."""
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, D)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return q, k, v

    def __call__(self, x: mx.array, ctx: ForwardContext, layer: int) -> mx.array:
        q, k, v = self.heads(x)
        return self.o_proj(attend(ctx, layer, self._rope, q, k, v, self.scale))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, hidden = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(dim, hidden, bias=args.mlp_bias)
        self.up_proj = nn.Linear(dim, hidden, bias=args.mlp_bias)
        self.down_proj = nn.Linear(hidden, dim, bias=args.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(
            args, lambda _, rope: TransformerBlock(args, Attention(args, rope), MLP(args))
        )
