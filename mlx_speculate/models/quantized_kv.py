"""Quantized keys and values (mlx-lm's `--kv-bits`): the cache stores every slot's keys and
values at `bits` per value with a scale and a bias per `group_size` values, and attention reads
them through MLX's quantized matmul, as mlx-lm's `quantized_scaled_dot_product_attention` does.

Storage: each layer's keys (and values) stay one array, uint32 (B, H_kv, capacity, W): a slot's
row holds its D values packed (D * bits / 32 words), then its D / group_size scales and as
many biases in the compute dtype, viewed as words. Groups run along the head dim, so a slot
quantizes alone: quantizing a row when it is written or later gives the same bits, and the
cache's write, truncate, compaction and compiled views move packed rows as they move float ones.

`start` (mlx-lm's `--quantized-kv-start`): the cache stays float until a forward starts at or
past that many slots, then quantizes what it holds (cache.py). So that speculation stays exact,
no step crosses that slot (`KVCache.before_switch` bounds its draft): every row of a forward
attends to the representation plain decoding would give its slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs
GROUP_SIZES = (32, 64, 128)
DEFAULT_START = 5000  # mlx-lm's DEFAULT_QUANTIZED_KV_START


@dataclass(frozen=True)
class KVQuantization:
    """How a cache quantizes: `bits` per value, a scale and bias per `group_size` values along
    the head dim, from `start` cached slots on. Hashable: compiled steps are keyed by it."""

    bits: int = 8
    group_size: int = 64
    start: int = DEFAULT_START

    def __post_init__(self):
        for name, value in (("kv_bits", self.bits), ("kv_group_size", self.group_size)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.bits not in BITS:
            allowed = ", ".join(map(str, BITS))
            raise ValueError(f"kv_bits must be one of {allowed} (what MLX packs), got {self.bits}")
        if self.group_size not in GROUP_SIZES:
            allowed = ", ".join(map(str, GROUP_SIZES))
            raise ValueError(f"kv_group_size must be one of {allowed}, got {self.group_size}")
        start = self.start
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise ValueError(f"quantized_kv_start must be an integer >= 0, got {start!r}")

    def check_sizes(self, sizes: list[int]) -> None:
        """A one-line ValueError where a cache layer's head size is not a whole number of
        groups."""
        for layer, size in enumerate(sizes):
            if size % self.group_size:
                raise ValueError(
                    f"kv_group_size {self.group_size} does not divide the head size {size} of "
                    f"cache layer {layer}: use a group size that does (32, 64 or 128)"
                )

    def width(self, size: int, dtype: mx.Dtype) -> int:
        """Words per slot for `size` values computed in `dtype`: packed values, scales, biases."""
        return size * self.bits // 32 + size // self.group_size * dtype.size // 2

    def encode(self, x: mx.array) -> mx.array:
        """(..., D) float -> (..., W) uint32: the packed values, then scales and biases."""
        packed, scales, biases = mx.quantize(x, group_size=self.group_size, bits=self.bits)
        extra = mx.view(mx.concatenate([scales, biases], axis=-1), mx.uint32)
        return mx.concatenate([packed, extra], axis=-1)

    def decode(self, words: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array]:
        """(..., W) uint32 -> packed values, scales and biases in `dtype` (what `encode` packed
        from values of that dtype), for mx.quantized_matmul."""
        width = words.shape[-1]
        # W = D * bits / 32 + (D / g) * itemsize / 2, solved for D
        size = width * 64 * self.group_size // (2 * self.group_size * self.bits + 32 * dtype.size)
        n, groups = size * self.bits // 32, size // self.group_size
        extra = mx.view(words[..., n:], dtype)  # (..., 2 * groups)
        return words[..., :n], extra[..., :groups], extra[..., groups:]

    def attention(
        self,
        q: mx.array,
        keys: mx.array,
        values: mx.array,
        scale: float,
        mask: mx.array | None,
        sinks: mx.array | None = None,
        softcap: float | None = None,
    ) -> mx.array:
        """(B, H, L, D) float queries over (B, Hk, S, W) packed keys and values (from `encode`
        of the queries' dtype); `mask` additive, broadcasting to (B, H, L, S); `sinks` (H,) and
        `softcap` as in attention.py. The query heads sharing a key-value head are one matmul."""
        B, H, L, D = q.shape
        Hk, S = keys.shape[1], keys.shape[2]
        quantized = {"group_size": self.group_size, "bits": self.bits}
        grouped = (q * mx.array(scale, q.dtype)).reshape(B, Hk, H // Hk * L, D)
        k = self.decode(keys, q.dtype)
        scores = mx.quantized_matmul(grouped, *k, transpose=True, **quantized)
        scores = scores.reshape(B, H, L, S)  # (B, H, L, S)
        if softcap is not None:  # Gemma 2's capped scores, before the mask
            cap = mx.array(softcap, scores.dtype)
            scores = cap * mx.tanh(scores / cap)
        if mask is not None:
            scores = scores + mask
        if sinks is None:
            probs = mx.softmax(scores, axis=-1, precise=True)
        else:  # the sink's column joins the softmax, then leaves: it has no value
            sink = mx.broadcast_to(sinks.astype(scores.dtype)[:, None, None], (B, H, L, 1))
            probs = mx.softmax(mx.concatenate([scores, sink], axis=-1), -1, precise=True)
            probs = probs[..., :S]
        v = self.decode(values, q.dtype)
        out = mx.quantized_matmul(
            probs.reshape(B, Hk, H // Hk * L, S), *v, transpose=False, **quantized
        )
        return out.reshape(B, H, L, -1)


def kv_quantization(
    kv_bits: int | None, kv_group_size: int = 64, quantized_kv_start: int = DEFAULT_START
) -> KVQuantization | None:
    """The setting mlx-lm's three keywords name (None: a float cache); one-line ValueErrors."""
    if kv_bits is None:
        return None
    return KVQuantization(kv_bits, kv_group_size, quantized_kv_start)
