"""Qwen3 dense (HF `Qwen3ForCausalLM`): Llama with an RMSNorm per head on queries and keys
before RoPE, an explicit head_dim and Qwen2's optional sliding window."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .base import CausalLM, TransformerBlock
from .llama import MLP
from .llama import Attention as LlamaAttention
from .qwen2 import ModelArgs as Qwen2Args
from .rope import RotaryEmbedding


@dataclass
class ModelArgs(Qwen2Args):
    head_dim: int | None = 128  # transformers' Qwen3Config defaults
    rms_norm_eps: float = 1e-6

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias


class Attention(LlamaAttention):
    def __init__(self, args: ModelArgs, rope: RotaryEmbedding):
        super().__init__(args, rope)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.rms_norm_eps)

    def heads(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return q, k, v  # (B, H, L, D)


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(
            args, lambda _, rope: TransformerBlock(args, Attention(args, rope), MLP(args))
        )
