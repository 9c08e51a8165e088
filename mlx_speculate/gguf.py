"""Read a Llama-architecture GGUF file as a Hugging Face-layout checkpoint.

The rest of the package only knows HF parameter names, so this module renames llama.cpp's
tensors, dequantizes them to float32 and undoes llama.cpp's Q/K row permutation. The header
(metadata, tensor types) comes from the `gguf` package's reader; the tensor data from `mx.load`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
from transformers import AutoTokenizer

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
    weights: dict[str, mx.array]  # HF names, float32 (lazy: evaluated on first use)
    chat_template: str | None


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Read a Llama GGUF file as a HF config plus float32 weights under HF names."""
    path = Path(path)
    reader = _open(path)
    arch = _value(reader, "general.architecture")
    if arch != SUPPORTED_ARCHITECTURE:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {SUPPORTED_ARCHITECTURE!r})"
        )
    config = _config(reader, path)
    return GGUFCheckpoint(
        config=config,
        weights=_read_weights(
            reader, path, config["num_attention_heads"], config["num_key_value_heads"]
        ),
        chat_template=_value(reader, "tokenizer.chat_template"),
    )


def write_gguf_tokenizer(path: str | Path, out_dir: str | Path) -> None:
    """Write the GGUF's tokenizer as HF tokenizer files plus generation_config.json."""
    path, out_dir = Path(path), Path(out_dir)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.save_pretrained(out_dir)
    if tokenizer.chat_template is not None:
        # transformers 5 saves the template only to chat_template.jinja; older loaders read it here.
        config_path = out_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config.setdefault("chat_template", tokenizer.chat_template)
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _open(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError) as e:  # what the reader raises on bad magic or truncation
        raise ValueError(f"{path} is not a valid GGUF file: {e}") from e


def _value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _required(reader: gguf.GGUFReader, path: Path, key: str) -> Any:
    value = _value(reader, key)
    if value is None:
        raise ValueError(f"{path}: GGUF metadata key {key!r} is missing")
    return value


def _float32(value: float) -> float:
    # GGUF stores floats as float32: take the shortest decimal that rounds to it (1e-05, not
    # 9.999999747378752e-06), which is what the original config held.
    return float(str(np.float32(value)))


def _read_weights(
    reader: gguf.GGUFReader, path: Path, n_heads: int, n_kv_heads: int
) -> dict[str, mx.array]:
    for tensor in reader.tensors:
        if tensor.tensor_type not in _READABLE_TYPES:
            readable = ", ".join(t.name for t in _READABLE_TYPES)
            raise ValueError(
                f"{path}: tensor {tensor.name!r} has GGUF type {tensor.tensor_type.name}, "
                f"which cannot be read (readable: {readable})"
            )
    try:
        arrays = mx.load(str(path))
    except RuntimeError as e:
        raise ValueError(f"{path} is not a valid GGUF file: {e}") from e
    weights = {}
    for tensor in reader.tensors:
        name = _hf_name(path, tensor.name)
        weight = _dequantize(arrays, tensor.name)
        if name.endswith("q_proj.weight"):
            weight = _unpermute(weight, n_heads)
        elif name.endswith("k_proj.weight"):
            weight = _unpermute(weight, n_kv_heads)
        weights[name] = weight
    return weights


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
    # Each group of 32 values packs into `bits` uint32 words; float32 scales keep it exact.
    return mx.dequantize(
        packed,
        scales.astype(mx.float32),
        biases.astype(mx.float32),
        group_size=_GROUP_SIZE,
        bits=packed.shape[-1] // scales.shape[-1],
    )


def _unpermute(weight: mx.array, n_heads: int) -> mx.array:
    # llama.cpp stores each head's rotary pairs interleaved, (heads, half, 2, in); HF keeps the
    # two halves apart, (heads, 2, half, in).
    rows, cols = weight.shape
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _config(reader: gguf.GGUFReader, path: Path) -> dict[str, Any]:
    def required(key: str) -> Any:
        return _required(reader, path, f"llama.{key}")

    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ValueError(f"{path}: tensor 'token_embd.weight' is missing")

    hidden = required("embedding_length")
    n_heads = required("attention.head_count")
    head_dim = _value(reader, "llama.attention.key_length", hidden // n_heads)
    rope_dim = _value(reader, "llama.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(
            f"{path}: rotary dimension {rope_dim} differs from head dimension {head_dim}, "
            "which LlamaForCausalLM does not support"
        )
    rope_theta = _float32(_value(reader, "llama.rope.freq_base", 10000.0))
    scaling = _rope_scaling(reader, path)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": required("feed_forward_length"),
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": _value(reader, "llama.attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _float32(required("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", **scaling, "rope_theta": rope_theta},
        "max_position_embeddings": required("context_length"),
        "vocab_size": int(embedding.shape[-1]),  # GGUF lists dimensions innermost first
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "bos_token_id": _value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _value(reader, "tokenizer.ggml.eos_token_id"),
    }
    if scaling:
        config["rope_scaling"] = scaling  # the pre-5.0 transformers spelling
    return config


def _rope_scaling(reader: gguf.GGUFReader, path: Path) -> dict[str, Any]:
    kind = _value(reader, "llama.rope.scaling.type", "none")
    if kind == "none":
        return {}
    if kind not in _ROPE_SCALING_TYPES:
        raise ValueError(
            f"{path}: rope scaling {kind!r} is not supported (supported: {_ROPE_SCALING_TYPES})"
        )
    factor = _required(reader, path, "llama.rope.scaling.factor")
    scaling = {"rope_type": kind, "factor": _float32(factor)}
    original = _value(reader, "llama.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling
