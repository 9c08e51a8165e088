"""Read a GGUF file as a Hugging Face-layout checkpoint.

The rest of the package only knows HF parameter names and configs: arch.py maps each
supported llama.cpp architecture onto one, tensors.py reads every tensor type, either
dequantized to float32 or, with `keep_quantization=True`, as MLX quantized triples (exact for
the types MLX's affine quantization holds, quantized again at group size 32 otherwise). The
header is parsed by header.py, the tensor data read straight from the file. Every tensor is
read before an architecture's transform regroups them (split, merged or reordered
projections), and each becomes an MLX array after it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .arch import (
    ARCHITECTURES,
    METADATA_ARRAYS,
    Architecture,
    architecture,
    expected_shape,
    hf_config,
    hf_name,
)
from .header import Header, TensorInfo, read_header, read_metadata
from .tensors import (
    GROUP_SIZE,
    QUANTIZED_PARTS,
    Quantized,
    Value,
    check_type,
    read_tensor,
    take_rows,
)

__all__ = ["ARCHITECTURES", "GGUFCheckpoint", "read_gguf", "read_metadata"]


@dataclass(frozen=True)
class GGUFCheckpoint:
    config: dict[str, Any]  # a HF config.json
    # HF names. Float tensors are float32; kept quantized ones are `<module>.weight` (uint32,
    # packed), `.scales` and `.biases` (float16 where that is exact, else float32).
    weights: dict[str, mx.array]
    chat_template: str | None
    # mlx-lm's config.json "quantization" for the triples (per-module overrides keyed by module
    # path); None when every tensor is float.
    quantization: dict[str, Any] | None = None
    # GGUF type name -> "kept" (exact), "requantized (N-bit)" or "float", for what was read.
    types: dict[str, str] | None = None


def read_gguf(path: str | Path, *, keep_quantization: bool = False) -> GGUFCheckpoint:
    """Read a GGUF file (architectures in arch.ARCHITECTURES) as a HF config plus
    weights under HF names.

    By default every tensor is dequantized to float32, as the `gguf` package does. With
    `keep_quantization`, quantized matrices stay quantized (see gguf_tensors.py); norms and
    float tensors are float32.
    """
    path = Path(path)
    header = read_header(path, METADATA_ARRAYS)
    arch_name = header.metadata.get("general.architecture")
    arch = architecture(header.metadata, path)
    for tensor in header.tensors:
        check_type(tensor.type, tensor.name)
    shapes = {t.name: t.shape for t in header.tensors}
    data = np.memmap(path, dtype=np.uint8, mode="r")
    side = {
        t.name: read_tensor(_raw(data, t), t.type, t.shape, keep=False)
        for t in header.tensors
        if t.name in arch.side_tensors
    }
    config = hf_config(arch_name, header.metadata, shapes, side, path)
    weights, bits, types = _read_weights(header, data, arch, config, path, keep_quantization)
    return GGUFCheckpoint(
        config=config,
        weights=weights,
        chat_template=header.metadata.get("tokenizer.chat_template"),
        quantization=_quantization(bits),
        types=types,
    )


def _raw(data: np.memmap, tensor: TensorInfo) -> np.ndarray:
    return np.asarray(data[tensor.offset : tensor.offset + tensor.nbytes])


def _read_weights(
    header: Header,
    data: np.memmap,
    arch: Architecture,
    config: dict[str, Any],
    path: Path,
    keep: bool,
) -> tuple[dict[str, mx.array], dict[str, int], dict[str, str]]:
    """HF-named weights, the bits of each module kept quantized, and what became of each
    GGUF type."""
    layers = config["num_hidden_layers"]
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    tensors = [t for t in header.tensors if t.name not in arch.side_tensors]
    names = [hf_name(arch, t.name, path) for t in tensors]  # every name checked before reading
    values: dict[str, Value] = {}
    types: dict[str, str] = {}
    for tensor, name in zip(tensors, names, strict=True):
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= layers:
            raise ValueError(
                f"{path}: tensor {tensor.name!r} is past the {layers} layers the metadata states"
            )
        want = expected_shape(name, config, arch)
        if want is not None and tensor.shape != want:
            raise ValueError(
                f"{path}: tensor {tensor.name!r} has shape {tensor.shape}, but the metadata "
                f"implies {want}: the metadata contradicts the tensors"
            )
        module, _, part = name.rpartition(".")
        is_norm = module.endswith("norm")
        value = read_tensor(_raw(data, tensor), tensor.type, tensor.shape, keep and not is_norm)
        n_heads = heads.get(module.rsplit(".", 1)[-1]) if arch.permute_qk else None
        if n_heads is not None:
            value = _unpermute(value, n_heads)
        if isinstance(value, Quantized):
            kind = "kept" if value.exact else f"requantized ({value.bits}-bit)"
        else:
            if is_norm and arch.norm_offset:
                value = value - np.float32(arch.norm_offset)
            kind = "float" if tensor.type.name in ("F32", "F16", "BF16") else "dequantized"
        values[name] = value
        types.setdefault(tensor.type.name, kind)
    seen = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
    if seen != set(range(layers)):
        raise ValueError(
            f"{path}: the metadata states {layers} layers, the tensors hold "
            f"{len(seen)} (blocks {min(seen, default=0)}..{max(seen, default=-1)})"
        )
    if arch.transform is not None:
        try:
            arch.transform(values, config)
        except KeyError as e:  # a tensor the layout needs (a DeltaNet's A_log, ...)
            raise ValueError(f"{path}: tensor for {e.args[0]!r} is missing") from None
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    weights: dict[str, mx.array] = {}
    bits: dict[str, int] = {}
    for name in list(values):
        value = values.pop(name)  # each one freed as it becomes an MLX array
        if isinstance(value, Quantized):
            module = name.removesuffix(".weight")
            bits[module] = value.bits
            for p in QUANTIZED_PARTS:
                weights[f"{module}.{p}"] = mx.array(getattr(value, p))
        else:
            weights[name] = mx.array(value)
    for name in _required_names(config):
        if name not in weights and f"{name.removesuffix('.weight')}.scales" not in weights:
            raise ValueError(f"{path}: tensor for {name!r} is missing")
    return weights, bits, types


def _required_names(config: dict[str, Any]) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config["tie_word_embeddings"]:
        names.append("lm_head.weight")
    return names


def _unpermute(value: Value, n_heads: int) -> Value:
    # llama.cpp stores each head's rotary pairs interleaved, (heads, half, 2, cols); HF keeps the
    # two halves apart, (heads, 2, half, cols). Rows are output features, so this reorders
    # packed quantized weights and their per-row scales and biases alike.
    rows = value.shape[0]
    order = np.arange(rows).reshape(n_heads, rows // n_heads // 2, 2).swapaxes(1, 2).reshape(-1)
    return take_rows(value, order)


def _quantization(bits: dict[str, int]) -> dict[str, Any] | None:
    """mlx-lm's config form: the commonest width at the top, other modules by path."""
    if not bits:
        return None
    default = Counter(bits.values()).most_common(1)[0][0]
    quantization: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default, "mode": "affine"}
    for module, b in bits.items():
        if b != default:
            quantization[module] = {"group_size": GROUP_SIZE, "bits": b, "mode": "affine"}
    return quantization
