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
- MLX (what `convert --eagle-path` writes, `eagle/` beside a converted model): `config.json` in
  `EagleConfig.to_json` form (+ mlx-lm's `quantization`) and `weights.safetensors`.

Biases are read off the tensors (the official loader defaults `bias` to true when a config
omits it, so configs are not trusted for it).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..checkpoint import load_into, read_weights
from ..models.base import CausalLM
from .eagle import NORM_FLAGS, EagleConfig, EagleHead
from .store import MLX_WEIGHTS, find_checkpoint, prepare, save_heads

EAGLE_DIR = "eagle"  # heads folder inside a converted model folder
PUBLISHED_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
# Keys official releases carry that the MLX head does not hold: a copy of the target's
# embedding, EAGLE-3's target-to-draft mask (only training needs it), speculators' verifier.
_DROPPED = ("embed_tokens.weight", "t2d", "verifier_lm_head.weight", "verifier_norm.weight")
# Config keys that describe the checkpoint, not the draft layer.
_NOT_LAYER = {
    "architectures", "auto_map", "bias", "draft_vocab_size", "eagle_config",
    "eagle_aux_hidden_state_layer_ids", "quantization", "quantization_config",
    "transformers_version", "torch_dtype", "dtype", "target_hidden_size",
}  # fmt: skip


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
    draft_vocab = raw_config.get("draft_vocab_size") if version == 3 else None
    if draft_vocab == layer.get("vocab_size"):
        draft_vocab = None  # the official loader drops d2t then: ids are the target's
        weights.pop("d2t", None)
    layer |= _biases(weights, "midlayer" if version == 3 else "layers.0")
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
    head = EagleHead(config)
    what = f"EAGLE-{config.version} heads"
    return load_into(head, weights, quantization=quantization, dtype=dtype, what=what)


def check_fits(head: EagleHead, target: CausalLM) -> tuple[int, ...]:
    """Raises ValueError unless the head reads the target's states and speaks its vocabulary;
    returns the target layers it taps (EAGLE-3; none for EAGLE-1)."""
    args, config, layers = target.args, head.config, target.args.num_hidden_layers
    if head.args.hidden_size != args.hidden_size:
        raise ValueError(
            f"EAGLE heads read hidden size {head.args.hidden_size}, the target's is "
            f"{args.hidden_size}"
        )
    if head.args.vocab_size != args.vocab_size:
        raise ValueError(
            f"EAGLE heads predict a vocabulary of {head.args.vocab_size}, the target's is "
            f"{args.vocab_size}"
        )
    if config.version == 1:
        return ()
    # The official taps: the states entering layers 2, L//2 and L-3 (each once), in order.
    taps = config.taps or tuple(sorted({2, layers // 2, layers - 3}))
    if any(not 0 <= t < layers for t in taps):
        raise ValueError(f"EAGLE-3 heads tap layers {list(taps)}; the target has {layers}")
    fc = head.fc  # a quantized layer packs its input dimension
    width = fc.scales.shape[-1] * fc.group_size if "scales" in fc else fc.weight.shape[-1]
    if width != len(taps) * args.hidden_size:
        raise ValueError(
            f"EAGLE-3 heads read {width // args.hidden_size} target states, the config taps "
            f"{len(taps)} layers ({list(taps)})"
        )
    if "d2t" in head:
        ids = mx.arange(head.d2t.shape[0])
        top = mx.max(ids + head.d2t).item()
        if mx.min(ids + head.d2t).item() < 0 or top >= args.vocab_size:
            raise ValueError(f"EAGLE-3 d2t maps draft ids to {top}, past the target's vocabulary")
    return tuple(taps)


def load_eagle_heads(path: str | Path, target: CausalLM | None = None) -> EagleHead:
    """Heads from any layout (see the module docstring); with `target`, checked to fit it."""
    config, weights, raw = read_eagle(path)
    dtype = None if target is None else target.compute_dtype  # they compute in its dtype
    head = build_eagle(config, weights, raw.get("quantization"), dtype)
    if target is not None:
        check_fits(head, target)
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
        taps = check_fits(head, target)
        if config.version == 3:
            config = replace(config, taps=taps)
    extra = prepare(head, quantize=quantize, q_bits=q_bits, q_group_size=q_group_size, dtype=dtype)
    return save_heads(head, out, {**config.to_json(), **extra})
