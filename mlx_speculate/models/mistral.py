"""Mistral (HF `MistralForCausalLM`): Llama without biases whose every layer attends within
`sliding_window` when it is set (transformers' default, 4096, as Mistral 7B v0.1; later
checkpoints write null)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .llama import Model as LlamaModel
from .llama import ModelArgs as LlamaArgs


@dataclass
class ModelArgs(LlamaArgs):
    # transformers' MistralConfig defaults (sparse configs rely on them).
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 131_072
    sliding_window: int | None = 4096

    def __post_init__(self):
        super().__post_init__()
        # transformers' Mistral has no biases, whatever the config says.
        self.attention_bias = self.mlp_bias = False

    def sliding_layers(self) -> tuple[bool, ...]:
        # Every layer, `layer_types` or not (transformers ignores them for Mistral).
        return (self.sliding_window is not None,) * self.num_hidden_layers


# Fields whose transformers default (MistralConfig's) differs from mlx-lm's, which reads
# `mistral` as its `llama`.
_MLX_LM_DEFAULTS_DIFFER = ("num_key_value_heads", "rms_norm_eps", "tie_word_embeddings")


class Model(LlamaModel):
    def mlx_lm_layout(
        self, config: dict[str, Any], weights: dict[str, mx.array]
    ) -> tuple[dict[str, Any], dict[str, mx.array]]:
        """The config with the fields mlx-lm would otherwise default differently written out.
        mlx-lm's `llama` slides only where `layer_types` says, and needs a full layer among
        them, so it attends past Mistral's window (alike up to `sliding_window` tokens)."""
        return {**config, **{k: getattr(self.args, k) for k in _MLX_LM_DEFAULTS_DIFFER}}, weights
