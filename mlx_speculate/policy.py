"""How many tokens to draft each step."""

from __future__ import annotations

from bisect import bisect_left
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


GAIN_PRIOR = 8
GAIN_WINDOW = 64
DENSE = 8  # every draft length up to this is a candidate; longer ones grow by GROWTH
GROWTH = 1.5


def candidate_lengths(max_k: int) -> tuple[int, ...]:
    """Draft lengths the adaptive policy weighs: 0..8, then steps of x1.5 up to `max_k`, so a
    60-node tree is searched in a dozen sizes rather than sixty."""
    sizes = list(range(min(max_k, DENSE) + 1))
    while sizes[-1] < max_k:
        sizes.append(min(max_k, round(sizes[-1] * GROWTH)))
    return tuple(sizes)


def _typical(seconds: deque[float]) -> float:
    """Mean step time without outliers (> 3x the median). A mean, not the median: plain steps
    queued on top of each other can finish in pairs, the first seemingly costing two forwards
    and the second none, which only an average charges correctly."""
    cap = 3 * median(seconds)
    kept = [t for t in seconds if t <= cap]
    return sum(kept) / len(kept)


class AdaptivePolicy:
    """Chooses the draft length that maximises expected tokens per second, from measurements.

    Per drafted count d it keeps the outlier-trimmed mean of the last `window` step times t(d)
    (draft and verify together; the first step at each d is dropped as warm-up); unmeasured d are
    interpolated between measured neighbours or extrapolated with the fitted slope, clamped at
    zero so that extrapolation is optimistic and gets tried. The acceptance rate a is a decayed
    count of accepted tokens against rejections (the maximum-likelihood estimate when every draft
    token is accepted with the same probability), so a step of k drafts yields
    E(k) = g(k) * (1 + a + ... + a^k) tokens, where the gain g(k) is the mean ratio of measured
    yield to that chain prediction at k (prior 1 with weight `GAIN_PRIOR` steps, up to
    `GAIN_WINDOW` measured): 1 for chains, above 1 for trees, whose k nodes over several
    branches yield more than a chain of k; a change in acceptance still shows at once through a.
    k = 0 (plain decoding) is a candidate like any other; the candidates are
    `candidate_lengths(max_k)`, every length up to 8 and then a coarser grid for trees.

    After a short warm-up over k in {0, 1}, now and then a step tries each neighbour of the best
    k, so costs stay measured near the choice without paying for far-off lengths: first
    `explore_every` steps after the best k last changed, then at doubling gaps (up to 8x)
    while it holds. The first drafting step after plain ones is not timed: a draft model then
    also catches up on the tokens it skipped, a cost that steady drafting does not pay. A probe
    whose first step goes untimed (that, or a length never run before) lasts two steps, and a
    probe from k = 0 goes on (up to 8 more steps) while its drafts are all accepted, unless
    drafting would not pay even if every draft were accepted.
    """

    def __init__(
        self, max_k: int = 8, window: int = 8, explore_every: int = 64, decay: float = 0.95
    ):
        if max_k < 0:
            raise ValueError(f"max_k must be >= 0, got {max_k}")
        self.max_k = max_k
        self.sizes = candidate_lengths(max_k)
        self.explore_every = explore_every
        self.decay = decay
        self._times: dict[int, deque[float]] = {}
        self._gains: dict[int, deque[float]] = {}
        self._warm: set[int] = set()
        self._hits = self._misses = 1.0  # a prior of acceptance 1/2, forgotten as steps come
        self._plan = [k for k in (1, 1, 0, 0) if k <= max_k]
        self._window = window
        self._best: int | None = None
        self._gap = self._until_probe = explore_every
        self._previous = 0  # drafted count of the last observed step
        self._all_accepted = False  # ... and whether all its drafts were accepted
        self._extra_probes = 0

    @property
    def acceptance(self) -> float:
        return self._hits / (self._hits + self._misses)

    def expected_tokens(self, k: int, acceptance: float | None = None) -> float:
        a = self.acceptance if acceptance is None else acceptance
        chain = sum(a**i for i in range(k + 1))
        if acceptance is not None:
            return chain
        gains = self._gains.get(k, ())
        return chain * (sum(gains) + GAIN_PRIOR) / (len(gains) + GAIN_PRIOR)

    def measured(self) -> dict[int, float]:
        """Seconds per step for each draft length measured so far: the cost curve it learned
        (verifying k nodes, drafting included)."""
        return {d: _typical(t) for d, t in self._times.items() if t}

    def cost(self, k: int) -> float | None:
        """Estimated seconds of a step drafting k tokens (None before any measurement)."""
        return self._costs(k)[k]

    def _costs(self, max_k: int) -> list[float | None]:
        """Estimated seconds for k = 0 .. max_k, from the measured medians."""
        known = sorted(self.measured().items())
        if not known:
            return [None] * (max_k + 1)
        lengths = [d for d, _ in known]
        slope = self._slope(known)
        costs = []
        for k in range(max_k + 1):
            i = bisect_left(lengths, k)  # known[i - 1] < k <= known[i]
            if i < len(known) and lengths[i] == k:
                costs.append(known[i][1])
            elif 0 < i < len(known):
                (d0, t0), (d1, t1) = known[i - 1], known[i]
                costs.append(t0 + (t1 - t0) * (k - d0) / (d1 - d0))
            else:
                d0, t0 = known[i - 1] if i else known[0]
                costs.append(max(t0 + slope * (k - d0), 1e-9))
        return costs

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

    def best(self, acceptance: float | None = None) -> int:
        """The k with the highest expected tokens per second (ties: the smaller k), at the
        estimated acceptance rate or the one given."""
        costs = self._costs(self.max_k)
        if costs[0] is None:
            return min(1, self.max_k)
        rates = {k: self.expected_tokens(k, acceptance) / costs[k] for k in self.sizes}
        return max(self.sizes, key=lambda k: (rates[k], -k))

    def choose(self) -> int:
        if self._plan:
            return self._plan.pop(0)
        best = self.best()
        if best != self._best:
            self._best, self._gap = best, self.explore_every
            self._until_probe = min(self._until_probe, self._gap)
        if best == 0 and self._all_accepted and self._extra_probes > 0 and self.best(1.0) > 0:
            # A probe away from plain decoding whose drafts all pass, where drafting would pay
            # at a high enough acceptance: gather more evidence now rather than one gap later.
            self._extra_probes -= 1
            return self._previous
        self._until_probe -= 1
        if self._until_probe > 0:
            return best
        self._gap = min(2 * self._gap, 8 * self.explore_every)
        self._until_probe = self._gap
        self._extra_probes = 8
        previous = best
        i = self.sizes.index(best)
        # The neighbouring lengths, the longer first: a step after k = 0 is not timed.
        for k in self.sizes[i + 1 : i + 2] + self.sizes[max(i - 1, 0) : i]:
            untimed = k not in self._warm or (k > 0 and previous == 0)
            self._plan.extend([k] * (2 if untimed else 1))
            previous = k
        return self._plan.pop(0) if self._plan else best

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        catch_up = drafted > 0 and self._previous == 0
        self._previous = drafted
        self._all_accepted = drafted > 0 and accepted == drafted
        if drafted not in self._warm:
            self._warm.add(drafted)  # first step at a new length: allocation, kernel set-up
        elif not catch_up:
            self._times.setdefault(drafted, deque(maxlen=self._window)).append(seconds)
        if drafted > 0:
            chain = self.expected_tokens(drafted, self.acceptance)
            gains = self._gains.setdefault(drafted, deque(maxlen=GAIN_WINDOW))
            gains.append((accepted + 1) / chain)
            self._hits = self.decay * self._hits + accepted
            self._misses = self.decay * self._misses + (accepted < drafted)


def default_policy(drafter, num_draft_tokens: int | None = None) -> Policy:
    """A fixed draft length when one is asked for, else the adaptive policy up to the
    drafter's own cap (`Drafter.max_draft`)."""
    if num_draft_tokens is not None:
        return FixedPolicy(num_draft_tokens)
    return AdaptivePolicy(drafter.max_draft)
