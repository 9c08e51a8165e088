"""Qwen3.5 dense (HF `Qwen3_5ForCausalLM`, model_type `qwen3_5_text`) and the language model
of `qwen3_5` folders (`Qwen3_5ForConditionalGeneration`: `text_config`, the text weights under
`model.language_model.`, or `language_model.model.` as mlx-community lays them out).

Qwen3-Next's hybrid stack (models/qwen3_next.py) with the DeltaNet's input projections split
(q|k|v, z, b, a) rather than grouped per key head. The multimodal rotary sections (mrope) give
every text token the same position on all three axes, which is plain (partial) RoPE.
The vision tower and `mtp.*` are not loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from .gated_delta import GatedDeltaNet
from .qwen3_next import Model as Qwen3NextModel
from .qwen3_next import ModelArgs as Qwen3NextArgs
from .wrapper import text_config, unwrap

# Checkpoint prefixes of the language model (mlx-community, transformers) and what is not text.
_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
_NOT_TEXT = ("model.visual.", "visual.", "vision_tower.", "mtp.", "model.mtp.")
WRAPPERS = ("qwen3_5", "qwen3_5_moe")


@dataclass
class ModelArgs(Qwen3NextArgs):
    # transformers' Qwen3_5TextConfig defaults.
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    intermediate_size: int = 12_288
    vocab_size: int = 248_320
    num_key_value_heads: int | None = 4
    num_experts: int | None = 0

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        return super().from_dict(text_config(config))

    def sparse(self, layer: int) -> bool:
        return False


class DeltaNet(GatedDeltaNet):
    """Qwen3.5's projections: q|k|v, z, b and a each on their own."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        dim = args.hidden_size
        self.in_proj_qkv = nn.Linear(dim, 2 * self.key_dim + self.value_dim, bias=False)
        self.in_proj_z = nn.Linear(dim, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(dim, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(dim, self.num_v_heads, bias=False)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        B, L, _ = x.shape
        z = self.in_proj_z(x).reshape(B, L, self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)


class Model(Qwen3NextModel):
    delta_net: ClassVar[type[GatedDeltaNet]] = DeltaNet

    def rename(self, name: str) -> str | None:
        name = unwrap(name, _PREFIXES, _NOT_TEXT)
        return None if name is None else super().rename(name)

    def mlx_lm_layout(
        self, config: dict[str, Any], weights: dict[str, mx.array]
    ) -> tuple[dict[str, Any], dict[str, mx.array]]:
        """mlx-lm knows the wrappers' types (`qwen3_5`, `qwen3_5_moe`), which read a text
        config at the top level too, and holds their modules under `language_model.`: a text
        type is written as its wrapper, the weights and per-module quantization under mlx-lm's
        paths (mlx-community's layout, which `rename` reads back)."""
        config = {**config, "model_type": config["model_type"].removesuffix("_text")}
        for key in ("quantization", "quantization_config"):
            if isinstance(config.get(key), dict):
                config[key] = {
                    _mlx_lm_path(k) if isinstance(v, dict) else k: v for k, v in config[key].items()
                }
        return config, {_mlx_lm_path(k): v for k, v in weights.items()}


def _mlx_lm_path(module: str) -> str:
    return module if module.startswith("language_model.") else f"language_model.{module}"
