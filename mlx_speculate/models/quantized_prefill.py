"""Fast prefill of quantized models on MLX's CPU backend.

The CPU's quantized matmul costs time linear in its rows, so a long prompt of a 4-bit model
prefills no faster than it decodes. Dequantizing a layer's weights once (about the cost of a
few rows) and taking the float matmul, which goes through BLAS, makes the rows nearly free.
This is done only while `prefilling()` is active (the decoder's prompt forwards) and only for
inputs of at least `MIN_ROWS` rows: decoding and verification keep the quantized kernel, so
greedy speculative and greedy plain decoding still share every forward's arithmetic after the
prompt. `install` swaps the layers in at load time, on the CPU only (Metal's quantized kernels
are fast at any width).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

MIN_ROWS = 4  # below this the quantized kernel is faster than dequantizing

_PREFILLING = contextvars.ContextVar("prefilling", default=False)


@contextmanager
def prefilling() -> Iterator[None]:
    """Inside: wide matmuls of installed layers dequantize (graphs built here, lazily)."""
    token = _PREFILLING.set(True)
    try:
        yield
    finally:
        _PREFILLING.reset(token)


class PrefillQuantizedLinear(nn.QuantizedLinear):
    """A QuantizedLinear (same parameters, same names) whose wide inputs take the float matmul
    on dequantized weights while `prefilling()` is active."""

    def __call__(self, x: mx.array) -> mx.array:
        if not _PREFILLING.get() or x.size < MIN_ROWS * x.shape[-1]:
            return super().__call__(x)
        weight = mx.dequantize(
            self["weight"],
            self["scales"],
            self.get("biases"),
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
        x = x @ weight.T
        if "bias" in self:
            x = x + self["bias"]
        return x


def install(model: nn.Module) -> int:
    """Turns every QuantizedLinear of `model` into a PrefillQuantizedLinear (the same object,
    its class swapped: parameters, names and loaded state stay as they are); returns how many."""
    count = 0
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedLinear:
            module.__class__ = PrefillQuantizedLinear
            count += 1
    return count
