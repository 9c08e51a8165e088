"""llama.cpp's mixture-of-experts architectures `qwen3moe` and `gpt-oss` as HF ones.

llama.cpp stores each layer's experts stacked, one (E, out, in) tensor per projection
(`ffn_{gate,up,down}_exps`), which is mlx-lm's layout (`switch_mlp` for Qwen3-MoE,
`mlp.experts` for gpt-oss), so they map by name; `ffn_gate_up_exps` (gate rows, then up rows,
convert_hf_to_gguf.py's --fuse-gate-up-exps) is split. gpt-oss's fused, interleaved
`gate_up_proj` was split by the converter already, and its sinks ride as `attn_sinks.weight`.
llama.cpp renormalizes Qwen3-MoE's top-k weights unless `expert_weights_norm` says otherwise,
and runs gpt-oss's sliding and full layers alternately, sliding first, with a YaRN that
transformers' gpt-oss configs give `truncate: false`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .spec import LLAMA_LAYER, QK_NORMS, Architecture, blocks_with, required
from .tensors import Value, take_rows

EXPERT_LAYER = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_up_exps": "mlp.switch_mlp.gate_up_proj",
}


def expert_config(meta: dict[str, Any], arch: str, path: Path) -> dict[str, Any]:
    """The routing fields every Qwen MoE config holds, from `<arch>.expert_*`."""
    return {
        "num_experts": required(meta, f"{arch}.expert_count", path),
        "num_experts_per_tok": required(meta, f"{arch}.expert_used_count", path),
        "moe_intermediate_size": required(meta, f"{arch}.expert_feed_forward_length", path),
        "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", True)),
        "decoder_sparse_step": 1,
    }


def dense_layers(shapes: dict[str, tuple[int, ...]], layers: int) -> list[int]:
    """The blocks without a router: their MLP is dense (HF's `mlp_only_layers`)."""
    return [i for i, routed in enumerate(blocks_with(shapes, "ffn_gate_inp", layers)) if not routed]


def split_gate_up(weights: dict[str, Value], config: dict[str, Any]) -> None:
    """Each fused (E, 2 I, H) `gate_up_proj` stack as its gate and up halves, in place."""
    for name in [n for n in weights if n.endswith(".switch_mlp.gate_up_proj.weight")]:
        fused = weights.pop(name)
        half = fused.shape[-2] // 2
        prefix = name.removesuffix("gate_up_proj.weight")
        weights[f"{prefix}gate_proj.weight"] = take_rows(fused, np.arange(half))
        weights[f"{prefix}up_proj.weight"] = take_rows(fused, np.arange(half, 2 * half))


def _qwen3moe(
    meta: dict[str, Any], config: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: Path
) -> dict[str, Any]:
    return {
        **expert_config(meta, "qwen3moe", path),
        "mlp_only_layers": dense_layers(shapes, config["num_hidden_layers"]),
        "use_sliding_window": False,
    }


def _gpt_oss(
    meta: dict[str, Any], config: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: Path
) -> dict[str, Any]:
    extra = {
        "num_local_experts": required(meta, "gpt-oss.expert_count", path),
        "num_experts_per_tok": required(meta, "gpt-oss.expert_used_count", path),
        "intermediate_size": required(meta, "gpt-oss.expert_feed_forward_length", path),
        "sliding_window": required(meta, "gpt-oss.attention.sliding_window", path),
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(config["num_hidden_layers"])
        ],
        "attention_bias": True,
    }
    scaling = config.get("rope_scaling")
    if scaling and scaling["rope_type"] == "yarn":
        extra["rope_scaling"] = {**scaling, "truncate": False}
        extra["rope_parameters"] = {**extra["rope_scaling"], "rope_theta": config["rope_theta"]}
    return extra


MOE_ARCHITECTURES = {
    "qwen3moe": Architecture(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        {**LLAMA_LAYER, **QK_NORMS, **EXPERT_LAYER},
        _qwen3moe,
        transform=split_gate_up,
    ),
    "gpt-oss": Architecture(
        "gpt_oss",
        "GptOssForCausalLM",
        {
            **{k: v for k, v in LLAMA_LAYER.items() if k.startswith("attn_")},
            "post_attention_norm": "post_attention_layernorm",
            "ffn_gate_inp": "mlp.router",
            "ffn_gate_exps": "mlp.experts.gate_proj",
            "ffn_up_exps": "mlp.experts.up_proj",
            "ffn_down_exps": "mlp.experts.down_proj",
        },
        _gpt_oss,
        layer_params={"attn_sinks.weight": "self_attn.sinks"},
    ),
}
