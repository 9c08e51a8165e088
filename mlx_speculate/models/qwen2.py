"""Qwen2 / Qwen2.5 (HF `Qwen2ForCausalLM`): Llama with q/k/v biases and optional sliding window."""

from __future__ import annotations

from dataclasses import dataclass

from .llama import Model as LlamaModel
from .llama import ModelArgs as LlamaArgs


@dataclass
class ModelArgs(LlamaArgs):
    max_window_layers: int = 28  # transformers' Qwen2Config default

    @property
    def qkv_bias(self) -> bool:
        return True

    @property
    def o_bias(self) -> bool:
        return False

    def sliding_layers(self) -> tuple[bool, ...]:
        if not self.use_sliding_window or self.sliding_window is None:
            return (False,) * self.num_hidden_layers
        if self.layer_types is not None:
            return tuple(t == "sliding_attention" for t in self.layer_types)
        # transformers: layers from `max_window_layers` on use the window.
        return tuple(i >= self.max_window_layers for i in range(self.num_hidden_layers))


class Model(LlamaModel):
    pass
