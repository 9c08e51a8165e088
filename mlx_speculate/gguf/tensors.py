"""GGUF tensor data as float32 or as MLX affine-quantized triples.

Every type the `gguf` package dequantizes is read. MLX's affine quantization (w = scale * q +
bias per group of 32) holds nine llama.cpp types exactly, so `keep` returns them as triples bit
for bit: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (one scale per 32), Q4_K, Q5_K (a 6-bit scale and min per
32 under a float16 super-scale: d * sc is exact in float32, not in float16) and the ternary
TQ1_0, TQ2_0 (levels d * (q - 1): 2 bits). Scales and biases are float16 where that is exact,
else float32. The other quantized types (16-value groups: Q2_K, Q3_K, Q6_K; non-uniform levels:
IQ*, MXFP4, NVFP4) have no exact MLX form: `keep` dequantizes them and quantizes again at group
size 32 with the bits of the type. Float types come back as float32 either way. Matrices and
stacks of expert matrices (E, rows, cols) are kept alike.

`take_rows`, `take_columns` and `concat_rows` move a tensor's output or input features, kept
quantized where that is exact (whole rows; whole groups of 32 columns), for the architectures
whose llama.cpp layout reorders or splits HF's projections.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import mlx.core as mx
import numpy as np

Q = gguf.GGMLQuantizationType
GROUP_SIZE = 32
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
KEPT_BITS = {
    Q.Q4_0: 4,
    Q.Q4_1: 4,
    Q.Q5_0: 5,
    Q.Q5_1: 5,
    Q.Q8_0: 8,
    Q.Q4_K: 4,
    Q.Q5_K: 5,
    Q.TQ1_0: 2,
    Q.TQ2_0: 2,
}
REQUANTIZED_BITS = {
    Q.Q2_K: 2,
    Q.Q3_K: 3,
    Q.Q6_K: 6,
    Q.IQ1_S: 2,
    Q.IQ1_M: 2,
    Q.IQ2_XXS: 2,
    Q.IQ2_XS: 2,
    Q.IQ2_S: 2,
    Q.IQ3_XXS: 3,
    Q.IQ3_S: 3,
    Q.IQ4_NL: 4,
    Q.IQ4_XS: 4,
    Q.MXFP4: 4,
    Q.NVFP4: 4,
}
SUPPORTED_TYPES = (*FLOAT_TYPES, *KEPT_BITS, *REQUANTIZED_BITS)
QUANTIZED_PARTS = ("weight", "scales", "biases")


@dataclass(frozen=True)
class Quantized:
    """An MLX affine triple (group size 32), rows as in the file."""

    weight: np.ndarray  # uint32, ([E,] rows, cols * bits / 32)
    scales: np.ndarray  # float16 or float32, ([E,] rows, cols / 32)
    biases: np.ndarray
    bits: int
    exact: bool  # the file's own values (kept), or quantized again

    @property
    def shape(self) -> tuple[int, ...]:
        """The matrix's (or expert stack's) own shape."""
        return (*self.weight.shape[:-1], self.weight.shape[-1] * 32 // self.bits)

    def rows(self, order: np.ndarray) -> Quantized:
        """The rows (output features, axis -2) `order` picks: every part holds one row per
        output feature."""
        return Quantized(
            self.weight[..., order, :],
            self.scales[..., order, :],
            self.biases[..., order, :],
            self.bits,
            self.exact,
        )

    def columns(self, order: np.ndarray) -> Quantized | None:
        """The input features permuted by `order`, where it moves whole groups of 32 (a group
        is `bits` packed words and one scale and bias); None where it splits a group."""
        groups = order.reshape(-1, GROUP_SIZE)
        starts = groups[:, 0]
        aligned = np.array_equal(groups, starts[:, None] + np.arange(GROUP_SIZE))
        if not aligned or np.any(starts % GROUP_SIZE):
            return None
        moved = starts // GROUP_SIZE
        words = self.weight.reshape(*self.weight.shape[:-1], -1, self.bits)[..., moved, :]
        return Quantized(
            words.reshape(self.weight.shape),
            self.scales[..., moved],
            self.biases[..., moved],
            self.bits,
            self.exact,
        )

    def dequantize(self) -> np.ndarray:
        parts = (mx.array(self.weight), mx.array(self.scales), mx.array(self.biases))
        w = mx.dequantize(
            parts[0],
            parts[1].astype(mx.float32),
            parts[2].astype(mx.float32),
            group_size=GROUP_SIZE,
            bits=self.bits,
        )
        return np.array(w)


Value = np.ndarray | Quantized


def take_rows(value: Value, order: np.ndarray) -> Value:
    """The output features (axis -2) of a matrix or expert stack that `order` picks."""
    return value.rows(order) if isinstance(value, Quantized) else value[..., order, :]


def take_columns(value: Value, order: np.ndarray) -> Value:
    """The input features permuted by `order`: kept quantized where whole groups move, else
    dequantized (a group's scale cannot follow its values apart)."""
    if isinstance(value, Quantized):
        moved = value.columns(order)
        return moved if moved is not None else value.dequantize()[..., order]
    return value[..., order]


def concat_rows(parts: list[Value]) -> Value:
    """Matrices stacked along their output features: quantized ones of one width stay
    quantized; any other mixture comes back as float32."""
    if all(isinstance(p, Quantized) for p in parts) and len({p.bits for p in parts}) == 1:
        return Quantized(
            *(np.concatenate([getattr(p, k) for p in parts], axis=-2) for k in QUANTIZED_PARTS),
            parts[0].bits,
            all(p.exact for p in parts),
        )
    floats = [p.dequantize() if isinstance(p, Quantized) else p for p in parts]
    return np.concatenate(floats, axis=-2)


def check_type(kind: Q, name: str) -> None:
    if kind not in SUPPORTED_TYPES:
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(
            f"tensor {name!r} has GGUF type {kind.name}, which is not supported "
            f"(supported: {supported})"
        )


def read_tensor(
    raw: np.ndarray, kind: Q, shape: tuple[int, ...], keep: bool
) -> np.ndarray | Quantized:
    """`raw` (the tensor's bytes) as float32 of `shape`, or with `keep` a quantized matrix or
    (E, rows, cols) expert stack as a triple (exact for the kept types, quantized again for
    the others)."""
    rows = raw.reshape(-1, raw.size // max(1, _rows(shape)))  # (rows, bytes per row)
    cols = shape[-1] if shape else 1
    matrix = len(shape) in (2, 3)
    if keep and matrix and kind in KEPT_BITS:
        q, scales, biases = _UNPACK[kind](rows.reshape(-1, gguf.GGML_QUANT_SIZES[kind][1]))
        lead = shape[:-1]
        return Quantized(
            pack(q.reshape(rows.shape[0], cols), KEPT_BITS[kind]).reshape(*lead, -1),
            _narrow(scales.reshape(*lead, -1)),
            _narrow(biases.reshape(*lead, -1)),
            KEPT_BITS[kind],
            exact=True,
        )
    values = gguf.quants.dequantize(rows, kind).reshape(shape).astype(np.float32, copy=False)
    if keep and matrix and kind in REQUANTIZED_BITS and cols % GROUP_SIZE == 0:
        bits = REQUANTIZED_BITS[kind]
        w, scales, biases = mx.quantize(mx.array(values), group_size=GROUP_SIZE, bits=bits)
        return Quantized(np.array(w), np.array(scales), np.array(biases), bits, exact=False)
    return values


def _rows(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape[:-1])) if len(shape) > 1 else 1


def _narrow(x: np.ndarray) -> np.ndarray:
    """float16 when every value survives the cast, else float32."""
    with np.errstate(over="ignore"):
        half = x.astype(np.float16)
    return half if np.array_equal(half.astype(np.float32), x) else x


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """(rows, cols) integers below 2**bits as MLX packs them: one little-endian bit stream per
    row, value i at bits [i * bits, (i + 1) * bits), read as uint32 words."""
    out = []
    for start in range(0, q.shape[0], 4096):  # the bit expansion is 8x the values
        chunk = q[start : start + 4096].astype(np.uint8)
        stream = np.unpackbits(chunk[..., None], axis=-1, bitorder="little")[..., :bits]
        packed = np.packbits(stream.reshape(chunk.shape[0], -1), axis=-1, bitorder="little")
        out.append(packed.view("<u4"))
    return np.concatenate(out).astype(np.uint32, copy=False)


# -- block layouts (ggml-quants.c; the gguf package's quants.py reads them alike) ----------
# Each takes (blocks, bytes) uint8 and returns q (blocks, values) and per-32 scale and bias
# (float32) with value = scale * q + bias, exactly.


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # Within a 32-value run, bytes hold value j (low nibble) and value j + 16 (high nibble).
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    # Q5_0/Q5_1: bit j of the little-endian word is the fifth bit of value j.
    return np.unpackbits(qh, axis=-1, bitorder="little") << 4


def _q4_0(b: np.ndarray):
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:]), d, -8 * d


def _q4_1(b: np.ndarray):
    return _nibbles(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_0(b: np.ndarray):
    d = _f16(b[:, :2])
    return _nibbles(b[:, 6:]) | _high_bits(b[:, 2:6]), d, -16 * d


def _q5_1(b: np.ndarray):
    return _nibbles(b[:, 8:]) | _high_bits(b[:, 4:8]), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q8_0(b: np.ndarray):
    d = _f16(b[:, :2])
    q = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, -128 * d


def _k_scales(b: np.ndarray):
    """Q4_K/Q5_K super-block header: d, dmin, then eight 6-bit scales and mins in 12 bytes."""
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, m = gguf.quants.Q4_K.get_scale_min(b[:, 4:16])
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q4_k(b: np.ndarray):
    scales, biases = _k_scales(b)
    qs = b[:, 16:].reshape(-1, 4, 32)  # four runs of 64 values: low nibbles, then high
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(b.shape[0], 256)
    return q, scales, biases


def _q5_k(b: np.ndarray):
    scales, biases = _k_scales(b)
    qh, qs = b[:, 16:48], b[:, 48:].reshape(-1, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # bit j: run j
    return (low | (high << 4)).reshape(b.shape[0], 256), scales, biases


def _ternary(kind: Q):
    """TQ1_0/TQ2_0: value = d * (q - 1), d the block's last two bytes; q read back from the
    gguf package's values (TQ1_0 packs base 3), exactly, as d * (q - 1) is exact."""

    def unpack(b: np.ndarray):
        d = _f16(b[:, -2:])
        values = gguf.quants.dequantize(b, kind)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(d == 0, 0, np.rint(values / d)) + 1
        d32 = np.repeat(d, 8, axis=1)  # one scale per group of 32
        return q.astype(np.uint8), d32, -d32

    return unpack


_UNPACK = {
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q8_0: _q8_0,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.TQ1_0: _ternary(Q.TQ1_0),
    Q.TQ2_0: _ternary(Q.TQ2_0),
}
