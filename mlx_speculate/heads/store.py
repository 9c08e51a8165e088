"""Where head checkpoints live and how MLX heads folders are written (Medusa and EAGLE alike).

An MLX heads folder holds `config.json` (the head's config, plus mlx-lm's `quantization` when
quantized) and `weights.safetensors` in the module's parameter names; `convert` writes it as a
subfolder (`medusa/`, `eagle/`) of the converted model, where `load` finds it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from ..checkpoint import quantize_model, write_safetensors
from ..loading import read_json, resolve_path

MLX_WEIGHTS = "weights.safetensors"


def find_checkpoint(
    path: str | Path, subfolder: str, files: Sequence[str], what: str
) -> tuple[dict[str, Any], Path]:
    """(config, weights file) of heads at `path`: a weights file, a heads folder, a model folder
    with the heads in `subfolder`, or a hub id (fetched). The first of `files` present wins."""
    given = Path(path).expanduser()
    if given.is_file():
        folder, file = given.parent, given
    else:
        try:
            folder = resolve_path(path, allow_patterns=["config.json", *files])
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{what}: {e}") from e
        if (folder / subfolder).is_dir():
            folder = folder / subfolder
        if not folder.is_dir():
            raise FileNotFoundError(f"{what} folder {str(folder)!r} is not a folder")
        found = [folder / name for name in files if (folder / name).exists()]
        if not found:
            raise FileNotFoundError(
                f"no {what} weights in {folder} (looked for {', '.join(files)}; "
                "`python -m mlx_speculate.train --help` says how to train them)"
            )
        file = found[0]
    config_file = folder / "config.json"
    return (read_json(config_file) if config_file.exists() else {}), file


def prepare(
    module: nn.Module,
    *,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    dtype: mx.Dtype | None = None,
) -> dict[str, Any]:
    """Casts floating-point parameters to `dtype` and quantizes (mlx-lm's rule) in place; returns
    the config entries that record it."""
    if dtype is not None:
        module.update(
            tree_map(
                lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a,
                module.parameters(),
            )
        )
    if not quantize:
        return {}
    settings = quantize_model(module, q_bits, q_group_size)
    return {"quantization": dict(settings), "quantization_config": dict(settings)}


def save_heads(module: nn.Module, folder: str | Path, config: dict[str, Any]) -> Path:
    """Writes `config.json` and `weights.safetensors` (MLX layout) into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / MLX_WEIGHTS, dict(tree_flatten(module.parameters())))
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder
