"""Rotary position embeddings at explicit per-token positions, with HF's scaling types.

Frequencies follow `transformers.modeling_rope_utils` exactly: `default`, `linear`, `dynamic`
(NTK, recomputed from the largest position of each forward), `llama3`, `yarn` (Qwen's long
context: a ramp between interpolated and original frequencies, plus a cos/sin scale), and Phi-3's
`longrope` (alias `su`: short/long factors switched on the largest position, plus a cos/sin
scale), and Gemma 4's `proportional` (the whole head rotates, its frequencies those of the head
size with only the first `partial_rotary_factor` of them nonzero).
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

# Rope types whose frequencies change with the largest position of a forward.
LENGTH_DEPENDENT = ("dynamic", "longrope")
SUPPORTED_ROPE_TYPES = (
    "default",
    "linear",
    "dynamic",
    "llama3",
    "yarn",
    "longrope",
    "proportional",
)
# transformers 5 nests `rope_parameters` by these layer types where they differ (Gemma 3).
LAYER_TYPES = {"full_attention", "sliding_attention"}


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """One dict of rope settings from either config form.

    transformers 5.x writes `rope_parameters` (with `rope_theta` inside); older configs write a
    top-level `rope_theta` and an optional `rope_scaling` dict (`type` or `rope_type`).
    """
    params: dict[str, Any] = {}
    legacy = config.get("rope_scaling") or {}
    params.update(legacy)
    params.update(config.get("rope_parameters") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params.setdefault("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if "original_max_position_embeddings" in config:
        params.setdefault(
            "original_max_position_embeddings", config["original_max_position_embeddings"]
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = "longrope" if rope_type == "su" else rope_type
    params.pop("type", None)
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {params['rope_type']!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return params


def rope_both_forms(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with its rope settings in both forms: `rope_parameters` (transformers 5) and
    `rope_theta`/`rope_scaling` (mlx-lm, older transformers), as converted folders carry them."""
    config = dict(config)
    nested = config.get("rope_parameters") or {}
    if LAYER_TYPES & nested.keys():
        return _nested_both_forms(config, nested)
    params = rope_parameters(config)
    config["rope_parameters"] = params
    config["rope_theta"] = params["rope_theta"]
    rope_type = params["rope_type"]
    if rope_type == "default":
        config["rope_scaling"] = None
    else:
        legacy = {
            k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")
        }
        config["rope_scaling"] = {**legacy, "type": rope_type, "rope_type": rope_type}
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        config.setdefault("partial_rotary_factor", params["partial_rotary_factor"])
    if "original_max_position_embeddings" in params:
        config.setdefault(
            "original_max_position_embeddings", params["original_max_position_embeddings"]
        )
    return config


def _nested_both_forms(config: dict[str, Any], nested: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's per-layer-type `rope_parameters` (transformers 5) kept, plus the legacy form:
    `rope_theta` and `rope_scaling` of the global layers, `rope_local_base_freq` of the local."""
    full = nested.get("full_attention") or {}
    sliding = nested.get("sliding_attention") or {}
    if "rope_theta" in full:
        config["rope_theta"] = full["rope_theta"]
    if "rope_theta" in sliding:
        config["rope_local_base_freq"] = sliding["rope_theta"]
    rope_type = full.get("rope_type", full.get("type", "default"))
    config["rope_scaling"] = None
    if rope_type != "default":
        legacy = {k: v for k, v in full.items() if k != "rope_theta"}
        config["rope_scaling"] = {**legacy, "type": rope_type, "rope_type": rope_type}
    return config


class RotaryEmbedding:
    """Applies RoPE (HF rotate-half layout) to the first `dims` features of (B, H, L, D) inputs."""

    def __init__(self, head_dim: int, params: dict[str, Any], max_position_embeddings: int):
        self.dims = int(head_dim * params.get("partial_rotary_factor", 1.0))
        if params["rope_type"] == "proportional":
            self.dims = head_dim  # rotate_half over the whole head (its tail at frequency 0)
        self.head_dim = head_dim
        half = self.dims // 2  # rotate_half: features [half, dims) then [0, half), then the rest
        order = [*range(half, self.dims), *range(half), *range(self.dims, head_dim)]
        # rotate_half as a product with a permutation matrix, exact (one 1 per column): one
        # graph node a call where gathering the features takes three (gather, transpose,
        # squeeze), and the CPU step of an overhead-bound model pays for each node.
        self._swap = mx.zeros((1, 1, head_dim, head_dim), mx.float32)
        self._swap[0, 0, mx.array(order), mx.arange(head_dim)] = 1.0
        self.rope_type = params["rope_type"]
        self.base = float(params["rope_theta"])
        self.max_position_embeddings = max_position_embeddings
        self.params = params
        self._inv_freq = _inv_freq(self.base, self.dims)
        self._attention_factor = 1.0
        if self.rope_type == "linear":
            self._inv_freq = [f / params["factor"] for f in self._inv_freq]
        elif self.rope_type == "llama3":
            self._inv_freq = _llama3_inv_freq(self._inv_freq, params)
        elif self.rope_type == "yarn":
            self._inv_freq, self._attention_factor = _yarn(
                self._inv_freq, self.base, self.dims, params, max_position_embeddings
            )
        elif self.rope_type == "proportional":
            self._inv_freq = _proportional_inv_freq(self.base, head_dim, params)
        elif self.rope_type == "longrope":
            self._original_max = params["original_max_position_embeddings"]
            factor = params.get("factor") or max_position_embeddings / self._original_max
            self._attention_factor = params.get("attention_factor") or (
                math.sqrt(1 + math.log(factor) / math.log(self._original_max))
                if factor > 1.0
                else 1.0
            )
        # mx.fast.rope takes `freqs` as 1 / inv_freq.
        self._freqs = self._to_freqs(self._inv_freq)
        self._long_freqs = None
        if self.rope_type == "longrope":
            self._freqs = self._to_freqs(_scaled(self._inv_freq, params["short_factor"]))
            self._long_freqs = self._to_freqs(_scaled(self._inv_freq, params["long_factor"]))
        # rotate-half's sign on sin: minus on the first half of the rotated features.
        self._sign = mx.array([-1.0] * half + [1.0] * (head_dim - half), dtype=mx.float32)
        self._rates = self._per_feature(self._freqs)
        mx.eval(self._sign, self._rates, self._swap)  # constants of every traced forward
        # Cos/sin scale on the rotated features only, as HF multiplies cos and sin.
        self._scale = None
        if self._attention_factor != 1.0:
            self._scale = mx.array(
                [self._attention_factor] * self.dims + [1.0] * (head_dim - self.dims)
            )

    @staticmethod
    def _to_freqs(inv_freq: list[float]) -> mx.array:
        # A frequency of 0 (proportional's unrotated part) is an infinite period: angle 0.
        return mx.array([1.0 / f if f else math.inf for f in inv_freq], dtype=mx.float32)

    @property
    def depends_on_length(self) -> bool:
        """Whether the frequencies change with the largest position of a forward."""
        return self.rope_type in LENGTH_DEPENDENT

    def freqs(self, seq_len: int) -> mx.array:
        """The frequencies HF uses for a forward whose largest position is `seq_len - 1`."""
        if self.rope_type == "longrope" and seq_len > self._original_max:
            return self._long_freqs
        if self.rope_type == "dynamic" and seq_len > self.max_position_embeddings:
            factor = self.params["factor"]
            ratio = factor * seq_len / self.max_position_embeddings - (factor - 1)
            base = self.base * ratio ** (self.dims / (self.dims - 2))
            return self._to_freqs(_inv_freq(base, self.dims))
        return self._freqs

    def __call__(
        self, x: mx.array, offset: int | mx.array, positions: mx.array | None, freqs: mx.array
    ) -> mx.array:
        if not native():
            return self.rotate(x, self.tables(offset, positions, x.shape[2], freqs, x.dtype))
        if self._scale is not None:
            x = x * self._scale.astype(x.dtype)
        if positions is None:
            return mx.fast.rope(
                x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=freqs
            )
        # mx.fast.rope takes one offset per batch row: move tokens into the batch axis.
        B, H, L, D = x.shape
        x = x.transpose(0, 2, 1, 3).reshape(B * L, H, 1, D)  # (B*L, H, 1, D)
        x = mx.fast.rope(
            x,
            self.dims,
            traditional=False,
            base=None,
            scale=1.0,
            offset=mx.broadcast_to(positions, (B, L)).reshape(-1),
            freqs=freqs,
        )
        return x.reshape(B, L, H, D).transpose(0, 2, 1, 3)  # (B, H, L, D)

    def tables(
        self,
        offset: int | mx.array,
        positions: mx.array | None,
        length: int,
        freqs: mx.array,
        dtype: mx.Dtype,
    ) -> tuple[mx.array, mx.array, mx.array]:
        """What `rotate` needs for a forward of `length` tokens at `positions` (default
        consecutive from `offset`): (cos, signed sin, rotate-half's permutation matrix). cos
        and sin are (L, D), or (B, 1, L, D) for (B, L) positions, in `dtype`. Every layer of a
        forward shares them: on the CPU, where mx.fast.rope falls back to a dozen ops per call,
        this saves most of them; the arithmetic is mx.fast.rope's fallback, so results are
        equal bit for bit."""
        if positions is None:
            positions = mx.arange(length, dtype=mx.int32) + offset
        rates = self._rates if freqs is self._freqs else self._per_feature(freqs)
        theta = positions.astype(mx.float32)[..., None] * rates  # (..., L, head_dim)
        cos, sin = mx.cos(theta).astype(dtype), (mx.sin(theta) * self._sign).astype(dtype)
        if cos.ndim == 3:
            cos, sin = cos[:, None], sin[:, None]
        return cos, sin, self._swap.astype(dtype)

    def _per_feature(self, freqs: mx.array) -> mx.array:
        """(head_dim,) rotation rates: both halves of the rotated features turn at their
        frequency, the unrotated rest not at all (cos 1, sin 0). Rows made from them in two
        fused ops equal, bit for bit, rows of half-width cos and sin concatenated, which were
        seven ops in every forward."""
        inv = mx.reciprocal(freqs)
        rest = mx.zeros((self.head_dim - self.dims,), mx.float32)
        return mx.concatenate([inv, inv, rest])

    def rotate(self, x: mx.array, tables: tuple[mx.array, mx.array, mx.array]) -> mx.array:
        """(B, H, L, D) x rotated by `tables` (HF rotate-half: x * cos + rotate_half(x) * sin)."""
        cos, sin, swap = tables
        if self._scale is not None:
            x = x * self._scale.astype(x.dtype)
        return x * cos + (x @ swap) * sin


def native() -> bool:
    """Whether mx.fast.rope runs as one kernel (on a GPU); on the CPU it is a composite."""
    return mx.default_device() != mx.cpu


def _inv_freq(base: float, dims: int) -> list[float]:
    return [1.0 / base ** (2 * i / dims) for i in range(dims // 2)]


def _proportional_inv_freq(base: float, head_dim: int, params: dict[str, Any]) -> list[float]:
    """transformers' proportional RoPE: the head size's default frequencies for the first
    `partial_rotary_factor` of the rotated pairs, 0 (no rotation) for the rest, all divided
    by `factor`."""
    rotated = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    inv_freq = [1.0 / base ** (2 * i / head_dim) for i in range(rotated)]
    inv_freq += [0.0] * (head_dim // 2 - rotated)
    return [f / params.get("factor", 1.0) for f in inv_freq]


def _scaled(inv_freq: list[float], factors: list[float]) -> list[float]:
    return [f / s for f, s in zip(inv_freq, factors, strict=True)]


def _llama3_inv_freq(inv_freq: list[float], params: dict[str, Any]) -> list[float]:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    out = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def _yarn(
    inv_freq: list[float],
    base: float,
    dims: int,
    params: dict[str, Any],
    max_position_embeddings: int,
) -> tuple[list[float], float]:
    """YaRN inverse frequencies and cos/sin scale (transformers' _compute_yarn_parameters)."""
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    factor = params.get("factor") or max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(params.get("beta_fast") or 32)
    high = correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    out = []
    for i, f in enumerate(inv_freq):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: original, 1: interpolated
        out.append(f / factor * ramp + f * (1 - ramp))
    return out, attention
