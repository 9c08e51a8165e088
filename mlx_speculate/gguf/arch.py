"""llama.cpp architectures as Hugging Face ones: tensor names, config.json, weight transforms.

Each supported `general.architecture` maps to one HF model class. Its GGUF tensor names become
HF parameter names, its `<arch>.*` metadata an HF config.json, and llama.cpp's changes to the
weights are undone: Llama's Q/K rows are permuted for interleaved rotary pairs
(convert_hf_to_gguf.py, LlamaModel.permute) and Gemma's RMSNorm weights are stored as 1 + w.
Qwen2, Qwen3, Phi-3 and Gemma 3 use half-split rotary pairs as HF does: their rows are as is.
Phi-3 keeps HF's fused qkv_proj and gate_up_proj, and its longrope factors ride as tensors.
The mixture-of-experts families (moe.py) and the Gated DeltaNet hybrids (hybrid.py) bring
their own tables and transforms; an `Architecture` (spec.py) holds each one's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from .gemma4 import GEMMA4_ARCHITECTURES
from .hybrid import HYBRID_ARCHITECTURES
from .moe import MOE_ARCHITECTURES
from .spec import LLAMA_LAYER, QK_NORMS, Architecture, float32, none, required

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?")
_ROPE_SCALING_TYPES = ("linear", "yarn")
_YARN_KEYS = {  # GGUF rope.scaling.* -> HF rope_parameters
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
    "yarn_ext_factor": "extrapolation_factor",
    "yarn_attn_factor": "attention_factor",
}


def _qwen2(
    meta: dict[str, Any], config: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: Path
) -> dict[str, Any]:
    return {"use_sliding_window": False}


def _phi3(
    meta: dict[str, Any], config: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: Path
) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if "phi3.attention.sliding_window" in meta:
        extra["sliding_window"] = meta["phi3.attention.sliding_window"]
    original = meta.get("phi3.rope.scaling.original_context_length")
    if original is not None:
        extra["original_max_position_embeddings"] = original
    return extra


def _gemma3(
    meta: dict[str, Any], config: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: Path
) -> dict[str, Any]:
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
        "sliding_window": required(meta, "gemma3.attention.sliding_window", path),
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
    "llama": Architecture("llama", "LlamaForCausalLM", LLAMA_LAYER, none, permute_qk=True),
    "qwen2": Architecture("qwen2", "Qwen2ForCausalLM", LLAMA_LAYER, _qwen2),
    "qwen3": Architecture("qwen3", "Qwen3ForCausalLM", {**LLAMA_LAYER, **QK_NORMS}, none),
    "phi3": Architecture(
        "phi3",
        "Phi3ForCausalLM",
        {
            **{k: v for k, v in LLAMA_LAYER.items() if not k.startswith("attn_")},
            "attn_norm": "input_layernorm",
            "attn_qkv": "self_attn.qkv_proj",
            "attn_output": "self_attn.o_proj",
            "ffn_up": "mlp.gate_up_proj",
        },
        _phi3,
        side_tensors=("rope_factors_long.weight", "rope_factors_short.weight"),
        partial_rotary=True,
    ),
    "gemma3": Architecture(
        "gemma3_text",
        "Gemma3ForCausalLM",
        {
            **LLAMA_LAYER,
            **QK_NORMS,
            "ffn_norm": "pre_feedforward_layernorm",
            "post_attention_norm": "post_attention_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        _gemma3,
        norm_offset=1.0,
    ),
    **MOE_ARCHITECTURES,
    **HYBRID_ARCHITECTURES,
    **GEMMA4_ARCHITECTURES,
}

# Metadata arrays any architecture reads (per-layer values); the header skips the others.
METADATA_ARRAYS = frozenset(k for a in ARCHITECTURES.values() for k in a.arrays)


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
    if base in arch.global_names and suffix == "weight":
        return f"{arch.global_names[base]}.weight"
    match = _LAYER_TENSOR.fullmatch(name)
    if match is not None:
        block, tensor, suffix = match.groups()
        tail = name.split(".", 2)[2]
        if tail in arch.layer_params:
            return f"model.layers.{block}.{arch.layer_params[tail]}"
        if suffix is not None and tensor in arch.layer_names:
            return f"model.layers.{block}.{arch.layer_names[tensor]}.{suffix}"
    raise ValueError(f"{path}: tensor {name!r} has no {arch.hf_class} counterpart")


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
    hidden = required(meta, key("embedding_length"), path)
    ffn = meta.get(key("feed_forward_length"))  # absent where every layer is experts
    n_heads = required(meta, key("attention.head_count"), path)
    head_dim = meta.get(key("attention.key_length"), hidden // n_heads)
    rope_dim = meta.get(key("rope.dimension_count"), head_dim)
    config: dict[str, Any] = {
        "model_type": arch.model_type,
        "architectures": [arch.hf_class],
        "hidden_size": hidden,
        "num_hidden_layers": required(meta, key("block_count"), path),
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta.get(key("attention.head_count_kv"), n_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float32(required(meta, key("attention.layer_norm_rms_epsilon"), path)),
        "rope_theta": float32(meta.get(key("rope.freq_base"), 10000.0)),
        "max_position_embeddings": required(meta, key("context_length"), path),
        "vocab_size": shapes["token_embd.weight"][0],
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if ffn is not None:
        config["intermediate_size"] = ffn
    if "tokenizer.ggml.padding_token_id" in meta:
        config["pad_token_id"] = meta["tokenizer.ggml.padding_token_id"]
    if rope_dim != head_dim:
        if not arch.partial_rotary:
            raise ValueError(
                f"{path}: rotary dimension {rope_dim} differs from head dimension {head_dim}, "
                f"which {arch.hf_class} does not support"
            )
        config["partial_rotary_factor"] = rope_dim / head_dim
    longrope = {k: v for k, v in side.items() if k.startswith("rope_factors_")}
    scaling = _rope_scaling(arch_name, meta, longrope, path)
    if scaling:
        config["rope_scaling"] = scaling  # the pre-5.0 transformers spelling
    config.update(arch.extra_config(meta, config, shapes, path))
    if arch.side_config is not None:
        try:
            arch.side_config(config, side)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
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
            "long_factor": [float32(x) for x in side["rope_factors_long.weight"]],
            "short_factor": [float32(x) for x in side["rope_factors_short.weight"]],
        }
    kind = meta.get(f"{arch_name}.rope.scaling.type", "none")
    if kind == "none":
        return {}
    if kind not in _ROPE_SCALING_TYPES:
        raise ValueError(
            f"{path}: rope scaling {kind!r} is not supported (supported: {_ROPE_SCALING_TYPES})"
        )
    factor = required(meta, f"{arch_name}.rope.scaling.factor", path)
    scaling = {"rope_type": kind, "factor": float32(factor)}
    original = meta.get(f"{arch_name}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    for gguf_key, hf_key in _YARN_KEYS.items():
        value = meta.get(f"{arch_name}.rope.scaling.{gguf_key}")
        if kind == "yarn" and value is not None:
            scaling[hf_key] = float32(value)
    return scaling


def expected_shape(name: str, config: dict[str, Any], arch: Architecture) -> tuple[int, ...] | None:
    """The shape `config` implies for HF parameter `name` (None: not checked here; the model
    checks every shape as it loads)."""
    h, hd = config["hidden_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    module, _, part = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    checked = leaf.endswith("layernorm") or leaf in ("embed_tokens", "lm_head", "norm")
    if arch.shapes_vary and not checked:
        return None
    if parent.endswith((".switch_mlp", ".mlp.experts")):
        return _expert_shape(leaf, part, config)
    if ".linear_attn." in name or ".shared_expert" in name:
        return None
    ffn = config.get("intermediate_size")
    rows = {
        "q_proj": 2 * q if arch.query_gate else q,
        "k_proj": kv,
        "v_proj": kv,
        "o_proj": h,
        "qkv_proj": q + 2 * kv,
        "gate_proj": ffn,
        "up_proj": ffn,
        "gate_up_proj": None if ffn is None else 2 * ffn,
        "down_proj": h,
        "embed_tokens": config["vocab_size"],
        "lm_head": config["vocab_size"],
    }
    cols = {"o_proj": q, "down_proj": ffn}
    if leaf in rows:
        if rows[leaf] is None or cols.get(leaf, h) is None:
            return None
        return (rows[leaf],) if part == "bias" else (rows[leaf], cols.get(leaf, h))
    if leaf in ("q_norm", "k_norm"):
        return (hd,)
    if leaf.endswith("norm") or leaf.endswith("layernorm"):
        return (h,)
    return None


def _expert_shape(leaf: str, part: str, config: dict[str, Any]) -> tuple[int, ...] | None:
    """A stacked expert projection's (E, out, in), or its (E, out) bias."""
    experts = config.get("num_experts", config.get("num_local_experts"))
    ffn = config.get("moe_intermediate_size", config.get("intermediate_size"))
    h = config["hidden_size"]
    shapes = {"gate_proj": (experts, ffn, h), "up_proj": (experts, ffn, h)}
    shapes["down_proj"] = (experts, h, ffn)
    if leaf not in shapes or None in shapes[leaf]:
        return None
    return shapes[leaf][:2] if part == "bias" else shapes[leaf]
