"""What a config.json claims, checked before a model is built from it: sizes that a model can
have, a `quantization` block that MLX can apply and that matches how the weights are stored,
EOS ids that are token ids. Each failure is one ValueError naming the field and what it must be
(a zero head count once ended in a ZeroDivisionError; a quantization block on float weights was
silently ignored).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

# Sizes every family reads; each must be a positive integer when it is one at all (a value of
# another type is the model args' type check's to report).
POSITIVE_SIZES = (
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
)
# Group sizes and bit widths MLX's quantized kernels take, per mode, then its defaults.
QUANTIZATION_MODES: dict[str, tuple[tuple[int, ...], tuple[int, ...], int, int]] = {
    "affine": ((32, 64, 128), (2, 3, 4, 5, 6, 8), 64, 4),
    "mxfp4": ((32,), (4,), 32, 4),
    "nvfp4": ((16,), (4,), 16, 4),
    "mxfp8": ((32,), (8,), 32, 8),
}
_SETTINGS = ("group_size", "bits", "mode")
# Rotary settings that divide or take logarithms: each must be a positive, finite number.
_POSITIVE_ROPE = (
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "low_freq_factor",
    "high_freq_factor",
    "attention_factor",
)


def check_sizes(config: Mapping[str, Any]) -> None:
    for name in POSITIVE_SIZES:
        value = config.get(name)
        if _is_int(value) and value < 1:
            raise ValueError(f"config field {name!r} must be >= 1, got {value}")
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if _is_int(heads) and _is_int(kv_heads) and heads % kv_heads:
        raise ValueError(
            f"config field 'num_attention_heads' ({heads}) must be a multiple of "
            f"'num_key_value_heads' ({kv_heads})"
        )
    hidden = config.get("hidden_size")
    if config.get("head_dim") is None and _is_int(hidden) and _is_int(heads) and hidden % heads:
        raise ValueError(
            f"config field 'hidden_size' ({hidden}) is not a multiple of 'num_attention_heads' "
            f"({heads}), so the head size is unknown: give 'head_dim'"
        )


def check_rope(config: Mapping[str, Any]) -> None:
    """Rotary settings in the config and in its `rope_scaling` / `rope_parameters` blocks."""
    blocks = [("", config)] + [
        (f"{name}.", config[name])
        for name in ("rope_scaling", "rope_parameters")
        if isinstance(config.get(name), Mapping)
    ]
    for prefix, block in blocks:
        for name in _POSITIVE_ROPE:
            value = block.get(name)
            if _is_number(value) and not (0 < value < float("inf")):
                raise ValueError(f"config field '{prefix}{name}' must be > 0, got {value}")
        factor = block.get("partial_rotary_factor")
        if _is_number(factor) and not 0 < factor <= 1:
            raise ValueError(
                f"config field '{prefix}partial_rotary_factor' must be in (0, 1], got {factor}"
            )


def check_quantization(config: Mapping[str, Any], weights: Mapping[str, mx.array]) -> None:
    """`quantization` (mlx-lm's block: group_size, bits, mode, then per-module overrides that
    replace them, as MLX applies them) against
    the weights: settings MLX supports, quantized tensors present, and each one's packed width
    and scales agreeing with the settings that apply to it."""
    quantization = config.get("quantization")
    stored = sorted(k.removesuffix(".scales") for k in weights if k.endswith(".scales"))
    if quantization is None:
        if stored:
            raise ValueError(
                f"the weights are stored quantized ({stored[0]}.scales, ...) but config.json "
                "has no 'quantization' block saying how"
            )
        return
    if not isinstance(quantization, Mapping):
        raise ValueError(
            "config field 'quantization' must be an object such as "
            f'{{"group_size": 64, "bits": 4}}, got {quantization!r}'
        )
    base = _settings(quantization, "quantization")
    overrides = {k: v for k, v in quantization.items() if k not in _SETTINGS}
    for module, override in overrides.items():
        if not isinstance(override, bool | Mapping):
            raise ValueError(
                f"quantization override {module!r} must be an object of settings, true or false, "
                f"got {override!r}"
            )
    if not stored:
        raise ValueError(
            "config.json's 'quantization' block says the weights are quantized, but none is "
            "stored quantized (no .scales tensor): remove the block for float weights"
        )
    for module in stored:
        override = overrides.get(module)
        settings = (
            _settings(override, f"quantization override {module!r}")
            if isinstance(override, Mapping)
            else base
        )
        _check_packing(module, weights, *settings)


def check_eos(value: Any, vocab_size: int, where: str) -> list[int]:
    """`eos_token_id` as a list: a token id or a list of them, each inside the vocabulary."""
    ids = value if isinstance(value, list) else [value]
    for i in ids:
        if not _is_int(i) or not 0 <= i < vocab_size:
            raise ValueError(
                f"{where} field 'eos_token_id' must be a token id (0 to {vocab_size - 1}) or a "
                f"list of them, got {value!r}"
            )
    return ids


def _settings(block: Mapping[str, Any], what: str) -> tuple[int, int, str]:
    mode = block.get("mode", "affine")
    if mode not in QUANTIZATION_MODES:
        raise ValueError(
            f"{what}: 'mode' must be one of {', '.join(QUANTIZATION_MODES)}, got {mode!r}"
        )
    group_sizes, widths, default_group_size, default_bits = QUANTIZATION_MODES[mode]
    group_size = block.get("group_size", default_group_size)
    bits = block.get("bits", default_bits)
    if not _is_int(group_size) or group_size not in group_sizes:
        raise ValueError(
            f"{what}: 'group_size' must be one of {', '.join(map(str, group_sizes))} for "
            f"{mode} quantization, got {group_size!r}"
        )
    if not _is_int(bits) or bits not in widths:
        raise ValueError(
            f"{what}: 'bits' must be one of {', '.join(map(str, widths))} for {mode} "
            f"quantization, got {bits!r}"
        )
    return group_size, bits, mode


def _check_packing(
    module: str, weights: Mapping[str, mx.array], group_size: int, bits: int, mode: str
) -> None:
    """A quantized (out, in) matrix is stored as in * bits / 32 uint32 words per row and
    in / group_size scales per row: both give `in`, and must agree."""
    weight, scales = weights.get(f"{module}.weight"), weights[f"{module}.scales"]
    if weight is None or weight.dtype != mx.uint32 or weight.ndim < 2 or scales.ndim < 2:
        raise ValueError(
            f"{module} has stored scales but no packed uint32 weight of at least 2 dimensions"
        )
    packed, groups = weight.shape[-1] * 32 // bits, scales.shape[-1] * group_size
    if packed != groups:
        raise ValueError(
            f"{module} is not stored as {bits}-bit group {group_size} ({mode}) quantization, "
            f"as config.json says: its packed weight holds {packed} columns at {bits} bits, "
            f"its scales cover {groups} at group size {group_size}"
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
