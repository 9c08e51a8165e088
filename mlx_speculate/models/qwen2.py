"""Qwen2 / Qwen2.5 (HF `Qwen2ForCausalLM`): Llama with q/k/v biases and optional sliding window."""

from __future__ import annotations

from dataclasses import dataclass

from . import llama


@dataclass
class ModelArgs(llama.ModelArgs):
    rope_theta: float = 1000000.0
    tie_word_embeddings: bool = True

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
        first = self.max_window_layers or 0
        return tuple(i >= first for i in range(self.num_hidden_layers))


class Model(llama.Model):
    pass
