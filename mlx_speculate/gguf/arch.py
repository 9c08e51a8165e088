"""llama.cpp architectures as Hugging Face ones: tensor names, config.json, weight transforms.

Each supported `general.architecture` maps to one HF model class. Its GGUF tensor names become
HF parameter names, its `<arch>.*` metadata an HF config.json, and llama.cpp's changes to the
weights are undone: Llama's Q/K rows are permuted for interleaved rotary pairs
(convert_hf_to_gguf.py, LlamaModel.permute) and Gemma's RMSNorm weights are stored as 1 + w.
Qwen2, Qwen3, Phi-3 and Gemma 3 use half-split rotary pairs as HF does: their rows are as is.
Phi-3 keeps HF's fused qkv_proj and gate_up_proj, and its longrope factors ride as tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_LLAMA_LAYER = {
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
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_SCALING_TYPES = ("linear", "yarn")


@dataclass(frozen=True)
class Architecture:
    model_type: str
    hf_class: str
    layer_names: dict[str, str]  # GGUF block tensor -> HF module inside the layer
    extra_config: Callable[[dict[str, Any], dict[str, Any], Path], dict[str, Any]]
    permute_qk: bool = False
    norm_offset: float = 0.0  # HF weight = stored - offset, for every *norm weight
    side_tensors: tuple[str, ...] = ()  # GGUF tensors read into the config, not weights


def _none(meta: dict[str, Any], config: dict[str, Any], path: Path) -> dict[str, Any]:
    return {}


def _qwen2(meta: dict[str, Any], config: dict[str, Any], path: Path) -> dict[str, Any]:
    return {"use_sliding_window": False}


def _phi3(meta: dict[str, Any], config: dict[str, Any], path: Path) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if "phi3.attention.sliding_window" in meta:
        extra["sliding_window"] = meta["phi3.attention.sliding_window"]
    original = meta.get("phi3.rope.scaling.original_context_length")
    if original is not None:
        extra["original_max_position_embeddings"] = original
    return extra


def _gemma3(meta: dict[str, Any], config: dict[str, Any], path: Path) -> dict[str, Any]:
    layers, hidden, heads = (
        config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads")
    )
    # llama.cpp (llama-model.cpp): every 6th layer global, local rope base 10000, and the
    # query scale 1/sqrt(hidden / heads) for the 27B (62 layers), 1/sqrt(head_dim) otherwise.
    layer_types = [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)
    ]
    scaling = config.get("rope_scaling") or {"rope_type": "default"}
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if layers == 62 else config["head_dim"],
        "sliding_window": _required(meta, "gemma3.attention.sliding_window", path),
        "layer_types": layer_types,
        "rope_local_base_freq": 10000.0,
        "rope_parameters": {
            "full_attention": {**scaling, "rope_theta": config["rope_theta"]},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "use_bidirectional_attention": False,
    }


ARCHITECTURES = {
    "llama": Architecture("llama", "LlamaForCausalLM", _LLAMA_LAYER, _none, permute_qk=True),
    "qwen2": Architecture("qwen2", "Qwen2ForCausalLM", _LLAMA_LAYER, _qwen2),
    "qwen3": Architecture("qwen3", "Qwen3ForCausalLM", {**_LLAMA_LAYER, **_QK_NORMS}, _none),
    "phi3": Architecture(
        "phi3",
        "Phi3ForCausalLM",
        {
            **{k: v for k, v in _LLAMA_LAYER.items() if not k.startswith("attn_")},
            "attn_norm": "input_layernorm",
            "attn_qkv": "self_attn.qkv_proj",
            "attn_output": "self_attn.o_proj",
            "ffn_up": "mlp.gate_up_proj",
        },
        _phi3,
        side_tensors=("rope_factors_long.weight", "rope_factors_short.weight"),
    ),
    "gemma3": Architecture(
        "gemma3_text",
        "Gemma3ForCausalLM",
        {
            **_LLAMA_LAYER,
            **_QK_NORMS,
            "ffn_norm": "pre_feedforward_layernorm",
            "post_attention_norm": "post_attention_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        _gemma3,
        norm_offset=1.0,
    ),
}


def architecture(meta: dict[str, Any], path: Path) -> Architecture:
    name = meta.get("general.architecture")
    if name not in ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {name!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return ARCHITECTURES[name]


def hf_name(arch: Architecture, name: str, path: Path) -> str:
    base, _, suffix = name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix == "weight":
        return f"{_GLOBAL_NAMES[base]}.weight"
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None or match[2] not in arch.layer_names:
        raise ValueError(f"{path}: tensor {name!r} has no {arch.hf_class} counterpart")
    return f"model.layers.{match[1]}.{arch.layer_names[match[2]]}.{match[3]}"


def _required(meta: dict[str, Any], key: str, path: Path) -> Any:
    if key not in meta:
        raise ValueError(f"{path}: GGUF metadata key {key!r} is missing")
    return meta[key]


def _float32(value: float) -> float:
    # GGUF stores floats as float32: take the shortest decimal that rounds to it (1e-05, not
    # 9.999999747378752e-06), which is what the original config held.
    return float(str(np.float32(value)))


def hf_config(
    arch_name: str,
    meta: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
    side: dict[str, np.ndarray],
    path: Path,
) -> dict[str, Any]:
    """The HF config.json the metadata describes (`shapes`: GGUF tensor name -> shape;
    `side`: the side tensors, float32)."""
    arch = ARCHITECTURES[arch_name]

    def key(name: str) -> str:
        return f"{arch_name}.{name}"

    if "token_embd.weight" not in shapes:
        raise ValueError(f"{path}: tensor 'token_embd.weight' is missing")
    hidden = _required(meta, key("embedding_length"), path)
    n_heads = _required(meta, key("attention.head_count"), path)
    head_dim = meta.get(key("attention.key_length"), hidden // n_heads)
    rope_dim = meta.get(key("rope.dimension_count"), head_dim)
    config: dict[str, Any] = {
        "model_type": arch.model_type,
        "architectures": [arch.hf_class],
        "hidden_size": hidden,
        "intermediate_size": _required(meta, key("feed_forward_length"), path),
        "num_hidden_layers": _required(meta, key("block_count"), path),
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta.get(key("attention.head_count_kv"), n_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _float32(_required(meta, key("attention.layer_norm_rms_epsilon"), path)),
        "rope_theta": _float32(meta.get(key("rope.freq_base"), 10000.0)),
        "max_position_embeddings": _required(meta, key("context_length"), path),
        "vocab_size": shapes["token_embd.weight"][0],
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if "tokenizer.ggml.padding_token_id" in meta:
        config["pad_token_id"] = meta["tokenizer.ggml.padding_token_id"]
    if rope_dim != head_dim:
        if arch_name != "phi3":
            raise ValueError(
                f"{path}: rotary dimension {rope_dim} differs from head dimension {head_dim}, "
                f"which {arch.hf_class} does not support"
            )
        config["partial_rotary_factor"] = rope_dim / head_dim
    scaling = _rope_scaling(arch_name, meta, side, path)
    if scaling:
        config["rope_scaling"] = scaling  # the pre-5.0 transformers spelling
    config.update(arch.extra_config(meta, config, path))
    config.setdefault(
        "rope_parameters", {"rope_type": "default", **scaling, "rope_theta": config["rope_theta"]}
    )
    return config


def _rope_scaling(
    arch_name: str, meta: dict[str, Any], side: dict[str, np.ndarray], path: Path
) -> dict[str, Any]:
    if side:  # Phi-3 longrope: both factor lists, one per rotary frequency
        missing = {"rope_factors_long.weight", "rope_factors_short.weight"} - side.keys()
        if missing:
            raise ValueError(f"{path}: tensor {sorted(missing)[0]!r} is missing (longrope)")
        return {
            "rope_type": "longrope",
            "long_factor": [_float32(x) for x in side["rope_factors_long.weight"]],
            "short_factor": [_float32(x) for x in side["rope_factors_short.weight"]],
        }
    kind = meta.get(f"{arch_name}.rope.scaling.type", "none")
    if kind == "none":
        return {}
    if kind not in _ROPE_SCALING_TYPES:
        raise ValueError(
            f"{path}: rope scaling {kind!r} is not supported (supported: {_ROPE_SCALING_TYPES})"
        )
    factor = _required(meta, f"{arch_name}.rope.scaling.factor", path)
    scaling = {"rope_type": kind, "factor": _float32(factor)}
    original = meta.get(f"{arch_name}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling


def expected_shape(name: str, config: dict[str, Any]) -> tuple[int, ...] | None:
    """The shape `config` implies for HF parameter `name` (None: not checked)."""
    h, ffn, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    module, _, part = name.rpartition(".")
    leaf = module.rsplit(".", 1)[-1]
    rows = {
        "q_proj": q,
        "k_proj": kv,
        "v_proj": kv,
        "o_proj": h,
        "qkv_proj": q + 2 * kv,
        "gate_proj": ffn,
        "up_proj": ffn,
        "gate_up_proj": 2 * ffn,
        "down_proj": h,
        "embed_tokens": config["vocab_size"],
        "lm_head": config["vocab_size"],
    }
    cols = {"o_proj": q, "down_proj": ffn}
    if leaf in rows:
        return (rows[leaf],) if part == "bias" else (rows[leaf], cols.get(leaf, h))
    if leaf in ("q_norm", "k_norm"):
        return (hd,)
    if leaf.endswith("norm") or leaf.endswith("layernorm"):
        return (h,)
    return None
