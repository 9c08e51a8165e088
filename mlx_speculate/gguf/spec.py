"""What a llama.cpp architecture is to the reader: the data each family's table fills in.

An `Architecture` names the HF model class a `general.architecture` maps to, its block tensor
names as HF parameter names, the config keys its metadata holds beyond the common ones, and
the changes llama.cpp's converter made to the weights, to be undone (arch.py applies them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .tensors import Value

# GGUF metadata, the config built so far, GGUF tensor name -> shape, the file (for errors).
ExtraConfig = Callable[[dict[str, Any], dict[str, Any], dict[str, tuple[int, ...]], Path], dict]
# HF-named tensors as read (float32 or quantized) and the config; rewrites them in place.
Transform = Callable[[dict[str, Value], dict[str, Any]], None]
# The config so far and the side tensors (float32); completes the config in place.
SideConfig = Callable[[dict[str, Any], dict[str, np.ndarray]], None]

LLAMA_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


@dataclass(frozen=True)
class Architecture:
    model_type: str
    hf_class: str
    layer_names: dict[str, str]  # GGUF block tensor -> HF module in the layer (.weight/.bias)
    extra_config: ExtraConfig
    # GGUF block tensor with its suffix, if any ("ssm_dt.bias", "ssm_a") -> HF parameter.
    layer_params: dict[str, str] = field(default_factory=dict)
    permute_qk: bool = False
    norm_offset: float = 0.0  # HF weight = stored - offset, for every *norm weight
    side_tensors: tuple[str, ...] = ()  # GGUF tensors read into the config, not weights
    partial_rotary: bool = False  # rope.dimension_count may be below the head size
    query_gate: bool = False  # q_proj holds queries and a per-head output gate: twice as wide
    transform: Transform | None = None
    global_names: dict[str, str] = field(default_factory=dict)  # GGUF -> HF module, off-block
    side_config: SideConfig | None = None  # reads side tensors other than Phi-3's longrope
    # Head sizes or MLP widths differ between layers (Gemma 4): their shapes are not checked
    # against the config here, the model checks them as it loads.
    shapes_vary: bool = False
    arrays: tuple[str, ...] = ()  # metadata keys whose array values the header keeps


def none(
    meta: dict[str, Any], config: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: Path
) -> dict[str, Any]:
    return {}


def required(meta: dict[str, Any], key: str, path: Path) -> Any:
    if key not in meta:
        raise ValueError(f"{path}: GGUF metadata key {key!r} is missing")
    return meta[key]


def float32(value: float) -> float:
    # GGUF stores floats as float32: take the shortest decimal that rounds to it (1e-05, not
    # 9.999999747378752e-06), which is what the original config held.
    return float(str(np.float32(value)))


def blocks_with(shapes: dict[str, tuple[int, ...]], tensor: str, layers: int) -> list[bool]:
    """For each block, whether the file holds `blk.{i}.{tensor}` (with or without a suffix)."""
    names = {name.removesuffix(".weight").removesuffix(".bias") for name in shapes}
    return [f"blk.{i}.{tensor}" in names for i in range(layers)]
