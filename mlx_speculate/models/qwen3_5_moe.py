"""Qwen3.5 mixture of experts (HF `Qwen3_5MoeForCausalLM`, model_type `qwen3_5_moe_text`) and
the language model of `qwen3_5_moe` folders: Qwen3.5 (models/qwen3_5.py) with every layer's
MLP a mixture of experts whose top-k weights are always renormalized, plus a gated shared
expert (models/qwen3_next.py's block)."""

from __future__ import annotations

from dataclasses import dataclass

from .qwen3_5 import Model as Qwen35Model
from .qwen3_5 import ModelArgs as Qwen35Args


@dataclass
class ModelArgs(Qwen35Args):
    # transformers' Qwen3_5MoeTextConfig defaults.
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_key_value_heads: int | None = 2
    num_experts: int | None = 256
    num_experts_per_tok: int | None = 8
    moe_intermediate_size: int | None = 512
    shared_expert_intermediate_size: int | None = 512

    def __post_init__(self):
        super().__post_init__()
        self.norm_topk_prob = True

    def sparse(self, layer: int) -> bool:
        return True


class Model(Qwen35Model):
    pass
