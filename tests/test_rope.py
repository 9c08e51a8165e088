"""RoPE at explicit positions against a float64 numpy rotate-half reference with HF's formulas."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_speculate.models.rope import RotaryEmbedding, rope_parameters

HEAD_DIM, MAX_POS = 16, 32
LONG = [1.0 + 1.5 * i for i in range(8)]
SHORT = [1.0 + 0.05 * i for i in range(8)]
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def case(rope_type: str, theta: float = 10000.0, **extra: Any) -> dict[str, Any]:
    return {"rope_type": rope_type, "rope_theta": theta, **extra}


def longrope(original: int, n: int = 8, **extra: Any) -> dict[str, Any]:
    factors = {"short_factor": SHORT[:n], "long_factor": LONG[:n]}
    return case("longrope", **factors, original_max_position_embeddings=original, **extra)


CASES = {
    "default": case("default"),
    "linear": case("linear", factor=4.0),
    "dynamic-below": case("dynamic", factor=2.0),
    "dynamic-above": case("dynamic", factor=2.0),
    # original 64 with theta 5e5: wavelengths 6, 32, 167, ... fall in all three bands.
    "llama3": case("llama3", 500000.0, **LLAMA3, original_max_position_embeddings=64),
    # original 64 with theta 1e4 and head_dim 16: the ramp runs over dimensions 0..3.
    "yarn": case("yarn", factor=4.0, original_max_position_embeddings=64),
    "yarn-mscale": case("yarn", factor=8.0, mscale=0.9, mscale_all_dim=1.1, beta_fast=8),
    "yarn-untruncated": case("yarn", factor=2.0, truncate=False),
    "longrope-short": longrope(24),
    "longrope-long": longrope(8),
    "longrope-attention-factor": longrope(8, attention_factor=1.3),
    "partial": case("default", partial_rotary_factor=0.5),
    "partial-longrope": longrope(8, n=4, partial_rotary_factor=0.5),
    # Gemma 4's global layers: the whole head rotates, only its first quarter (half) of the
    # frequencies nonzero, those of the full head size.
    "proportional": case("proportional", 100.0, partial_rotary_factor=0.25),
    "proportional-factor": case("proportional", 100.0, partial_rotary_factor=0.5, factor=2.0),
}


def inv_freq_reference(params: dict[str, Any], seq_len: int) -> tuple[np.ndarray, float]:
    """transformers' inverse frequencies and cos/sin scale (modeling_rope_utils), in float64."""
    if params["rope_type"] == "proportional":
        rotated = int(params["partial_rotary_factor"] * HEAD_DIM // 2)
        inv_freq = 1.0 / params["rope_theta"] ** (np.arange(0, 2 * rotated, 2) / HEAD_DIM)
        inv_freq = np.concatenate([inv_freq, np.zeros(HEAD_DIM // 2 - rotated)])
        return inv_freq / params.get("factor", 1.0), 1.0
    dim = int(HEAD_DIM * params.get("partial_rotary_factor", 1.0))
    base, kind = params["rope_theta"], params["rope_type"]
    exponents = np.arange(0, dim, 2) / dim
    if kind == "dynamic" and seq_len > MAX_POS:
        factor = params["factor"]
        base = base * (factor * seq_len / MAX_POS - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / base**exponents
    if kind == "linear":
        return inv_freq / params["factor"], 1.0
    if kind == "llama3":
        old = params["original_max_position_embeddings"]
        low, high, factor = params["low_freq_factor"], params["high_freq_factor"], params["factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old / wavelen - low) / (high - low)
        medium = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
        bands = (wavelen < old / high, wavelen > old / low)
        assert all(b.any() for b in bands) and not (bands[0] | bands[1]).all()
        return np.where(bands[0] | bands[1], scaled, medium), 1.0
    if kind == "yarn":
        return yarn_reference(params, dim, base)
    if kind == "longrope":
        original = params["original_max_position_embeddings"]
        factor = MAX_POS / original
        attention = params.get("attention_factor") or (
            math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        )
        ext = params["long_factor"] if seq_len > original else params["short_factor"]
        return 1.0 / (np.array(ext) * base**exponents), attention
    return inv_freq, 1.0


def yarn_reference(params: dict[str, Any], dim: int, base: float) -> tuple[np.ndarray, float]:
    """transformers' _compute_yarn_parameters in float64 (original length defaults to MAX_POS)."""
    factor, original = params["factor"], params.get("original_max_position_embeddings", MAX_POS)

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        attention = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
    else:
        attention = mscale(factor)
    pos_freqs = base ** (np.arange(0, dim, 2) / dim)

    def correction(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(params.get("beta_fast", 32)), correction(params.get("beta_slow", 1))
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    inv_freq = (1 / (factor * pos_freqs)) * ramp + (1 / pos_freqs) * (1 - ramp)
    assert ((ramp > 0) & (ramp < 1)).any()  # some frequencies are blended, not just one kind
    return inv_freq, attention


def rope_reference(x: np.ndarray, positions: np.ndarray, params: dict[str, Any]) -> np.ndarray:
    """HF's apply_rotary_pos_emb: rotate-half on the first `dim` features of (B, H, L, D)."""
    inv_freq, attention = inv_freq_reference(params, int(positions.max()) + 1)
    dim = 2 * len(inv_freq)
    angles = np.broadcast_to(positions, (x.shape[0], x.shape[2]))[:, None, :, None] * inv_freq
    emb = np.concatenate([angles, angles], axis=-1)  # (B, 1, L, dim)
    cos, sin = np.cos(emb) * attention, np.sin(emb) * attention
    rot, rest = x[..., :dim], x[..., dim:]
    half = np.concatenate([-rot[..., dim // 2 :], rot[..., : dim // 2]], axis=-1)
    return np.concatenate([rot * cos + half * sin, rest], axis=-1)


def apply(params: dict[str, Any], x: mx.array, positions: mx.array) -> mx.array:
    rope = RotaryEmbedding(HEAD_DIM, rope_parameters({"rope_parameters": params}), MAX_POS)
    return rope(x, 0, positions, rope.freqs(int(positions.max().item()) + 1))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("shape", ["(B, L)", "(L,)"])
def test_per_token_positions_match_reference(name, shape):
    """mx.fast.rope at scattered per-token positions equals the numpy rotate-half reference."""
    params = CASES[name]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 6, HEAD_DIM)).astype(np.float32)  # (B, H, L, D)
    top = 60 if name.endswith(("above", "long", "factor")) else 20  # crosses the threshold or not
    positions = rng.integers(0, top, (2, 6) if shape == "(B, L)" else (6,))
    positions.reshape(-1)[0] = top  # the largest position decides dynamic / longrope frequencies
    ours = np.array(apply(params, mx.array(x), mx.array(positions)))
    expected = rope_reference(x.astype(np.float64), positions, params)
    # float32 angles up to 60 rad carry ~60 * 2**-24 rad of rounding; times |x| <= 5, < 2e-5.
    np.testing.assert_allclose(ours, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_scalar_offset_equals_per_token_positions(name):
    """The scalar-offset path equals the per-token path for consecutive positions."""
    params = CASES[name]
    rope = RotaryEmbedding(HEAD_DIM, rope_parameters({"rope_parameters": params}), MAX_POS)
    x = mx.random.normal((2, 3, 7, HEAD_DIM), key=mx.random.key(1))
    for offset in (0, 13, 40):
        freqs = rope.freqs(offset + 7)
        scalar = rope(x, offset, None, freqs)
        per_token = rope(x, 0, mx.arange(offset, offset + 7), freqs)
        assert mx.array_equal(scalar, per_token)


def test_frequencies_switch_with_the_largest_position():
    """Dynamic and longrope frequencies change exactly past their thresholds; others never do."""
    for name, threshold in [("dynamic-above", MAX_POS), ("longrope-long", 8)]:
        rope = RotaryEmbedding(HEAD_DIM, rope_parameters({"rope_parameters": CASES[name]}), MAX_POS)
        assert rope.depends_on_length
        assert mx.array_equal(rope.freqs(1), rope.freqs(threshold))
        assert not mx.allclose(rope.freqs(threshold), rope.freqs(threshold + 1))
    for name in ("default", "linear", "llama3", "yarn"):
        rope = RotaryEmbedding(HEAD_DIM, rope_parameters({"rope_parameters": CASES[name]}), MAX_POS)
        assert not rope.depends_on_length


def test_both_config_forms_give_the_same_parameters():
    """Legacy `rope_theta` + `rope_scaling` (`type`, `su`) parse like transformers 5.x
    `rope_parameters`."""
    legacy = {
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "su", "short_factor": SHORT, "long_factor": LONG},
        "original_max_position_embeddings": 8,
        "partial_rotary_factor": 0.5,
    }
    new = {
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 500000.0,
            "short_factor": SHORT,
            "long_factor": LONG,
            "original_max_position_embeddings": 8,
            "partial_rotary_factor": 0.5,
        }
    }
    assert rope_parameters(legacy) == rope_parameters(new) == new["rope_parameters"]


def test_theta_defaults_and_rope_parameters_precedence():
    """rope_parameters' theta wins over a top-level one; with neither, theta is 10000."""
    both = {"rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert rope_parameters(both)["rope_theta"] == 5e5
    assert rope_parameters({})["rope_theta"] == 10000.0
    assert rope_parameters({})["rope_type"] == "default"


def test_unknown_rope_type_is_a_clear_error():
    """An unsupported rope type names itself and the supported ones."""
    with pytest.raises(ValueError, match=r"'mrope' is not supported \(supported: default, "):
        rope_parameters({"rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 4]}})


@pytest.mark.parametrize("name", ["default", "partial", "longrope-attention-factor"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_shared_tables_equal_fast_rope_bit_for_bit(name, dtype):
    """The per-forward tables (what CPU forwards use) rotate exactly as mx.fast.rope does, at a
    scalar offset and at per-token (B, L) positions."""
    rope = RotaryEmbedding(HEAD_DIM, rope_parameters({"rope_parameters": CASES[name]}), MAX_POS)
    x = (4 * mx.random.normal((2, 3, 5, HEAD_DIM), key=mx.random.key(2))).astype(dtype)
    freqs = rope.freqs(MAX_POS)
    scaled = x if rope._scale is None else x * rope._scale.astype(dtype)
    for offset in (0, 9, 3000):
        tables = rope.tables(mx.array(offset), None, 5, freqs, dtype)
        expected = mx.fast.rope(
            scaled, rope.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=freqs
        )
        assert mx.array_equal(rope.rotate(x, tables), expected)
    positions = mx.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    rotated = rope.rotate(x, rope.tables(0, positions, 5, freqs, dtype))
    for b in range(2):
        for i in range(5):
            one = mx.fast.rope(
                scaled[b : b + 1, :, i : i + 1], rope.dims, traditional=False, base=None,
                scale=1.0, offset=positions[b, i].item(), freqs=freqs,
            )  # fmt: skip
            assert mx.array_equal(rotated[b : b + 1, :, i : i + 1], one)
