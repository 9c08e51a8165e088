"""report.py's `families` set: the 2026 families this package loads (Qwen3.5 dense and MoE,
Qwen3-Next, Qwen3-MoE, gpt-oss, Gemma 4 text), each at two sizes, as float32 folders with
random weights that this package and mlx-lm both load.

`tiny` is six layers of width 64 (what per-token overhead costs); `SmolLM2-sized` takes
SmolLM2-135M's shapes (hidden 576, 30 layers, 9 query and 3 key/value heads of 64, MLP 1536,
vocabulary 49,152, tied embeddings) and scales each family's own parts as it would: the hybrids
put a gated attention layer after every three Gated DeltaNet layers, mixtures of experts have
8 experts of a sixth of the MLP's width with 2 a token, gpt-oss alternates layers sliding over
128 tokens with global ones and has its own output head, Gemma 4 is laid out as its E2B (five
layers sliding over 512 per global one, global heads twice as wide, its last third reading
earlier layers' keys, per-layer inputs: narrower than E2B's, whose table would outweigh the
rest). Folders are written through `mlx_speculate.convert` (what mlx-lm reads, `mlx_lm_layout`)
with stories260K's tokenizer grown to the vocabulary and no EOS (suite_targets.py), so that
every run lasts its token count.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from bench_verify_cost import SMOLLM2_135M
from common import CACHE
from suite_targets import write_random_folder

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_moe", "gpt_oss", "gemma4_text")
SIZES = ("tiny", "SmolLM2-sized")
SEED = 0


@dataclass(frozen=True)
class Scale:
    """One size's shapes: the dense base and what each family scales from it."""

    base: dict
    experts: dict  # num_experts / num_experts_per_tok / expert width
    linear: dict  # the Gated DeltaNet layers' heads
    windows: dict  # sliding layers' window by family (gpt-oss, Gemma 4)
    per_layer_width: int  # Gemma 4's per-layer inputs
    gemma4_layers: list[str]  # Gemma 4's layer types
    shared_kv: int  # Gemma 4's layers that read an earlier layer's keys


S, F = "sliding_attention", "full_attention"
SMOLLM2 = {k: v for k, v in SMOLLM2_135M.items() if k != "model_type"} | {"head_dim": 64}
SCALES = {
    "tiny": Scale(
        base={
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": True,
        },
        experts={"count": 4, "per_token": 2, "width": 32},
        linear={"key_heads": 2, "value_heads": 4, "dim": 16},
        windows={"gpt_oss": 16, "gemma4_text": 16},
        per_layer_width=8,
        gemma4_layers=[S, S, F, S, S, F],
        shared_kv=2,
    ),
    "SmolLM2-sized": Scale(
        base=SMOLLM2,
        experts={"count": 8, "per_token": 2, "width": 256},
        linear={"key_heads": 4, "value_heads": 8, "dim": 64},
        windows={"gpt_oss": 128, "gemma4_text": 512},
        per_layer_width=16,
        gemma4_layers=[F if (i + 1) % 6 == 0 else S for i in range(30)],
        shared_kv=10,
    ),
}  # fmt: skip


def family_config(family: str, size: str) -> dict:
    """The config.json of `family` at `size` (one of SIZES)."""
    scale = SCALES[size]
    base, experts, linear = dict(scale.base), scale.experts, scale.linear
    moe = {
        "num_experts": experts["count"],
        "num_experts_per_tok": experts["per_token"],
        "moe_intermediate_size": experts["width"],
    }
    hybrid = {
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_num_key_heads": linear["key_heads"],
        "linear_num_value_heads": linear["value_heads"],
        "linear_key_head_dim": linear["dim"],
        "linear_value_head_dim": linear["dim"],
        "partial_rotary_factor": 0.25,
    }
    shared = {"shared_expert_intermediate_size": experts["width"]}
    window = scale.windows.get(family)
    extra = {
        "qwen3_5": hybrid | {"num_experts": 0},
        "qwen3_5_moe": hybrid | moe | shared,
        "qwen3_next": hybrid | moe | shared | {"norm_topk_prob": True},
        "qwen3_moe": moe | {"norm_topk_prob": True},
        "gpt_oss": {
            "num_local_experts": experts["count"],
            "num_experts_per_tok": experts["per_token"],
            "intermediate_size": experts["width"],
            "sliding_window": window,
            "max_position_embeddings": 131072,  # YaRN x32 from 4096, the family's own
            "tie_word_embeddings": False,  # as gpt-oss's own (mlx-lm's reads no tied head)
        },
        "gemma4_text": {
            "layer_types": scale.gemma4_layers,
            "num_hidden_layers": len(scale.gemma4_layers),
            "sliding_window": window,
            "global_head_dim": 2 * base["head_dim"],
            "hidden_size_per_layer_input": scale.per_layer_width,
            "vocab_size_per_layer_input": base["vocab_size"],
            "num_kv_shared_layers": scale.shared_kv,
        },
    }[family]
    if family == "gpt_oss":
        del base["rope_theta"]  # its YaRN rope_parameters
    return {"model_type": family, **base, **extra}


def describe(config: dict) -> str:
    """The shapes that set a family's cost, in one line."""
    from mlx_speculate.loading import model_class

    args = model_class(config).ModelArgs.from_dict(config)
    kinds = {
        "linear_attention": "Gated DeltaNet",
        "full_attention": "global attention",
        "sliding_attention": f"sliding over {args.sliding_window}",
    }
    types = args.layer_types or ["full_attention"] * args.num_hidden_layers
    layers = f"{args.num_hidden_layers} layers"
    if set(types) != {"full_attention"}:
        layers += f" ({', '.join(f'{types.count(t)} {n}' for t, n in kinds.items() if t in types)})"
    parts = [f"hidden {args.hidden_size}", layers]
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        width = config.get("moe_intermediate_size") or config["intermediate_size"]
        parts.append(f"{experts} experts of {width}, {config['num_experts_per_tok']} a token")
        if config.get("shared_expert_intermediate_size"):
            parts.append("a shared expert")
    else:
        parts.append(f"MLP {config['intermediate_size']}")
    if config.get("hidden_size_per_layer_input"):
        parts.append(f"per-layer inputs of {config['hidden_size_per_layer_input']}")
    if config.get("num_kv_shared_layers"):
        parts.append(f"{config['num_kv_shared_layers']} layers reading earlier keys")
    parts.append(f"vocabulary {config['vocab_size']:,}")
    return ", ".join(parts)


def family_folder(config: dict, root: Path = CACHE / "families") -> Path:
    """The converted float32 folder of `config` (written once; its name holds a digest of the
    config, so a changed config gets a new folder)."""
    from mlx_speculate.convert import convert

    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]
    folder = root / f"{config['model_type']}-{digest}"
    if (folder / "config.json").exists():
        return folder
    source = root / f"{folder.name}.random"
    shutil.rmtree(source, ignore_errors=True)
    write_random_folder(source, config, mx.float32, None, SEED)
    try:
        convert(source, folder, dtype="float32", overwrite=True)
    finally:
        shutil.rmtree(source, ignore_errors=True)
    return folder


def family_cases(
    sizes: tuple[str, ...] = SIZES, root: Path = CACHE / "families"
) -> Iterator[tuple[str, Path, str]]:
    """(label, folder under `root`, description) for every family at every size."""
    for size in sizes:
        for family in FAMILIES:
            config = family_config(family, size)
            yield f"{family} ({size})", family_folder(config, root), describe(config)
