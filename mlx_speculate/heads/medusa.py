"""Medusa heads: the MLX module, published checkpoints (Medusa-1) and the MLX heads folder.

Published layout (FasterDecoding/Medusa): `config.json` (`medusa_num_heads`, `medusa_num_layers`,
`base_model_name_or_path`) + `medusa_lm_head.safetensors` or `medusa_lm_head.pt`, keys
`{k}.{j}.linear.weight`, `{k}.{j}.linear.bias`, `{k}.{num_layers}.weight`.

`save_medusa1` writes trained heads in the published layout (`medusa_lm_head.safetensors`).

MLX layout (what `convert_medusa_heads` writes, `medusa/` beside a converted model): the same
config fields plus `hidden_size`, `vocab_size` and, when quantized, mlx-lm's `quantization`;
`weights.safetensors` holding this module's parameter names.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..atomic import move_into_place, staging_folder
from ..checkpoint import load_into, read_weights, write_safetensors
from ..models.base import CausalLM
from ..models.fast_exp import silu
from ..tree import Tree
from .store import MLX_WEIGHTS, find_checkpoint, prepare, save_heads

MEDUSA_DIR = "medusa"  # heads folder inside a converted model folder
PUBLISHED_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
_KEY = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.(.+)$")


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        return x + silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads; head k maps the target's final hidden state to logits for the token k+2 ahead.

    `heads[k]` is `num_layers` independent ResBlocks followed by the vocabulary projection, so
    parameter names are the upstream keys under `heads.`.
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 5, num_layers: int = 1):
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"need >= 1 heads and >= 0 layers, got {num_heads}, {num_layers}")
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.num_layers = num_layers
        self.heads = [
            [ResBlock(hidden_size) for _ in range(num_layers)]
            + [nn.Linear(hidden_size, vocab_size, bias=False)]
            for _ in range(num_heads)
        ]

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    def __call__(self, hidden: mx.array, count: int | None = None) -> mx.array:
        """(..., hidden) -> (count, ..., V) logits of the first `count` heads (default: all)."""
        return mx.stack([self.head(k, hidden) for k in range(count or self.num_heads)])

    def head(self, k: int, hidden: mx.array) -> mx.array:
        """(..., hidden) -> (..., V) logits of head `k`."""
        x = hidden
        for layer in self.heads[k]:
            x = layer(x)
        return x

    def config(self) -> dict[str, Any]:
        return {
            "medusa_num_heads": self.num_heads,
            "medusa_num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }

    # The draft head protocol (heads/base.py): Medusa reads the final state and keeps no cache.
    def taps(self, num_layers: int) -> tuple[int, ...]:
        return ()

    def inputs(self, hidden: mx.array, taps: Sequence[mx.array]) -> mx.array:
        return hidden

    def make_cache(self) -> None:
        return None

    def to_target(self, ids: mx.array) -> mx.array:
        return ids

    def check_fits(self, target: CausalLM) -> tuple[int, ...]:
        self.check_sizes(target.args.hidden_size, target.args.vocab_size)
        return ()

    def check_sizes(self, hidden_size: int, vocab_size: int) -> None:
        if self.hidden_size != hidden_size:
            raise ValueError(
                f"Medusa heads read hidden size {self.hidden_size}, the target's is {hidden_size}"
            )
        if self.vocab_size != vocab_size:
            raise ValueError(
                f"Medusa heads predict a vocabulary of {self.vocab_size}, the target's is "
                f"{vocab_size}"
            )


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Upstream keys (optionally under `medusa_head.`) -> this module's names."""
    out = {}
    for key, value in weights.items():
        if key.startswith("heads."):
            out[key] = value
            continue
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"unexpected key {key!r} in a Medusa checkpoint")
        out["heads." + ".".join(match.groups())] = value
    return out


def _shape(weights: dict[str, mx.array]) -> tuple[int, int, int, int]:
    """(num_heads, num_layers, hidden, vocab) read off the tensors."""
    heads: dict[int, set[int]] = {}
    for key in weights:
        _, k, j, _ = key.split(".", 3)
        heads.setdefault(int(k), set()).add(int(j))
    if not heads or sorted(heads) != list(range(len(heads))):
        raise ValueError(f"Medusa heads are not numbered 0..K-1: {sorted(heads)}")
    depths = {len(layers) for layers in heads.values()}
    if len(depths) != 1:
        raise ValueError(f"Medusa heads have different numbers of layers: {sorted(depths)}")
    num_layers = depths.pop() - 1
    proj = weights.get(f"heads.0.{num_layers}.weight")
    scales = weights.get(f"heads.0.{num_layers}.scales")
    if proj is None:
        raise ValueError(f"no vocabulary projection heads.0.{num_layers}.weight")
    vocab = proj.shape[0]
    # A quantized projection packs its input dimension; the block weights or scales give it back.
    block = weights.get("heads.0.0.linear.bias")
    if block is not None:
        hidden = block.shape[0]
    elif scales is None:
        hidden = proj.shape[1]
    else:
        hidden = None
    return len(heads), num_layers, hidden, vocab


def read_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, mx.array]]:
    """(config, sanitized weights) from an MLX heads folder, a published Medusa-1 folder or hub
    id (e.g. FasterDecoding/medusa-vicuna-7b-v1.3), a model folder with `medusa/`, or one weights
    file (its folder's config.json, if any, is read too)."""
    config, file = find_checkpoint(
        path, MEDUSA_DIR, (MLX_WEIGHTS, *PUBLISHED_WEIGHTS), "Medusa heads"
    )
    return config, sanitize(read_weights([file]))


def build_heads(
    config: dict[str, Any], weights: dict[str, mx.array], dtype: mx.Dtype | None = None
) -> MedusaHeads:
    """Heads shaped by the tensors; a config stating another head or layer count gets a warning."""
    num_heads, num_layers, hidden, vocab = _shape(weights)
    hidden = hidden or config.get("hidden_size")
    if hidden is None:
        raise ValueError("cannot tell the hidden size of quantized heads without hidden_size")
    stated = (config.get("medusa_num_heads", 5), config.get("medusa_num_layers", 1))
    for name, said, held in zip(
        ("medusa_num_heads", "medusa_num_layers"), stated, (num_heads, num_layers), strict=True
    ):
        if said != held:
            warnings.warn(
                f"Medusa config says {name} = {said} but the checkpoint holds {held}; using {held}",
                stacklevel=3,
            )
    heads = MedusaHeads(hidden, vocab, num_heads, num_layers)
    return load_into(
        heads,
        weights,
        quantization=config.get("quantization"),
        dtype=dtype,
        what="their own Medusa shapes",
    )


def load_medusa_heads(path: str | Path, model: CausalLM | None = None) -> MedusaHeads:
    """Heads from a heads folder, a published Medusa-1 folder, or a model folder with `medusa/`.

    With `model`, the heads must read its hidden size and predict its vocabulary, and compute
    in its dtype.
    """
    heads = build_heads(*read_checkpoint(path), None if model is None else model.compute_dtype)
    if model is not None:
        heads.check_fits(model)
    return heads


def save_medusa_heads(
    heads: MedusaHeads, folder: str | Path, extra_config: dict[str, Any] | None = None
) -> Path:
    """Writes `config.json` and `weights.safetensors` (MLX layout) into `folder`."""
    return save_heads(heads, folder, {**(extra_config or {}), **heads.config()})


def save_medusa1(heads: MedusaHeads, out: str | Path, base_model: str = "") -> Path:
    """Writes `heads` into a new folder `out` in the published Medusa-1 layout (keys
    `{k}.{j}.linear.weight`, ...; float32); atomic: `out` appears whole or not at all."""
    out = Path(out)
    weights = {
        k.removeprefix("heads."): v.astype(mx.float32) for k, v in tree_flatten(heads.parameters())
    }
    config = {**heads.config(), "base_model_name_or_path": base_model}
    tmp = staging_folder(out)
    write_safetensors(tmp / "medusa_lm_head.safetensors", weights)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    move_into_place(tmp, out)
    return out


def convert_medusa_heads(
    medusa_path: str | Path,
    out: str | Path,
    *,
    model_config: dict[str, Any] | None = None,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    dtype: mx.Dtype | None = None,
) -> Path:
    """Published (or MLX) heads at `medusa_path` -> an MLX heads folder `out`.

    With `model_config`, the heads must fit that model. Quantization follows the model's bits and
    group size: the vocabulary projections hold nearly all of the heads' weights.
    """
    config, weights = read_checkpoint(medusa_path)
    if "quantization" in config:
        raise ValueError(f"Medusa heads at {medusa_path} are already quantized")
    heads = build_heads(config, weights)
    if model_config is not None:
        heads.check_sizes(model_config["hidden_size"], model_config["vocab_size"])
    extra = {k: config[k] for k in ("base_model_name_or_path",) if k in config}
    extra |= prepare(
        heads, quantize=quantize, q_bits=q_bits, q_group_size=q_group_size, dtype=dtype
    )
    return save_medusa_heads(heads, out, extra)


# -- published trees -------------------------------------------------------------------------------
# Medusa's published tree for Vicuna-7B (FasterDecoding/Medusa, medusa/model/medusa_choices.py),
# in its published order: 63 choices, 64 nodes with the root, depth 4. A choice is the path of
# top-k ranks leading to a node: (0, 1) is the second-best token of head 1 after the best of head 0.
MC_SIM_7B_63: tuple[tuple[int, ...], ...] = (
    (0,),
    (0, 0),
    (1,),
    (0, 1),
    (2,),
    (0, 0, 0),
    (1, 0),
    (0, 2),
    (3,),
    (0, 3),
    (4,),
    (0, 4),
    (2, 0),
    (0, 5),
    (0, 0, 1),
    (5,),
    (0, 6),
    (6,),
    (0, 7),
    (0, 1, 0),
    (1, 1),
    (7,),
    (0, 8),
    (0, 0, 2),
    (3, 0),
    (0, 9),
    (8,),
    (9,),
    (1, 0, 0),
    (0, 2, 0),
    (1, 2),
    (0, 0, 3),
    (4, 0),
    (2, 1),
    (0, 0, 4),
    (0, 0, 5),
    (0, 0, 0, 0),
    (0, 1, 1),
    (0, 0, 6),
    (0, 3, 0),
    (5, 0),
    (1, 3),
    (0, 0, 7),
    (0, 0, 8),
    (0, 0, 9),
    (6, 0),
    (0, 4, 0),
    (1, 4),
    (7, 0),
    (0, 1, 2),
    (2, 0, 0),
    (3, 1),
    (2, 2),
    (8, 0),
    (0, 5, 0),
    (1, 5),
    (1, 0, 1),
    (0, 2, 1),
    (9, 0),
    (0, 6, 0),
    (0, 0, 0, 1),
    (1, 6),
    (0, 7, 0),
)

# The published order lists every path after its parent (checked in tests), so each prefix of it
# is again a valid tree; the smaller trees below are such prefixes.
MEDUSA_TREES: dict[str, tuple[tuple[int, ...], ...]] = {
    "mc_sim_7b_63": MC_SIM_7B_63,
    "mc_sim_7b_63_prefix19": MC_SIM_7B_63[:19],  # 20 nodes
    "mc_sim_7b_63_prefix6": MC_SIM_7B_63[:6],  # 7 nodes
}
DEFAULT_TREE = "mc_sim_7b_63"


def medusa_tree(choices: Sequence[Sequence[int]]) -> tuple[Tree, tuple[int, ...]]:
    """The tree of `choices` and each node's top-k rank (the root's is -1): node i, at depth d,
    holds head d-1's rank-th most likely token."""
    tree = Tree.from_paths(choices)
    ordered = sorted((tuple(c) for c in choices), key=lambda p: (len(p), p))  # from_paths' order
    return tree, (-1, *(path[-1] for path in ordered))
