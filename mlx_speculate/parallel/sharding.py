"""Splitting a target over an `mx.distributed` group (what `mlx.launch` starts).

Tensor parallel: `shard(model, group)` splits every decoder layer Megatron-style, as mlx-lm
does: q/k/v and gate/up project to this rank's heads and MLP columns (all-to-sharded), o/down
project back and all-sum across ranks (sharded-to-all), so each layer costs two all-reduces of
(B, L, hidden). Phi-3's fused qkv_proj and gate_up_proj are split per part, so each rank keeps
matching q, k, v heads and gate/up columns. Embeddings, norms and lm_head stay whole on every
rank. The attention modules' head counts become per-rank, so the KV cache (shaped by the keys
written into it) holds only this rank's heads and truncates as before. Pipeline parallel gives
each rank a block of layers (pipeline.py). `Split` names either for `load`, which sits above
this module and reads only this rank's part.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear
from mlx.utils import tree_flatten

from ..graphs import build_in_place
from .pipeline import split_layers

PARALLEL_MODES = ("tensor", "pipeline")


@dataclass(frozen=True)
class Split:
    """How a target is spread over `group` (what `mlx.launch` started): `tensor` splits every
    layer's heads and MLP columns (two all-sums per layer), `pipeline` gives each rank a block
    of layers (pipeline.py: one send per rank boundary, the ranks compute in turn)."""

    group: mx.distributed.Group
    mode: str = "tensor"

    def __post_init__(self):
        if self.mode not in PARALLEL_MODES:
            raise ValueError(
                f"parallel mode {self.mode!r} is not supported (supported: "
                f"{', '.join(PARALLEL_MODES)})"
            )

    def apply(self, model: nn.Module) -> nn.Module:
        """Splits `model` in place; its weights stay lazy (`load` reads this rank's part).
        Graphs are built in place from then on (`graphs.build_in_place`)."""
        build_in_place()
        if self.mode == "pipeline":
            return split_layers(model, self.group)
        return shard(model, self.group)

    def describe(self, model: nn.Module) -> str:
        mb = weight_bytes(model) / 1e6
        ranks = self.group.size()
        return (
            f"Sharded: {self.mode} parallel over {ranks} ranks, {mb:.1f} MB of weights on "
            f"this rank (peak memory {mx.get_peak_memory() / 1e6:.1f} MB after loading)"
        )


# The families whose every layer has the dense attention and MLP projections split above.
TENSOR_PARALLEL = (
    "llama",
    "mistral",
    "ministral",
    "ministral3",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma2",
    "gemma3_text",
    "gemma3",
)


def check_shardable(model: nn.Module, size: int) -> None:
    """ValueError naming what does not divide by `size` (head counts, intermediate size), or
    a family whose layers tensor parallelism does not split (experts, recurrent or shared-key
    layers)."""
    args = model.args
    if args.model_type not in TENSOR_PARALLEL:
        raise ValueError(
            f"tensor parallel does not split {args.model_type} models (it splits "
            f"{', '.join(TENSOR_PARALLEL)}): use --parallel pipeline"
        )
    counts = {
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "intermediate_size": args.intermediate_size,
    }
    for name, value in counts.items():
        if value % size:
            raise ValueError(
                f"cannot shard over {size} ranks: {name}={value} does not divide by {size}"
            )


def _column(layer: nn.Module, group, segments=1) -> nn.Module:
    return shard_linear(layer, "all-to-sharded", segments=segments, group=group)


def _row(layer: nn.Module, group) -> nn.Module:
    return shard_linear(layer, "sharded-to-all", group=group)


def _check_quantized_row(layer: nn.Module, size: int, name: str) -> None:
    """A quantized row-parallel layer splits its input dims in whole quantization groups."""
    group_size = getattr(layer, "group_size", None)
    if group_size is None:
        return
    inputs = layer.scales.shape[-1] * group_size
    if (inputs // size) % group_size:
        raise ValueError(
            f"cannot shard {name} over {size} ranks: {inputs // size} inputs per rank is not a "
            f"multiple of the quantization group size {group_size}"
        )


def _shard_attention(attn: nn.Module, group) -> None:
    size = group.size()
    _check_quantized_row(attn.o_proj, size, "o_proj")
    if hasattr(attn, "qkv_proj"):  # Phi-3: [q | k | v] rows, split each part across ranks
        q_end = attn.n_heads * attn.head_dim
        k_end = q_end + attn.n_kv_heads * attn.head_dim
        attn.qkv_proj = _column(attn.qkv_proj, group, [q_end, k_end])
    else:
        attn.q_proj = _column(attn.q_proj, group)
        attn.k_proj = _column(attn.k_proj, group)
        attn.v_proj = _column(attn.v_proj, group)
    attn.o_proj = _row(attn.o_proj, group)
    attn.n_heads //= size
    attn.n_kv_heads //= size


def _shard_mlp(mlp: nn.Module, group) -> None:
    _check_quantized_row(mlp.down_proj, group.size(), "down_proj")
    if hasattr(mlp, "gate_up_proj"):  # Phi-3: [gate | up] rows
        mlp.gate_up_proj = _column(mlp.gate_up_proj, group, 2)
    else:
        mlp.gate_proj = _column(mlp.gate_proj, group)
        mlp.up_proj = _column(mlp.up_proj, group)
    mlp.down_proj = _row(mlp.down_proj, group)


def shard(model: nn.Module, group: mx.distributed.Group) -> nn.Module:
    """Split `model` (any family of the package) in place across `group` (tensor parallel);
    returns it. ValueError when a head count or the intermediate size does not divide. The
    slices stay lazy: `load` evaluates them one at a time, reading only this rank's part."""
    size = group.size()
    if size == 1:
        return model
    check_shardable(model, size)
    for layer in model.layers:
        _shard_attention(layer.self_attn, group)
        _shard_mlp(layer.mlp, group)
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
