"""Tensor parallelism over an `mx.distributed` group (what `mlx.launch` starts).

`shard(model, group)` splits every decoder layer Megatron-style, as mlx-lm does: q/k/v and
gate/up project to this rank's heads and MLP columns (all-to-sharded), o/down project back and
all-sum across ranks (sharded-to-all), so each layer costs two all-reduces of (B, L, hidden).
Phi-3's fused qkv_proj and gate_up_proj are split per part, so each rank keeps matching q, k, v
heads and gate/up columns. Embeddings, norms and lm_head stay whole on every rank. The
attention modules' head counts become per-rank, so the KV cache (shaped by the keys written
into it) holds only this rank's heads and truncates as before.

Decoding runs unchanged on every rank: drafters, acceptance and sampling run identically
everywhere, from the same seed and the same all-summed logits, so their decisions agree without
being sent. Two things are not deterministic by themselves and are taken from rank 0: the
sampling seed when none is given (`shared_seed`) and the adaptive draft length, which follows
measured timings (`SharedPolicy`, one scalar all-sum per step). Only rank 0 prints.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.layers.distributed import shard_linear
from mlx.utils import tree_flatten

from . import cli
from .device import GENERATION_STREAM
from .pipeline import split_layers
from .policy import Policy
from .ranks import DEFAULT_TIMEOUT, check_same_model, drafter_digest

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
        """Splits `model` in place; its weights stay lazy (`load` reads this rank's part)."""
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every CLI that runs under `mlx.launch` takes (generate, server)."""
    parser.add_argument(
        "--parallel",
        choices=PARALLEL_MODES,
        default="tensor",
        help="under mlx.launch: how the target is split across ranks (default: tensor)",
    )
    parser.add_argument(
        "--rank-timeout",
        type=cli.bounded(float, lambda v: v > 0, "a positive number of seconds"),
        default=DEFAULT_TIMEOUT,
        help="under mlx.launch: end with an error when no step finishes in this many seconds "
        f"(a rank died or hangs; default {DEFAULT_TIMEOUT:g})",
    )


def init_group() -> mx.distributed.Group | None:
    """The group `mlx.launch` set up, or None when this process runs alone."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def from_rank0(value: int, group: mx.distributed.Group) -> int:
    """Rank 0's int32 `value` on every rank (one scalar all-sum). It runs on the generation
    stream, after the step queued there: that step's own collectives must meet the other
    ranks' in the same order, which a second stream would race."""
    mine = mx.array(value if group.rank() == 0 else 0, mx.int32)
    return int(mx.distributed.all_sum(mine, group=group, stream=GENERATION_STREAM).item())


def shared_seed(seed: int | None, group: mx.distributed.Group) -> int:
    """`seed`, or one rank 0 drew: every rank must sample with the same one."""
    if seed is not None:
        return seed
    return from_rank0(int(np.random.default_rng().integers(2**31)), group)


def rank0_says(flag: bool, group: mx.distributed.Group) -> bool:
    """Rank 0's `flag` on every rank: calibrating a sharded target times its forwards, and
    every choice that follows a timing must be the same on all ranks (they run the forwards
    together)."""
    return bool(from_rank0(int(flag), group))


class SharedPolicy:
    """A draft-length policy whose choice is rank 0's: the adaptive policy times each step, and
    ranks that drafted different lengths would run forwards of different shapes."""

    def __init__(self, policy: Policy, group: mx.distributed.Group):
        self.policy = policy
        self.group = group

    def choose(self) -> int:
        return from_rank0(self.policy.choose() if self.group.rank() == 0 else 0, self.group)

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        self.policy.observe(drafted, accepted, seconds)


def check_shardable(model: nn.Module, size: int) -> None:
    """ValueError naming what does not divide by `size` (head counts, intermediate size)."""
    args = model.args
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


def shared_spec(spec, model: nn.Module, group: mx.distributed.Group):
    """`spec` resolved (its draft model or heads loaded), checked to be the same on every
    rank: ValueError naming the ranks otherwise (they would draft different tokens)."""
    spec = spec.resolve(model)
    check_same_model(drafter_digest(spec), group, "drafter")
    return spec


def shared_policy(drafter, model: nn.Module, num_draft_tokens: int | None, group) -> Policy:
    """The draft-length policy of `default_policy`, calibrated and chosen by rank 0 when a
    `group` is given (every rank then drafts the same lengths)."""
    from .policy import default_policy

    if group is None:
        return default_policy(drafter, model, num_draft_tokens)
    costs = default_policy(drafter, model, num_draft_tokens, lambda b: rank0_says(b, group))
    return SharedPolicy(costs, group)


def decoding_options(model, tokenizer, spec, group: mx.distributed.Group) -> dict:
    """stream_generate's `drafter`, `policy` (and `typical_acceptance`) for a sharded target:
    the drafter built here so that its policy can be wrapped in a SharedPolicy."""
    if spec is None:
        return {"drafter": None}
    from .drafters import make_drafter

    spec = shared_spec(spec, model, group)
    drafter = make_drafter(spec, model, tokenizer)
    policy = shared_policy(drafter, model, spec.num_draft_tokens, group)
    return {"drafter": drafter, "policy": policy, "typical_acceptance": spec.typical_acceptance}
