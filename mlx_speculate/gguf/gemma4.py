"""llama.cpp's `gemma4` architecture (Gemma 4 text) as HF's `Gemma4ForCausalLM`.

convert_hf_to_gguf.py's Gemma4Model writes Gemma 3's tensors (norms as they are: Gemma 4's
RMSNorm scales by w, not 1 + w) plus the per-layer inputs (`per_layer_token_embd`,
`per_layer_model_proj`, `per_layer_proj_norm`; per block `inp_gate`, `proj`, `post_norm`) and
each layer's `layer_output_scale`. Its metadata holds the global layers' head size as
`key_length` and the sliding ones' as `key_length_swa`, the sliding layers as a bool array
(`sliding_window_pattern`), `shared_kv_layers`, key/value heads and MLP widths per layer where
they differ (global key/value heads; the double-wide MLP of KV-sharing layers), and the two
RoPE bases. The global layers' `proportional` RoPE rotates part of each head: the
`rope_freqs` tensor holds 1 for each rotated frequency and 1e30 for the others, from which its
`partial_rotary_factor` is read back. Global layers without a value projection take their
values from the keys (`attention_k_eq_v`). Files with experts are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .spec import LLAMA_LAYER, QK_NORMS, Architecture, blocks_with, float32, required
from .tensors import Value

_ARCH = "gemma4"
_LAYER = {
    **{k: v for k, v in LLAMA_LAYER.items() if k != "ffn_norm"},
    **QK_NORMS,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}
_GLOBAL = {
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}
_ROPE_FREQS = "rope_freqs.weight"


def _per_layer(
    value: Any, layer_types: list[str], key: str, path: Path
) -> dict[str, int | None]:
    """A per-layer metadata value (int or array) as one int per layer type."""
    values = list(value) if isinstance(value, list | tuple | np.ndarray) else None
    if values is None:
        return dict.fromkeys(layer_types, value)
    if len(values) != len(layer_types):
        raise ValueError(f"{path}: {key} has {len(values)} entries for {len(layer_types)} layers")
    by_type: dict[str, int | None] = {}
    for kind, v in zip(layer_types, values, strict=True):
        if by_type.setdefault(kind, int(v)) != int(v):
            raise ValueError(f"{path}: {key} differs between layers of type {kind}")
    return by_type


def _extra(
    meta: dict[str, Any], config: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: Path
) -> dict[str, Any]:
    if f"{_ARCH}.expert_count" in meta:
        raise ValueError(f"{path}: Gemma 4 GGUF files with experts are not supported")
    layers = config["num_hidden_layers"]
    pattern = required(meta, f"{_ARCH}.attention.sliding_window_pattern", path)
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise ValueError(f"{path}: sliding_window_pattern must hold one bool per layer")
    types = ["sliding_attention" if s else "full_attention" for s in pattern]
    if types[-1] != "full_attention":  # transformers forces it; the file would disagree
        raise ValueError(f"{path}: the last layer is a sliding one, Gemma 4's is global")
    shared = meta.get(f"{_ARCH}.attention.shared_kv_layers", 0)
    first_shared = layers - shared
    heads = _per_layer(config["num_key_value_heads"], types, "attention.head_count_kv", path)
    full_heads = heads["full_attention"]
    sliding_heads = heads.get("sliding_attention", full_heads)
    # Global layers that write keys but hold no value projection take values from the keys.
    writes = [i for i in range(first_shared) if types[i] == "full_attention"]
    has_v = blocks_with(shapes, "attn_v", layers)
    k_eq_v = bool(writes) and not any(has_v[i] for i in writes)
    if not k_eq_v and full_heads != sliding_heads:
        raise ValueError(
            f"{path}: global layers with {full_heads} key/value heads (sliding ones: "
            f"{sliding_heads}) and their own value projections are not a Gemma 4 layout"
        )
    extra: dict[str, Any] = {
        "layer_types": types,
        "head_dim": required(meta, f"{_ARCH}.attention.key_length_swa", path),
        "global_head_dim": config["head_dim"],
        "num_key_value_heads": sliding_heads,
        "num_global_key_value_heads": full_heads if k_eq_v else None,
        "attention_k_eq_v": k_eq_v,
        "num_kv_shared_layers": shared,
        "sliding_window": required(meta, f"{_ARCH}.attention.sliding_window", path),
        "final_logit_softcapping": _optional_float(meta, "final_logit_softcapping"),
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "attention_bias": any(n.endswith(".attn_q.bias") for n in shapes),
        "enable_moe_block": False,
        "rope_parameters": _rope(meta, config, path),
    }
    extra |= _mlp_widths(meta, types, first_shared, path)
    width = meta.get(f"{_ARCH}.embedding_length_per_layer_input", 0)
    extra["hidden_size_per_layer_input"] = width
    if width:
        if "per_layer_token_embd.weight" not in shapes:
            raise ValueError(f"{path}: tensor 'per_layer_token_embd.weight' is missing")
        extra["vocab_size_per_layer_input"] = shapes["per_layer_token_embd.weight"][0]
    return extra


def _optional_float(meta: dict[str, Any], name: str) -> float | None:
    value = meta.get(f"{_ARCH}.{name}")
    return None if value is None else float32(value)


def _mlp_widths(
    meta: dict[str, Any], types: list[str], first_shared: int, path: Path
) -> dict[str, Any]:
    """intermediate_size, and whether the KV-sharing layers' MLPs are twice as wide."""
    value = required(meta, f"{_ARCH}.feed_forward_length", path)
    widths = list(value) if isinstance(value, list | tuple | np.ndarray) else [value] * len(types)
    if len(widths) != len(types):
        raise ValueError(
            f"{path}: feed_forward_length has {len(widths)} entries for {len(types)} layers"
        )
    base = int(widths[0])
    for double in (False, True):
        want = [base * (2 if double and i >= first_shared else 1) for i in range(len(types))]
        if [int(w) for w in widths] == want:
            return {"intermediate_size": base, "use_double_wide_mlp": double}
    raise ValueError(
        f"{path}: feed_forward_length {[int(w) for w in widths]} is neither one width nor "
        "twice it on the KV-sharing layers"
    )


def _rope(meta: dict[str, Any], config: dict[str, Any], path: Path) -> dict[str, Any]:
    sliding_dim = meta.get(f"{_ARCH}.rope.dimension_count_swa")
    head = required(meta, f"{_ARCH}.attention.key_length_swa", path)
    sliding: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float32(meta.get(f"{_ARCH}.rope.freq_base_swa", 10000.0)),
    }
    if sliding_dim is not None and sliding_dim != head:
        sliding["partial_rotary_factor"] = sliding_dim / head
    full: dict[str, Any] = {"rope_type": "proportional", "rope_theta": config["rope_theta"]}
    full["partial_rotary_factor"] = 1.0  # without rope_freqs every frequency rotates (_side)
    return {"sliding_attention": sliding, "full_attention": full}


def _partial_rotary(freqs: np.ndarray, head_dim: int) -> float:
    """The rotated share of a global head: rope_freqs is 1 for each rotated frequency, then
    1e30 (no rotation) for the rest."""
    rotated = int(np.sum(freqs == 1.0))
    if freqs.shape != (head_dim // 2,) or not np.all(freqs[rotated:] >= 1e29):
        raise ValueError(
            "rope_freqs is not 1 for the rotated frequencies and 1e30 for the others"
        )
    return 2 * rotated / head_dim


def _side(config: dict[str, Any], side: dict[str, np.ndarray]) -> None:
    if _ROPE_FREQS in side:
        full = config["rope_parameters"]["full_attention"]
        full["partial_rotary_factor"] = _partial_rotary(
            side[_ROPE_FREQS], config["global_head_dim"]
        )


def _transform(weights: dict[str, Value], config: dict[str, Any]) -> None:
    """KV-sharing layers read an earlier layer's keys: their own projections, which the
    converter writes when the checkpoint holds them, are dropped, as transformers does."""
    layers = config["num_hidden_layers"]
    for i in range(layers - config["num_kv_shared_layers"], layers):
        for part in ("k_proj", "v_proj", "k_norm"):
            weights.pop(f"model.layers.{i}.self_attn.{part}.weight", None)


GEMMA4_ARCHITECTURES = {
    "gemma4": Architecture(
        "gemma4_text",
        "Gemma4ForCausalLM",
        _LAYER,
        _extra,
        layer_params={"layer_output_scale.weight": "layer_scalar"},
        side_tensors=(_ROPE_FREQS,),
        transform=_transform,
        global_names=_GLOBAL,
        side_config=_side,
        shapes_vary=True,
        arrays=tuple(
            f"{_ARCH}.{k}"
            for k in (
                "attention.sliding_window_pattern",
                "attention.head_count_kv",
                "feed_forward_length",
            )
        ),
    )
}
