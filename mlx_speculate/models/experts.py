"""Mixture-of-experts feed-forward pieces shared by the MoE families (Qwen3-MoE, gpt-oss).

Experts are stored stacked, one (E, out, in) tensor per projection, and each row's top-k
experts are gathered by MLX's `gather_mm` (`gather_qmm` once quantized): every row of a
verified draft routes on its own inside one fixed-shape graph, with no host sync. The stacked
layers are mlx-lm's `SwitchGLU` / `SwitchLinear` (quantized by `nn.quantize` into its
`QuantizedSwitchLinear`), so converted folders keep the names mlx-lm loads.

Checkpoints that store one tensor per expert are stacked at load time (`stack_experts`), each
per-expert tensor dropped from the checkpoint's dict as it is taken, and each stack read at
once: the memory-mapped parts of one stack are all that is held beside the model (reading
every stack in the model's one evaluation would hold all the parts at once).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .fast_exp import silu

__all__ = ["SwitchGLU", "SwiGLU", "stack_experts", "top_k"]


def SwitchGLU(*args, **kwargs) -> nn.Module:  # stands for mlx-lm's class of that name
    """mlx-lm's `SwitchGLU(*args, **kwargs)`, imported when a model builds one: importing the
    mlx_lm package imports transformers and torch, which no CLI's start needs."""
    from mlx_lm.models.switch_layers import SwitchGLU

    return SwitchGLU(*args, **kwargs)


class SwiGLU(nn.Module):
    """silu(gate) * up, in SwitchGLU's argument order (up, gate)."""

    def __call__(self, up: mx.array, gate: mx.array) -> mx.array:
        return silu(gate) * up


def top_k(scores: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The k largest scores along the last axis and their indices (in no particular order:
    every use sums over them)."""
    indices = mx.argpartition(scores, kth=-k, axis=-1)[..., -k:]
    return mx.take_along_axis(scores, indices, axis=-1), indices


def stack_experts(
    weights: dict[str, mx.array], prefix: str, count: int, names: dict[str, str]
) -> None:
    """Replaces `prefix.{e}.{old}` for e < count by one stacked `names[old]` tensor, in place,
    for each `old` of `names` found under `prefix.0.`; ValueError naming a missing expert."""
    for old, new in names.items():
        if f"{prefix}.0.{old}" not in weights:
            continue
        parts = []
        for e in range(count):
            key = f"{prefix}.{e}.{old}"
            if key not in weights:
                raise ValueError(f"the checkpoint has no {key} (the config says {count} experts)")
            parts.append(weights.pop(key))
        weights[new] = mx.stack(parts)
        mx.eval(weights[new])  # read now: the parts are freed before the next stack is read
        del parts
