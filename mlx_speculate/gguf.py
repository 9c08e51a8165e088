"""Read a Llama-architecture GGUF file as a Hugging Face-layout checkpoint.

The rest of the package only knows HF parameter names, so this module renames llama.cpp's
tensors and undoes llama.cpp's Q/K row permutation. Quantized tensors are either dequantized to
float32 or, with `keep_quantization=True`, kept as MLX quantized triples: MLX's affine
quantization (w = scale * q + bias per group of 32) holds llama.cpp's Q4_0, Q4_1 and Q8_0
exactly. The header (metadata, tensor types) is parsed here, the tensor data read by `mx.load`.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np

SUPPORTED_ARCHITECTURE = "llama"

# mx.load reads these exactly. It fails on most other types, silently rounds BF16, Q2_K, Q4_K and
# Q6_K through float16, and returns no tensors at all from a file holding TQ1_0, TQ2_0 or MXFP4.
_Q = gguf.GGMLQuantizationType
_READABLE_TYPES = (_Q.F32, _Q.F16, _Q.Q4_0, _Q.Q4_1, _Q.Q8_0)
_GROUP_SIZE = 32  # llama.cpp's block size for Q4_0/Q4_1/Q8_0

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
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
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_ROPE_SCALING_TYPES = ("linear", "yarn")


@dataclass(frozen=True)
class GGUFCheckpoint:
    config: dict[str, Any]  # a HF LlamaForCausalLM config.json
    # HF names, lazy. Float tensors are float32; kept quantized ones are `<module>.weight`
    # (uint32, packed), `.scales` and `.biases` (float16, as stored in the file).
    weights: dict[str, mx.array]
    chat_template: str | None
    # mlx-lm's config.json "quantization" for the kept triples (per-module overrides keyed by
    # module path); None when every tensor is float.
    quantization: dict[str, Any] | None = None


def read_gguf(path: str | Path, *, keep_quantization: bool = False) -> GGUFCheckpoint:
    """Read a Llama GGUF file as a HF config plus weights under HF names.

    By default every tensor is dequantized to float32. With `keep_quantization`, Q4_0/Q4_1/Q8_0
    tensors stay quantized (4-bit, 4-bit and 8-bit, group 32: exact) and F32/F16 tensors are
    float32. Other tensor types are refused either way: `mx.load` cannot read them exactly.
    """
    path = Path(path)
    header = _read_header(path)
    arch = header.metadata.get("general.architecture")
    if arch != SUPPORTED_ARCHITECTURE:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {SUPPORTED_ARCHITECTURE!r})"
        )
    config = _config(header, path)
    weights, bits = _read_weights(
        header,
        path,
        config["num_attention_heads"],
        config["num_key_value_heads"],
        keep_quantization,
    )
    return GGUFCheckpoint(
        config=config,
        weights=weights,
        chat_template=header.metadata.get("tokenizer.chat_template"),
        quantization=_quantization(bits),
    )


# -- the header ----------------------------------------------------------------------------------
# gguf.GGUFReader takes seconds on a real file (it builds a numpy view per vocabulary entry);
# walking the header here takes milliseconds. Layout (little-endian, version 2 or 3): magic,
# version, tensor count, metadata count, the metadata (key, type, value), then per tensor its
# name, dimensions (innermost first), type and offset into the aligned data section.


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # outermost first, as numpy and MLX order it
    type: gguf.GGMLQuantizationType


@dataclass(frozen=True)
class _Header:
    metadata: dict[str, Any]  # scalars and strings; arrays only when asked for by key
    tensors: list[_Tensor]


_SCALAR_FORMATS = {
    gguf.GGUFValueType.UINT8: "<B",
    gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I",
    gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f",
    gguf.GGUFValueType.BOOL: "<?",
    gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT64: "<d",
}
_STRING, _ARRAY = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY
_DEFAULT_ALIGNMENT = 32


def read_metadata(path: str | Path, arrays: Collection[str] = ()) -> dict[str, Any]:
    """The file's metadata: scalars and strings, plus the arrays named (a vocabulary, say)."""
    return _read_header(Path(path), arrays).metadata


def _read_header(path: Path, arrays: Collection[str] = ()) -> _Header:
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _HeaderParser(data, arrays).parse()
    except (ValueError, struct.error, UnicodeDecodeError) as e:  # bad magic, truncation, ...
        raise ValueError(f"{path} is not a valid GGUF file: {e}") from e


class _HeaderParser:
    def __init__(self, data: mmap.mmap, arrays: Collection[str] = ()) -> None:
        self.data, self.pos = data, 0
        self.arrays = set(arrays)  # keys whose array values are kept; others are skipped

    def parse(self) -> _Header:
        magic = bytes(self.data[:4])
        if magic != b"GGUF":
            raise ValueError(f"magic {magic!r} is not b'GGUF'")
        self.pos = 4
        version = self.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"version {version} is not supported (supported: 2, 3, little-endian)")
        n_tensors, n_metadata = self.unpack("<Q"), self.unpack("<Q")
        metadata = {}
        for _ in range(n_metadata):
            key = self.string()
            value = self.value(gguf.GGUFValueType(self.unpack("<I")), key in self.arrays)
            if value is not None:
                metadata[key] = value
        infos = []
        for _ in range(n_tensors):
            name = self.string()
            dims = [self.unpack("<Q") for _ in range(self.unpack("<I"))]
            infos.append((name, tuple(reversed(dims)), _Q(self.unpack("<I")), self.unpack("<Q")))
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        start = -(-self.pos // alignment) * alignment
        for name, shape, kind, offset in infos:
            block, size = gguf.GGML_QUANT_SIZES[kind]
            end = start + offset + math.prod(shape) // block * size
            if end > len(self.data):
                raise ValueError(
                    f"tensor {name!r} ends at byte {end}, past the end of the file "
                    f"({len(self.data)} bytes): truncated"
                )
        tensors = [_Tensor(name, shape, kind) for name, shape, kind, _ in infos]
        return _Header(metadata, tensors)

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = self.data[self.pos : self.pos + n]
        if len(raw) != n:
            raise ValueError("string runs past the end of the file")
        self.pos += n
        return raw.decode("utf-8")

    def value(self, kind: gguf.GGUFValueType, keep: bool = False) -> Any:
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            return self.unpack(_SCALAR_FORMATS[kind])
        item, count = gguf.GGUFValueType(self.unpack("<I")), self.unpack("<Q")
        if keep and item == _STRING:
            return [self.string() for _ in range(count)]
        if keep and item in _SCALAR_FORMATS:
            fmt = f"<{count}{_SCALAR_FORMATS[item][1:]}"
            values = list(struct.unpack_from(fmt, self.data, self.pos))
            self.pos += struct.calcsize(fmt)
            return values
        if item in _SCALAR_FORMATS:
            self.pos += count * struct.calcsize(_SCALAR_FORMATS[item])
        elif item == _STRING:
            data, pos = self.data, self.pos
            for _ in range(count):  # the hot loop: ~100k vocabulary strings and merges
                pos += 8 + struct.unpack_from("<Q", data, pos)[0]
            self.pos = pos
        else:
            for _ in range(count):
                self.value(item)
        return None


# -- the tensors ---------------------------------------------------------------------------------


def _read_weights(
    header: _Header, path: Path, n_heads: int, n_kv_heads: int, keep_quantization: bool
) -> tuple[dict[str, mx.array], dict[str, int]]:
    """HF-named weights, and the bits of each module kept quantized."""
    for tensor in header.tensors:
        if tensor.type not in _READABLE_TYPES:
            readable = ", ".join(t.name for t in _READABLE_TYPES)
            raise ValueError(
                f"{path}: tensor {tensor.name!r} has GGUF type {tensor.type.name}, "
                f"which cannot be read (readable: {readable})"
            )
    names = [_hf_name(path, tensor.name) for tensor in header.tensors]
    try:
        arrays = mx.load(str(path))
    except (RuntimeError, ValueError) as e:  # e.g. metadata arrays nested twice
        raise ValueError(f"{path} is not a valid GGUF file: {e}") from e
    weights: dict[str, mx.array] = {}
    bits: dict[str, int] = {}
    for tensor, name in zip(header.tensors, names, strict=True):
        module = name.removesuffix(".weight")
        base = tensor.name.removesuffix(".weight")
        if keep_quantization and f"{base}.scales" in arrays:
            parts = {p: arrays[f"{base}.{p}"] for p in ("weight", "scales", "biases")}
            # Each group of 32 values packs into `bits` uint32 words.
            bits[module] = parts["weight"].shape[-1] // parts["scales"].shape[-1]
        else:
            parts = {"weight": _dequantize(arrays, tensor.name)}
        heads = {"q_proj": n_heads, "k_proj": n_kv_heads}.get(module.rsplit(".", 1)[-1])
        for part, array in parts.items():
            weights[f"{module}.{part}"] = array if heads is None else _unpermute(array, heads)
    return weights, bits


def _hf_name(path: Path, name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None or match[2] not in _LAYER_NAMES:
        raise ValueError(f"{path}: tensor {name!r} has no LlamaForCausalLM counterpart")
    return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.weight"


def _dequantize(arrays: dict[str, mx.array], name: str) -> mx.array:
    base = name.removesuffix(".weight")
    if f"{base}.scales" not in arrays:
        return arrays[name].astype(mx.float32)
    packed, scales, biases = arrays[name], arrays[f"{base}.scales"], arrays[f"{base}.biases"]
    # float32 scales keep it exact.
    return mx.dequantize(
        packed,
        scales.astype(mx.float32),
        biases.astype(mx.float32),
        group_size=_GROUP_SIZE,
        bits=packed.shape[-1] // scales.shape[-1],
    )


def _unpermute(weight: mx.array, n_heads: int) -> mx.array:
    # llama.cpp stores each head's rotary pairs interleaved, (heads, half, 2, cols); HF keeps the
    # two halves apart, (heads, 2, half, cols). Rows are output features, so this applies as is
    # to packed quantized weights and to their per-row scales and biases.
    rows, cols = weight.shape
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _quantization(bits: dict[str, int]) -> dict[str, Any] | None:
    """mlx-lm's config form: the commonest width at the top, other modules by path."""
    if not bits:
        return None
    default = Counter(bits.values()).most_common(1)[0][0]
    quantization: dict[str, Any] = {"group_size": _GROUP_SIZE, "bits": default, "mode": "affine"}
    for module, b in bits.items():
        if b != default:
            quantization[module] = {"group_size": _GROUP_SIZE, "bits": b, "mode": "affine"}
    return quantization


# -- the config ----------------------------------------------------------------------------------


def _float32(value: float) -> float:
    # GGUF stores floats as float32: take the shortest decimal that rounds to it (1e-05, not
    # 9.999999747378752e-06), which is what the original config held.
    return float(str(np.float32(value)))


def _config(header: _Header, path: Path) -> dict[str, Any]:
    metadata = header.metadata

    def required(key: str) -> Any:
        if key not in metadata:
            raise ValueError(f"{path}: GGUF metadata key {key!r} is missing")
        return metadata[key]

    embedding = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ValueError(f"{path}: tensor 'token_embd.weight' is missing")

    hidden = required("llama.embedding_length")
    n_heads = required("llama.attention.head_count")
    head_dim = metadata.get("llama.attention.key_length", hidden // n_heads)
    rope_dim = metadata.get("llama.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(
            f"{path}: rotary dimension {rope_dim} differs from head dimension {head_dim}, "
            "which LlamaForCausalLM does not support"
        )
    rope_theta = _float32(metadata.get("llama.rope.freq_base", 10000.0))
    scaling = _rope_scaling(metadata, path)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": required("llama.feed_forward_length"),
        "num_hidden_layers": required("llama.block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": metadata.get("llama.attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _float32(required("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", **scaling, "rope_theta": rope_theta},
        "max_position_embeddings": required("llama.context_length"),
        "vocab_size": embedding.shape[0],
        "tie_word_embeddings": all(t.name != "output.weight" for t in header.tensors),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
    }
    if scaling:
        config["rope_scaling"] = scaling  # the pre-5.0 transformers spelling
    return config


def _rope_scaling(metadata: dict[str, Any], path: Path) -> dict[str, Any]:
    kind = metadata.get("llama.rope.scaling.type", "none")
    if kind == "none":
        return {}
    if kind not in _ROPE_SCALING_TYPES:
        raise ValueError(
            f"{path}: rope scaling {kind!r} is not supported (supported: {_ROPE_SCALING_TYPES})"
        )
    if "llama.rope.scaling.factor" not in metadata:
        raise ValueError(f"{path}: GGUF metadata key 'llama.rope.scaling.factor' is missing")
    scaling = {"rope_type": kind, "factor": _float32(metadata["llama.rope.scaling.factor"])}
    original = metadata.get("llama.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling
