"""DFlash checkpoints in z-lab's published layout: read (`load_dflash`) and written
(`save_dflash`) so that z-lab's own loaders read what this package trains.

A drafter folder holds `config.json` (an HF Qwen3 config with `architectures:
["DFlashDraftModel"]`, `block_size` (top level in z-lab's first releases, in `dflash_config`
in later ones), `num_target_layers`, and `dflash_config: {target_layer_ids, mask_token_id}`)
and one or more `*.safetensors` files with the keys `fc.weight`, `hidden_norm.weight`,
`layers.N.self_attn.{q,k,v,o}_proj.weight`, `layers.N.self_attn.{q,k}_norm.weight`,
`layers.N.mlp.{gate,up,down}_proj.weight`, `layers.N.{input,post_attention}_layernorm.weight`
and `norm.weight` (no embedding, no lm_head: the target's are used). It may also sit in a
`dflash/` folder beside a model. Only local folders are read: nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ..atomic import move_into_place, staging_folder
from ..checkpoint import load_into, read_weights, write_safetensors
from ..loading import read_json
from ..models.base import CausalLM
from ..models.rope import rope_both_forms
from .dflash import ARCHITECTURE, DFlashConfig, DFlashHead, default_layer_ids

DFLASH_DIR = "dflash"  # a drafter folder beside a model
WEIGHTS = "model.safetensors"
# Config keys that describe the checkpoint, not the draft layers.
_NOT_LAYER = {
    "architectures",
    "auto_map",
    "block_size",
    "dflash_config",
    "num_target_layers",
    "quantization",
    "quantization_config",
    "transformers_version",
    "torch_dtype",
    "dtype",
}
# The layer settings z-lab's MLX loader reads (`load_draft`): written out always.
_SIZES = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
)


def find_dflash(path: str | Path) -> Path:
    """The drafter folder at `path`: the folder itself, or its `dflash/` subfolder."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise FileNotFoundError(f"DFlash drafter folder {str(path)!r} does not exist")
    if not folder.is_dir():
        raise FileNotFoundError(f"DFlash drafter {str(path)!r} is not a folder")
    if not (folder / "config.json").exists() and (folder / DFLASH_DIR).is_dir():
        folder = folder / DFLASH_DIR
    return folder


def read_config(raw: dict[str, Any], where: str) -> DFlashConfig:
    """The drafter config of a z-lab `config.json` (`where` names it in errors)."""
    architectures = raw.get("architectures") or []
    if "DFlash2DraftModel" in architectures:
        raise ValueError(f"{where} is a DFlash 2 drafter, which is not supported (DFlash 1 is)")
    if architectures and ARCHITECTURE not in architectures:
        raise ValueError(f"{where} is not a DFlash drafter (architectures: {architectures})")
    if raw.get("model_type", "qwen3") != "qwen3":
        raise ValueError(
            f"{where} has DFlash layers of model_type {raw['model_type']!r} (supported: qwen3)"
        )
    own = raw.get("dflash_config")
    if not isinstance(own, dict):
        raise ValueError(f"{where} has no dflash_config (target_layer_ids, mask_token_id)")
    block_size = raw.get("block_size", own.get("block_size"))
    if block_size is None:
        raise ValueError(f"{where} has no block_size")
    if own.get("mask_token_id") is None:
        raise ValueError(f"{where} has no dflash_config.mask_token_id")
    layer = {k: v for k, v in raw.items() if k not in _NOT_LAYER}
    target_layers = raw.get("num_target_layers")
    ids = own.get("target_layer_ids")
    if ids is None:
        if target_layers is None or "num_hidden_layers" not in layer:
            raise ValueError(f"{where} names no target_layer_ids and no num_target_layers")
        ids = default_layer_ids(target_layers, layer["num_hidden_layers"])
    if not isinstance(ids, list | tuple):
        raise ValueError(f"{where}: target_layer_ids must be a list, got {ids!r}")
    return DFlashConfig(
        layer=layer,
        block_size=block_size,
        target_layer_ids=tuple(ids),
        mask_token_id=own["mask_token_id"],
        num_target_layers=target_layers,
    )


def load_dflash(path: str | Path, target: CausalLM | None = None) -> DFlashHead:
    """The drafter in the folder at `path` (see the module docstring), computing in the
    target's dtype; with `target`, checked to fit it (a one-line ValueError otherwise)."""
    folder = find_dflash(path)
    config_file = folder / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"DFlash drafter folder {str(folder)!r} has no config.json")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"DFlash drafter folder {str(folder)!r} has no *.safetensors")
    raw = read_json(config_file)
    config = read_config(raw, str(config_file))
    dtype = None if target is None else target.compute_dtype
    head = load_into(
        DFlashHead(config),
        read_weights(files),
        quantization=raw.get("quantization"),
        dtype=dtype,
        what=f"the DFlash drafter at {folder}",
    )
    if target is not None:
        head.check_fits(target)
    return head


def config_json(config: DFlashConfig) -> dict[str, Any]:
    """What z-lab's loaders read (`model.py` through transformers' Qwen3Config, `model_mlx.py`
    key by key): the layers' Qwen3 config with its rope in both forms, and the block
    settings, `block_size` at the top level and in `dflash_config`."""
    if config.num_target_layers is None:
        raise ValueError("a DFlash drafter is saved with num_target_layers (its target's depth)")
    args = config.args
    layers = args.num_hidden_layers
    sliding = args.sliding_layers()
    layer = {
        **rope_both_forms(config.layer),
        **{name: getattr(args, name) for name in _SIZES},
        "attention_bias": args.attention_bias,
        "hidden_act": "silu",
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "use_sliding_window": any(sliding),
        "sliding_window": args.sliding_window if any(sliding) else None,
        "max_window_layers": config.layer.get("max_window_layers", layers),
        "tie_word_embeddings": False,
    }
    return {
        **layer,
        "architectures": [ARCHITECTURE],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": {
            "block_size": config.block_size,
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layer_ids),
        },
        "dtype": "float32",
        "torch_dtype": "float32",
    }


def save_dflash(head: DFlashHead, out: str | Path) -> Path:
    """Writes `head` into a new folder `out` in z-lab's layout (`config.json` +
    `model.safetensors`, float32). Atomic: `out` appears whole or not at all."""
    raw = config_json(head.config)
    weights = {
        k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in tree_flatten(head.parameters())
    }
    out = Path(out)
    tmp = staging_folder(out)
    write_safetensors(tmp / WEIGHTS, weights)
    (tmp / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    move_into_place(tmp, out)
    return out
