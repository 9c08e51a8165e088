"""Shaping the next-token distribution (temperature, top-k, top-p, min-p) and sampling from it."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import mlx.core as mx

from .graphs import variable

MAX_SEED = 2**64 - 1  # MLX's generator takes an unsigned 64-bit seed


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings; temperature 0 means greedy decoding, where top_p, top_k and min_p
    have no effect (the CLI refuses them there; the API takes them, as OpenAI clients send
    them along)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            _check_type(name, value, numbers.Real, "a number")
            try:  # as a float: MLX takes no Python int past 64 bits (`temperature=2**64`)
                object.__setattr__(self, name, float(value))
            except OverflowError:
                raise ValueError(f"{name} must be finite, got {value}") from None
        _check_type("top_k", self.top_k, numbers.Integral, "an integer")
        if self.seed is not None:
            _check_type("seed", self.seed, numbers.Integral, "an integer or None")
            if not 0 <= self.seed <= MAX_SEED:
                raise ValueError(f"seed must be in [0, 2**64 - 1], got {self.seed}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_type(name: str, value: object, kind: type, what: str) -> None:
    # bool is an int to Python, but `top_k=True` is a mistake, not a 1.
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"{name} must be {what}, got {value!r}")


def log_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Normalised float32 log-probabilities over the last axis of (..., V) logits.

    Filters run in Hugging Face's order (temperature, top-k, top-p, min-p); removed tokens get
    -inf. Greedy params give a point mass at the argmax, so verification treats both alike.
    """
    logits = logits.astype(mx.float32)
    if params.greedy:
        return _point_mass(logits)
    logits = logits / variable(params.temperature, mx.float32)
    if 0 < params.top_k < logits.shape[-1]:
        logits = _top_k(logits, params.top_k)
    if params.top_p < 1:
        logits = _top_p(logits, params.top_p)
    if params.min_p > 0:
        logits = _min_p(logits, params.min_p)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def sample(logprobs: mx.array, key: mx.array | None = None) -> mx.array:
    """One categorical draw over the last axis: (..., V) -> (...) int32."""
    return mx.random.categorical(logprobs, axis=-1, key=key).astype(mx.int32)


def pick(
    logits: mx.array, params: SamplingParams, key: mx.array | None = None
) -> tuple[mx.array, mx.array | None]:
    """The next token from (..., V) logits, lazily: the argmax when greedy, else a draw (from
    `key`, or the global generator) from the processed distribution, which comes back too
    ((..., V); None when greedy)."""
    if params.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32), None
    logprobs = log_probs(logits, params)
    return sample(logprobs, key), logprobs


def _point_mass(logits: mx.array) -> mx.array:
    best = mx.argmax(logits, axis=-1, keepdims=True)  # (..., 1)
    return mx.where(mx.arange(logits.shape[-1]) == best, 0.0, -mx.inf)


def _top_k(logits: mx.array, k: int) -> mx.array:
    # Ties with the k-th largest logit survive, as in Hugging Face.
    kth = mx.min(mx.topk(logits, k, axis=-1), axis=-1, keepdims=True)  # (..., 1)
    return mx.where(logits < kth, -mx.inf, logits)


def _top_p(logits: mx.array, top_p: float) -> mx.array:
    probs = mx.softmax(logits, axis=-1)
    ordered = -mx.sort(-probs, axis=-1)  # (..., V) descending
    ahead = mx.cumsum(ordered, axis=-1, inclusive=False)  # mass ranked before each token
    # The kept tokens are a prefix of `ordered` (the top one always, since ahead == 0 there);
    # thresholding at its smallest member avoids scattering the mask back to vocabulary order.
    cutoff = mx.min(
        mx.where(ahead < variable(top_p, mx.float32), ordered, mx.inf), axis=-1, keepdims=True
    )
    return mx.where(probs < cutoff, -mx.inf, logits)


def _min_p(logits: mx.array, min_p: float) -> mx.array:
    # p < min_p * max(p), compared in log space so no softmax is needed.
    top = mx.max(logits, axis=-1, keepdims=True)  # (..., 1)
    return mx.where(logits - top < variable(math.log(min_p), mx.float32), -mx.inf, logits)
