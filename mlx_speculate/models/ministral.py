"""Ministral (HF `MinistralForCausalLM`, model_type `ministral`: Ministral-8B-2410): Mistral
whose layers slide or not as `layer_types` says (every layer when it is absent and a window is
set)."""

from __future__ import annotations

from dataclasses import dataclass

from .mistral import Model as MistralModel
from .mistral import ModelArgs as MistralArgs


@dataclass
class ModelArgs(MistralArgs):
    def __post_init__(self):
        super().__post_init__()
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types names {len(self.layer_types)} layers, the model has "
                f"{self.num_hidden_layers}"
            )

    def sliding_layers(self) -> tuple[bool, ...]:
        if self.sliding_window is None or self.layer_types is None:
            return super().sliding_layers()
        return tuple(t == "sliding_attention" for t in self.layer_types)


class Model(MistralModel):
    pass
