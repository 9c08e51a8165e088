"""One checkpoint reader and writer and one way to build a module from weights, for models and
heads alike.

Weights come from safetensors files (read by MLX) or from PyTorch pickles (`.bin`, `.pt`: the
format of official Medusa and EAGLE releases; reading them needs torch). A module is built by
`load_into`: quantize the layers the weights store quantized (mlx-lm's rule), cast floating-point
tensors, load strictly (every parameter present, nothing extra) and evaluate.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

TORCH_SUFFIXES = (".bin", ".pt", ".pth")


def read_weights(files: Sequence[Path]) -> dict[str, mx.array]:
    """Every tensor of `files` (safetensors, or torch pickles by suffix), merged in order."""
    weights: dict[str, mx.array] = {}
    for file in files:
        file = Path(file)
        if file.suffix in TORCH_SUFFIXES:
            weights.update(_read_torch(file))
            continue
        try:
            weights.update(mx.load(str(file)))
        except Exception as e:  # mlx raises RuntimeError/ValueError for unreadable files
            raise ValueError(f"cannot read {file} (corrupt or not safetensors): {e}") from e
    return weights


def write_safetensors(path: Path, weights: dict[str, mx.array]) -> None:
    """MLX's safetensors writer, with mlx-lm's metadata; a failed write is an OSError."""
    try:
        mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    except RuntimeError as e:  # MLX's "[write] Unable to write N bytes to file."
        raise OSError(f"cannot write {path} (is the disk full?): {e}") from e


def _read_torch(path: Path) -> dict[str, mx.array]:
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            f"{path} is a PyTorch checkpoint and reading it needs torch, which is not installed "
            "(pip install torch), or give a .safetensors file instead"
        ) from e
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zip and torch errors alike
        raise ValueError(f"cannot read {path} (corrupt or not a PyTorch checkpoint): {e}") from e
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a dictionary of tensors")
    out = {}
    for key, tensor in state.items():
        if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16
            out[key] = mx.array(tensor.float().numpy()).astype(mx.bfloat16)
        else:
            out[key] = mx.array(tensor.numpy())
    return out


def quantize_predicate(quantization: dict[str, Any], weights: dict[str, mx.array]):
    """mlx-lm's rule: a module is quantized when its `.scales` are stored; overrides by path."""

    def predicate(module_path: str, module: nn.Module):
        override = quantization.get(module_path)
        if isinstance(override, dict):
            return override
        if override is False:
            return False
        return f"{module_path}.scales" in weights

    return predicate


def quantize_model(module: nn.Module, bits: int, group_size: int) -> dict[str, Any]:
    """Affine quantization in place by mlx-lm's rule: Linear/Embedding layers whose input
    dimension divides into groups (others, such as norms and odd widths, stay float). Returns
    the config's `quantization` entry."""
    nn.quantize(
        module,
        group_size=group_size,
        bits=bits,
        mode="affine",
        class_predicate=lambda _, m: (
            hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0
        ),
    )
    return {"group_size": group_size, "bits": bits, "mode": "affine"}


def load_into(
    module: nn.Module,
    weights: dict[str, mx.array],
    *,
    quantization: dict[str, Any] | None = None,
    dtype: mx.Dtype | None = None,
    what: str = "the module",
    lazy: bool = False,
) -> nn.Module:
    """Loads `weights` (already in the module's names) into `module` and evaluates it.

    Layers stored quantized become quantized layers first (per `quantization`, mlx-lm's config
    entry); `dtype` casts every floating-point tensor, quantization scales and biases included.
    `what` names the module in the one-line error when the weights do not fit. `lazy` leaves
    memory-mapped weights unread, for a caller that keeps only a part (`evaluate` reads it).
    """
    if quantization is not None:
        nn.quantize(
            module,
            group_size=quantization.get("group_size", 64),
            bits=quantization.get("bits", 4),
            mode=quantization.get("mode", "affine"),
            class_predicate=quantize_predicate(quantization, weights),
        )
    if dtype is not None:
        weights = {
            k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in weights.items()
        }
    try:
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        detail = " ".join(str(e).split())  # mlx lists missing/extra names on new lines
        raise ValueError(f"weights do not fit {what}: {detail}") from e
    if not lazy:
        mx.eval(module.parameters())
    module.eval()
    return module


def evaluate(module: nn.Module) -> None:
    """Reads a lazily loaded module's parameters one at a time, so that reading peaks at one
    whole tensor beside what is kept (nothing else may hold the checkpoint's arrays)."""
    for _, array in tree_flatten(module.parameters()):
        mx.eval(array)
