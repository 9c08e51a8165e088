"""How many tokens to draft each step."""

from __future__ import annotations

from collections import deque
from statistics import median
from typing import Protocol


class Policy(Protocol):
    def choose(self) -> int:
        """Draft tokens for the next step (0: plain decoding)."""

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        """The outcome of a step: tokens drafted, accepted, and its wall time."""


class FixedPolicy:
    """Always the same draft length (`num_draft_tokens` given explicitly)."""

    def __init__(self, k: int):
        if k < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {k}")
        self.k = k

    def choose(self) -> int:
        return self.k

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        pass


class AdaptivePolicy:
    """Chooses the draft length that maximises expected tokens per second, from measurements.

    Per drafted count d it keeps the median of the last `window` step times t(d) (draft and
    verify together; the first step at each d is dropped as warm-up); unmeasured d are
    interpolated between measured neighbours or extrapolated with the fitted slope, clamped at
    zero so that extrapolation is optimistic and gets tried. The acceptance rate a is a decayed
    count of accepted tokens against rejections (the maximum-likelihood estimate when every draft
    token is accepted with the same probability), so a step of k drafts yields
    E(k) = 1 + a + ... + a^k tokens. k = 0 (plain decoding) is a candidate like any other.

    After a short warm-up over k in {0, 1, 2}, every `explore_every`-th step tries a neighbour of
    the best k, so costs stay measured near the choice without paying for far-off lengths.
    """

    def __init__(
        self, max_k: int = 8, window: int = 8, explore_every: int = 32, decay: float = 0.98
    ):
        if max_k < 0:
            raise ValueError(f"max_k must be >= 0, got {max_k}")
        self.max_k = max_k
        self.explore_every = explore_every
        self.decay = decay
        self._times: dict[int, deque[float]] = {}
        self._warm: set[int] = set()
        self._hits = self._misses = 1.0  # a prior of acceptance 1/2, forgotten as steps come
        self._plan = [k for k in (1, 1, 0, 0, 2, 2) if k <= max_k]
        self._window = window
        self._steps = 0
        self._side = 1

    @property
    def acceptance(self) -> float:
        return self._hits / (self._hits + self._misses)

    def expected_tokens(self, k: int) -> float:
        a = self.acceptance
        return sum(a**i for i in range(k + 1))

    def cost(self, k: int) -> float | None:
        """Estimated seconds of a step drafting k tokens (None before any measurement)."""
        known = sorted((d, median(t)) for d, t in self._times.items() if t)
        if not known:
            return None
        measured = dict(known)
        if k in measured:
            return measured[k]
        below = [(d, t) for d, t in known if d < k]
        above = [(d, t) for d, t in known if d > k]
        if below and above:
            (d0, t0), (d1, t1) = below[-1], above[0]
            return t0 + (t1 - t0) * (k - d0) / (d1 - d0)
        d0, t0 = below[-1] if below else above[0]
        return max(t0 + self._slope(known) * (k - d0), 1e-9)

    @staticmethod
    def _slope(known: list[tuple[int, float]]) -> float:
        if len(known) < 2:
            return 0.0
        ds = [d for d, _ in known]
        ts = [t for _, t in known]
        mean_d, mean_t = sum(ds) / len(ds), sum(ts) / len(ts)
        num = sum((d - mean_d) * (t - mean_t) for d, t in known)
        den = sum((d - mean_d) ** 2 for d in ds)
        return max(num / den, 0.0)

    def best(self) -> int:
        """The k with the highest expected tokens per second (ties: the smaller k)."""
        if self.cost(0) is None:
            return min(1, self.max_k)
        rates = [self.expected_tokens(k) / self.cost(k) for k in range(self.max_k + 1)]
        return max(range(self.max_k + 1), key=lambda k: (rates[k], -k))

    def choose(self) -> int:
        self._steps += 1
        if self._plan:
            return self._plan.pop(0)
        best = self.best()
        if self._steps % self.explore_every == 0:
            self._side = -self._side
            neighbour = best + self._side
            return neighbour if 0 <= neighbour <= self.max_k else best - self._side
        return best

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        if drafted not in self._warm:
            self._warm.add(drafted)  # first step at a new length: allocation, kernel set-up
        else:
            self._times.setdefault(drafted, deque(maxlen=self._window)).append(seconds)
        if drafted > 0:
            self._hits = self.decay * self._hits + accepted
            self._misses = self.decay * self._misses + (accepted < drafted)
