"""EAGLE checkpoints: the official layouts, the speculators layout, and the MLX heads folder.

- SafeAILab EAGLE-1 (`cnets1`): `config.json` (a Llama config of the draft layer, optional
  `bias` / `qkv_bias`) + `pytorch_model.bin` or `model.safetensors`; keys `fc.*`, `layers.N.*`,
  optionally `embed_tokens.weight` (the target's, dropped).
- EAGLE-3 native (SafeAILab `cnets`, SpecForge, AngelSlim): keys `fc.weight`, `midlayer.*`,
  `norm.weight`, `lm_head.weight`, `d2t`, `t2d`; `draft_vocab_size`, optionally
  `eagle_aux_hidden_state_layer_ids` (top level or in `eagle_config`).
- vllm-project/speculators (`speculators_model_type: eagle3`): `layers.0.*` for the midlayer,
  the layer config nested in `transformer_layer_config`, taps in
  `eagle_aux_hidden_state_layer_ids`, and its normalisation flags.
- What `save_official` writes (trained heads): the SafeAILab layouts above, `config.json` +
  `model.safetensors`, EAGLE-3 with `d2t` and `t2d` and its taps in the config; or the
  speculators layout for EAGLE-3.
- MLX (what `convert --eagle-path` writes, `eagle/` beside a converted model): `config.json` in
  `EagleConfig.to_json` form (+ mlx-lm's `quantization`) and `weights.safetensors`.

Biases are read off the tensors (the official loader defaults `bias` to true when a config
omits it, so configs are not trusted for it).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ..atomic import move_into_place, staging_folder
from ..checkpoint import load_into, read_weights, write_safetensors
from ..models.base import CausalLM
from ..models.rope import rope_both_forms
from .eagle import HEADS, NORM_FLAGS, EagleConfig, EagleHead
from .store import MLX_WEIGHTS, find_checkpoint, prepare, save_heads

EAGLE_DIR = "eagle"  # heads folder inside a converted model folder
PUBLISHED_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
# Keys official releases carry that the MLX head does not hold: a copy of the target's
# embedding, EAGLE-3's target-to-draft mask (only training needs it), speculators' verifier.
_DROPPED = ("embed_tokens.weight", "t2d", "verifier_lm_head.weight", "verifier_norm.weight")
# Config keys that describe the checkpoint, not the draft layer.
_NOT_LAYER = {
    "architectures",
    "auto_map",
    "bias",
    "draft_vocab_size",
    "eagle_config",
    "eagle_aux_hidden_state_layer_ids",
    "quantization",
    "quantization_config",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "target_hidden_size",
}


def read_eagle(path: str | Path) -> tuple[EagleConfig, dict[str, mx.array], dict[str, Any]]:
    """(config, weights in the MLX head's names, the checkpoint's own config) from any layout:
    a heads folder or file, a model folder with `eagle/`, or a hub id."""
    files = (MLX_WEIGHTS, *PUBLISHED_WEIGHTS)
    raw_config, file = find_checkpoint(path, EAGLE_DIR, files, "EAGLE heads")
    if not raw_config:
        raise FileNotFoundError(f"EAGLE heads at {path} have no config.json")
    weights = {k: v for k, v in read_weights([file]).items() if k not in _DROPPED}
    if "eagle_version" in raw_config:
        return EagleConfig.from_json(raw_config), weights, raw_config
    speculators = "transformer_layer_config" in raw_config
    if speculators:
        kind = raw_config.get("speculators_model_type")
        if kind != "eagle3":
            raise ValueError(
                f"speculators model type {kind!r} is not supported (supported: eagle3)"
            )
        weights = {_midlayer(k): v for k, v in weights.items()}
        layer = dict(raw_config["transformer_layer_config"])
    else:
        layer = {k: v for k, v in raw_config.items() if k not in _NOT_LAYER | set(NORM_FLAGS)}
    version = 3 if speculators or any(k.startswith("midlayer.") for k in weights) else 1
    hidden = raw_config.get("target_hidden_size")
    if hidden not in (None, layer.get("hidden_size")):
        raise ValueError(
            f"EAGLE heads reading target states of width {hidden} into a draft of width "
            f"{layer.get('hidden_size')} are not supported"
        )
    taps = raw_config.get("eagle_aux_hidden_state_layer_ids") or (
        raw_config.get("eagle_config") or {}
    ).get("eagle_aux_hidden_state_layer_ids")
    draft_vocab = raw_config.get("draft_vocab_size")
    if draft_vocab == layer.get("vocab_size"):
        draft_vocab = None  # the official loader drops d2t then: ids are the target's
        weights.pop("d2t", None)
    layer |= _biases(weights, HEADS[version].layer_prefix)
    config = EagleConfig(
        version=version,
        layer=layer,
        draft_vocab_size=draft_vocab,
        taps=None if taps is None else tuple(taps),
        fc_bias="fc.bias" in weights,
        flags=tuple(f for f in NORM_FLAGS if raw_config.get(f)),
    )
    return config, weights, raw_config


def _midlayer(key: str) -> str:
    return "midlayer." + key.removeprefix("layers.0.") if key.startswith("layers.0.") else key


def _biases(weights: dict[str, mx.array], layer: str) -> dict[str, bool]:
    """Projection biases as the tensors hold them: q/k/v only (Qwen2 style) or all four."""
    qkv = f"{layer}.self_attn.q_proj.bias" in weights
    out = f"{layer}.self_attn.o_proj.bias" in weights
    return {"attention_bias": out, "qkv_bias": qkv and not out}


def build_eagle(
    config: EagleConfig,
    weights: dict[str, mx.array],
    quantization: dict[str, Any] | None = None,
    dtype: mx.Dtype | None = None,
) -> EagleHead:
    head = HEADS[config.version](config)
    what = f"EAGLE-{config.version} heads"
    return load_into(head, weights, quantization=quantization, dtype=dtype, what=what)


def load_eagle_heads(path: str | Path, target: CausalLM | None = None) -> EagleHead:
    """Heads from any layout (see the module docstring); with `target`, checked to fit it."""
    config, weights, raw = read_eagle(path)
    dtype = None if target is None else target.compute_dtype  # they compute in its dtype
    head = build_eagle(config, weights, raw.get("quantization"), dtype)
    if target is not None:
        head.check_fits(target)
    return head


def convert_eagle_heads(
    eagle_path: str | Path,
    out: str | Path,
    *,
    target: CausalLM | None = None,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    dtype: mx.Dtype | None = None,
) -> Path:
    """Heads in any layout -> an MLX heads folder `out`, quantized like the model with
    `quantize`. With `target`, the heads must fit it, and EAGLE-3's default taps are written
    out for its depth."""
    config, weights, raw = read_eagle(eagle_path)
    if "quantization" in raw:
        raise ValueError(f"EAGLE heads at {eagle_path} are already quantized")
    head = build_eagle(config, weights)
    if target is not None:
        config = replace(config, taps=head.check_fits(target) or None)
    extra = prepare(head, quantize=quantize, q_bits=q_bits, q_group_size=q_group_size, dtype=dtype)
    return save_heads(head, out, {**config.to_json(), **extra})


# The architectures official configs name; SafeAILab's loader reads `bias` for fc's bias.
_ARCHITECTURES = {1: "LlamaForCausalLM", 3: "LlamaForCausalLMEagle3"}


LAYOUTS = ("official", "speculators")


def save_official(head: EagleHead, out: str | Path, layout: str = "official") -> Path:
    """Writes `head` into a new folder `out`: in SafeAILab's layout (`cnets1` keys for
    EAGLE-1, the native EAGLE-3 keys with `d2t` and `t2d`), what the official code, SpecForge
    and this package's loaders read; or (`layout="speculators"`, EAGLE-3) in the
    vllm-project/speculators layout vLLM serves. Atomic: `out` appears whole or not at all."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is unknown (known: {', '.join(LAYOUTS)})")
    config = head.config
    if layout == "speculators" and config.version != 3:
        raise ValueError("the speculators layout holds EAGLE-3 heads only")
    weights = dict(tree_flatten(head.parameters()))
    raw = {
        **config.layer,
        "architectures": [_ARCHITECTURES[config.version]],
        "model_type": "llama",
        "bias": config.fc_bias,
        "torch_dtype": "float32",
    }
    if "lm_head.weight" in weights:  # EAGLE-3: its own vocabulary, ids mapped by d2t
        vocab, draft = head.args.vocab_size, weights["lm_head.weight"].shape[0]
        d2t = weights.get("d2t", mx.zeros((draft,), dtype=mx.int64))
        t2d = mx.zeros((vocab,), dtype=mx.bool_)
        t2d[mx.arange(draft) + d2t] = True
        weights |= {"d2t": d2t, "t2d": t2d}
        raw |= {
            "draft_vocab_size": draft,
            **(
                {}
                if config.taps is None
                else {"eagle_aux_hidden_state_layer_ids": list(config.taps)}
            ),
        }
    if layout == "speculators":
        weights = {k.replace("midlayer.", "layers.0.", 1): v for k, v in weights.items()}
        raw = _speculators_config(config, raw["draft_vocab_size"])
    out = Path(out)
    tmp = staging_folder(out)
    floats = {
        k: v.astype(mx.float32) for k, v in weights.items() if mx.issubdtype(v.dtype, mx.floating)
    }
    write_safetensors(tmp / "model.safetensors", weights | floats)
    (tmp / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    move_into_place(tmp, out)
    return out


def _speculators_config(config: EagleConfig, draft_vocab: int) -> dict[str, Any]:
    """What speculators' own converter writes for a SafeAILab EAGLE-3 head (`Eagle3Speculator`,
    the layer config nested with its rope in both forms)."""
    layer = {
        **rope_both_forms(config.layer),
        "model_type": "llama",
        "num_hidden_layers": 1,
        "dtype": "float32",
        "tie_word_embeddings": False,
    }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": 3,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": None},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab,
        "eagle_aux_hidden_state_layer_ids": None if config.taps is None else list(config.taps),
        "embed_requires_grad": False,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "dtype": "float32",
        **{flag: flag in config.flags for flag in NORM_FLAGS},
    }
