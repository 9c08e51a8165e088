"""Qwen3-MoE (HF `Qwen3MoeForCausalLM`, e.g. Qwen3-30B-A3B): Qwen3's attention (q/k norms)
with sparse mixture-of-experts blocks: a linear router, softmax over all experts, the top
`num_experts_per_tok` (renormalised when `norm_topk_prob`), a SwiGLU expert each. Layers in
`mlp_only_layers`, or off every `decoder_sparse_step`-th, keep a dense MLP. With
`use_sliding_window` every layer attends within `sliding_window`, as transformers does.

Experts are stacked under mlx-lm's names (`mlp.switch_mlp.{gate,up,down}_proj`); transformers
saves one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, ...), stacked at load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .base import CausalLM, TransformerBlock
from .experts import SwiGLU, SwitchGLU, stack_experts, top_k
from .llama import MLP
from .qwen3 import Attention
from .qwen3 import ModelArgs as Qwen3Args

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass
class ModelArgs(Qwen3Args):
    # transformers' Qwen3MoeConfig defaults (it has no head_dim default: hidden / heads).
    head_dim: int | None = None
    sliding_window: int | None = 4096
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    norm_topk_prob: bool = False
    hidden_act: str = "silu"

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        # transformers saves `num_experts` under its attribute-map name.
        if "num_experts" not in config and "num_local_experts" in config:
            config = {**config, "num_experts": config["num_local_experts"]}
        return super().from_dict(config)

    def __post_init__(self):
        super().__post_init__()
        if self.hidden_act != "silu":
            raise ValueError(
                f"Qwen3-MoE hidden_act {self.hidden_act!r} is not supported (supported: silu)"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(
                f"config field 'decoder_sparse_step' must be >= 1, got {self.decoder_sparse_step}"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"config field 'num_experts_per_tok' must be in 1..num_experts "
                f"({self.num_experts}), got {self.num_experts_per_tok}"
            )

    def sparse(self, layer: int) -> bool:
        """Whether `layer` has an MoE block (transformers' rule)."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def sliding_layers(self) -> tuple[bool, ...]:
        windowed = self.use_sliding_window and self.sliding_window is not None
        return (windowed,) * self.num_hidden_layers


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(
            args.hidden_size, args.moe_intermediate_size, args.num_experts, SwiGLU()
        )

    def __call__(self, x: mx.array) -> mx.array:
        probs = mx.softmax(self.gate(x).astype(mx.float32), axis=-1)  # (B, L, E), as HF: fp32
        scores, indices = top_k(probs, self.top_k)  # (B, L, k)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        y = self.switch_mlp(x, indices)  # (B, L, k, hidden)
        return (y * scores.astype(y.dtype)[..., None]).sum(axis=-2)


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        def block(i: int, rope) -> TransformerBlock:
            if args.sparse(i):
                mlp = SparseMoeBlock(args)
            else:
                mlp = MLP(args)  # HF's dense Qwen3MoeMLP: intermediate_size, no bias
            return TransformerBlock(args, Attention(args, rope), mlp)

        super().__init__(args, block)

    def mlx_lm_layout(
        self, config: dict[str, Any], weights: dict[str, mx.array]
    ) -> tuple[dict[str, Any], dict[str, mx.array]]:
        """mlx-lm requires the MoE fields transformers leaves to defaults or saves under other
        names (`num_local_experts`), and `head_dim`."""
        args = self.args
        fields = (
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "decoder_sparse_step",
            "mlp_only_layers",
            "norm_topk_prob",
            "head_dim",
            "rms_norm_eps",
            "max_position_embeddings",
            "tie_word_embeddings",
        )
        return {**config, **{k: getattr(args, k) for k in fields}}, weights

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """transformers' per-expert tensors stacked into mlx-lm's layout (`weights` is
        consumed: the per-expert tensors leave it as they are stacked)."""
        for i in range(self.args.num_hidden_layers):
            prefix = f"model.layers.{i}.mlp"
            names = {
                f"{p}.{part}": f"{prefix}.switch_mlp.{p}.{part}"
                for p in _PROJECTIONS
                for part in ("weight", "scales", "biases")  # float or mlx-quantized experts
            }
            stack_experts(weights, f"{prefix}.experts", self.args.num_experts, names)
        return super().sanitize(weights)
