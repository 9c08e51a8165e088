"""How many rows each sequence of a batch verifies per step: the cost model of a batch.

A batch forward pads every sequence to the same number of rows N (its pending token and up to
N - 1 drafts), so its cost depends on (batch size B, width N), and a sequence's extra drafts
are free up to the widest one's. The planner picks the N that maximises expected tokens per
second over the batch,

    sum over sequences of (1 + r + r^2 + ... + r^min(N - 1, cap))  /  seconds(B, N),

from each sequence's measured acceptance rate r per draft token (a chain's expected run) and
its draft cap (its drafter's longest proposal, or none), and the seconds of (B, N) forwards
measured in this process. Cells not measured yet are priced from the measured ones as a fixed
cost plus one per row, fitted by least squares over rows B * N; before a second row count is
measured, from the target's calibrated verify curve (policy/costs.py: one forward over B * N
rows, what the single-stream policy prices its steps by) where one is cached, else
PRIOR_FIXED_ROWS rows' worth of fixed cost; every EXPLORE_EVERY steps the width
next to the best one is tried, so the fit follows what the machine really does. A compute-
bound batch (a wide one on a slow machine) gets N = 1, plain decoding: speculation and
batching spend the same rows, and the planner spends them where they yield more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .costs import StepCosts

PRIOR_FIXED_ROWS = 10.0  # fixed cost of a forward in rows, until two row counts are measured
PRIOR_RATE = 0.6  # acceptance rate per draft token of a sequence not yet measured
EXPLORE_EVERY = 16  # steps between tries of a width next to the chosen one
DECAY = 0.8  # weight of the old estimate in each moving average
MAX_WIDTH = 9  # rows per sequence a step verifies at most: its pending token and 8 drafts


@dataclass
class Acceptance:
    """A sequence's running acceptance rate per draft token (accepted / drafted)."""

    rate: float = PRIOR_RATE

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self.rate = DECAY * self.rate + (1 - DECAY) * accepted / drafted


def expected_tokens(rate: float, drafts: int) -> float:
    """Tokens a verify of a chain of `drafts` yields on average: 1 + r + ... + r^drafts."""
    return sum(rate**i for i in range(drafts + 1))


class BatchPlanner:
    """Chooses each step's width from measured step costs and acceptance (see the module)."""

    def __init__(self, prior: StepCosts | None = None, max_width: int = MAX_WIDTH):
        """`prior`: the target's calibrated costs, which price rows until measured ones do."""
        self.prior = prior
        self.max_width = max_width
        self._seconds: dict[tuple[int, int], float] = {}  # (B, N) -> moving average
        self._steps = 0

    def width(self, batch: int, caps: Sequence[int], rates: Sequence[float], least: int = 1) -> int:
        """The rows per sequence for a step of `batch` rows (bucketed) whose sequences may
        draft up to caps[i] tokens at acceptance rates[i], at least `least` (a request that
        fixed its draft length gets it)."""
        top = max(least, min(self.max_width, 1 + max(caps, default=0)))
        if top == least:
            return least

        def throughput(n: int) -> float:
            tokens = sum(
                expected_tokens(r, min(n - 1, c)) for c, r in zip(caps, rates, strict=True)
            )
            return tokens / self.seconds(batch, n)

        best = max(range(least, top + 1), key=throughput)
        self._steps += 1
        if self._steps % EXPLORE_EVERY == 0:  # measure a neighbour, one not measured first
            near = [n for n in (best - 1, best + 1) if least <= n <= top]
            unseen = [n for n in near if (batch, n) not in self._seconds]
            best = (unseen or near)[0] if near else best
        return best

    def _prior_curve(self, rows: int) -> float:
        """A forward over `rows` rows before any fit: the calibrated verify curve, else a
        fixed cost of PRIOR_FIXED_ROWS rows plus one a row (only ratios matter then)."""
        if self.prior is not None and self.prior.verify:
            return self.prior.verify_cost(rows)
        return PRIOR_FIXED_ROWS + rows

    def observe(self, batch: int, width: int, seconds: float) -> None:
        """A (batch, width) forward's step took `seconds`."""
        key = (batch, width)
        old = self._seconds.get(key)
        self._seconds[key] = seconds if old is None else DECAY * old + (1 - DECAY) * seconds

    def seconds(self, batch: int, width: int) -> float:
        """The measured or fitted seconds of a (batch, width) step (before two row counts
        are measured: the prior's curve, scaled to the one measured)."""
        if (batch, width) in self._seconds:
            return self._seconds[(batch, width)]
        points = [(b * n, s) for (b, n), s in self._seconds.items()]
        rows = batch * width
        if len({r for r, _ in points}) < 2:
            curve = self._prior_curve
            if not points:
                return curve(rows)
            r0, s0 = points[0]
            return s0 * curve(rows) / curve(r0)
        n = len(points)
        mean_r = sum(r for r, _ in points) / n
        mean_s = sum(s for _, s in points) / n
        var = sum((r - mean_r) ** 2 for r, _ in points)
        slope = max(0.0, sum((r - mean_r) * (s - mean_s) for r, s in points) / var)
        fixed = max(mean_s - slope * mean_r, 1e-6)
        return fixed + slope * rows
