"""How many tokens to draft each step: a fixed number, or the number with the most expected
tokens per second under measured costs (costs.py) and the acceptance seen so far."""

from __future__ import annotations

import logging
from collections import deque
from statistics import median
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .costs import StepCosts

log = logging.getLogger(__name__)


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


DENSE = 8  # every draft length up to this is a candidate; longer ones grow by GROWTH
GROWTH = 1.5


def candidate_lengths(max_k: int) -> tuple[int, ...]:
    """Draft lengths the adaptive policy weighs: 0..8, then steps of x1.5 up to `max_k`, so a
    60-node tree is searched in a dozen sizes rather than sixty."""
    sizes = list(range(min(max_k, DENSE) + 1))
    while sizes[-1] < max_k:
        sizes.append(min(max_k, round(sizes[-1] * GROWTH)))
    return tuple(sizes)


PRIOR = 2.0  # weight, in steps, of the prior behind each estimate
PROBE_BUDGET = 0.02  # share of plain decoding time that re-checking a switched-off drafter costs
SEEN = 9  # recent step times whose median prices a size: a compile or a pause is one outlier
LEVEL = 5  # recent priced steps whose median ratio to their prices is the load now
SPREAD = 2.0  # other sizes' ratios further apart than this: the load moved, no price
TRUSTED = 3  # steps at a size before their times replace its calibrated price
SWITCH_GAIN = 0.05  # how much faster another drafting size must look to move to it
CARRIED = 8.0  # steps' weight of a drafter's last generation in the next one's acceptance


class Prices:
    """Seconds a step drafting k costs at the calibration's load (`seconds`: at the load now),
    for each of `sizes`: first as calibrated (`StepCosts`), then as decoding pays them, which is
    more than the calibration sees (a fused EAGLE step also runs the head over the accepted path
    and grows the next tree; a drafter back from plain steps catches up first) or less (a plain
    step overlaps the one before). A size with `TRUSTED` recent steps costs their median; any
    other drafting size is priced from those (`_untried`: between plain decoding and the
    smallest paid size, or on the line through the paid prices against the calibrated ones;
    before two sizes are paid, its calibrated cost plus the median amount by which recent
    drafting steps exceeded theirs). The first drafting step after plain ones prices the
    catch-up instead (its time over its size's price, a median). Otherwise only a step between
    two steps of its own size is priced: a step's wall time also holds the building of the step
    queued after it, which a step before another size does not queue (it reads at once), and the
    first step at another size builds its own draft (a fused EAGLE step grows only the next tree
    of its own size, so a switch costs a step several times a steady one). A generation's first
    step is beside nothing. A step that traced a graph comes with no time
    (`decode.Step.traced`). A property of the machine, model and drafter, unlike acceptance:
    `default_policy` shares one between the generations of a drafter, and between drafters over
    the same weights.

    Prices are held at the calibration's load: other processes slow every size alike, for
    tens of steps at a time, so each priced step's time is first divided by the `level`, the
    median ratio of the last `LEVEL` priced steps' times to their prices. Steps of one size
    alone only move the level; a size's price moves against steps of other sizes timed just
    before it (the held size's around an explored one, plain steps around a re-check). Priced
    by absolute times, plain steps timed in a busy moment and drafting ones in a calm one
    (or the reverse) switched drafting on where it was slower than plain (or off where it
    paid)."""

    def __init__(self, costs: StepCosts, sizes: tuple[int, ...]):
        self.costs = costs
        self.calibrated = {k: costs.step(k) for k in sizes}
        # Read every step (a tiny model's step is short): kept up to date in `observe` rather
        # than computed when read.
        self.step = dict(self.calibrated)
        self._seen: dict[int, deque[float]] = {}  # k -> recent wall times of steps drafting k
        self._excess: deque[float] = deque(maxlen=SEEN)  # drafting steps: seen - calibrated
        self._catch_ups: deque[float] = deque(maxlen=SEEN)
        self.catch_up = costs.catch_up  # a drafting step's extra cost after plain ones
        self._recent: deque[tuple[int, float]] = deque(maxlen=LEVEL)  # (k, seconds) priced
        self.level = 1.0  # how much slower steps run now than when calibrated

    def seconds(self, k: int) -> float:
        """What a step drafting k costs at the load now."""
        return self.step[k] * self.level

    def trusted(self, k: int) -> bool:
        """Whether the price of k comes from steps decoding paid."""
        return len(self._seen.get(k, ())) >= TRUSTED

    def observe(
        self, drafted: int, seconds: float, after_plain: bool = False, switched: bool = False
    ) -> None:
        """Corrects the prices with one step's wall time (0: not timed); `after_plain`: the
        step before it drafted nothing; `switched`: a step beside it has another size (or it
        came first)."""
        catch_up = drafted > 0 and after_plain
        if seconds <= 0 or drafted not in self.calibrated or (switched and not catch_up):
            return
        if catch_up:  # at the level of the plain steps before it
            self._catch_ups.append(seconds / self.level - self.step[drafted])  # noise either way
            self.catch_up = max(0.0, median(self._catch_ups))
            return
        self._recent.append((drafted, seconds))
        # Ratios to the prices as they are now (a size's first steps move its price at once),
        # of other sizes where two are at hand: steps of one size alone would confirm its
        # price whatever it is (a wrong calibrated one stayed wrong), and only move
        # the level once the size has a price of its own.
        ratios = [t / self.step[k] for k, t in self._recent]
        others = [r for (k, _), r in zip(self._recent, ratios, strict=True) if k != drafted]
        self.level = median(others if len(others) >= 2 else ratios)
        if len(others) < 2 and self.trusted(drafted):
            return
        if len(others) >= 2 and max(others) > SPREAD * min(others):
            return  # the load changed within the window: no level to price against
        seconds /= self.level
        seen = self._seen.setdefault(drafted, deque(maxlen=SEEN))
        seen.append(seconds)
        if len(seen) >= TRUSTED:
            self.step[drafted] = median(seen)
        if not drafted:
            return
        self._excess.append(seconds - self.calibrated[drafted])
        self._untried()

    def _untried(self) -> None:
        """Prices the drafting sizes without steps of their own from those with: below the
        smallest paid size, between plain decoding's price and its, in proportion to their
        calibrated costs; otherwise on the line through the paid prices against the calibrated
        ones once two sizes have theirs (else the calibrated price plus the median excess);
        never below a smaller size's price nor half the calibrated one. A shift alone priced
        sizes far from the tried ones as if rows cost what they did when calibrating: where
        they cost less, the best size, a few sizes up, looked no better than the held one and
        neighbour-by-neighbour exploration took hundreds of steps a size to reach it; where
        they cost more, one long draft tried first priced every shorter one above plain
        decoding, and drafting went off for good."""
        paid = {k: self.step[k] for k in self.calibrated if k and self.trusted(k)}
        line = _fit([self.calibrated[k] for k in paid], list(paid.values()))
        excess = median(self._excess)
        low = min(paid, default=0)
        for k, calibrated in self.calibrated.items():
            if not k or k in paid:
                continue
            if k < low and self.trusted(0):
                start, end = self.calibrated[0], self.calibrated[low]
                share = (calibrated - start) / (end - start) if end > start else 1.0
                price = self.step[0] + share * (self.step[low] - self.step[0])
            elif line is not None:
                price = line[0] + line[1] * calibrated
            else:
                price = calibrated + excess
            below = max((p for j, p in paid.items() if j < k), default=0.0)
            self.step[k] = max(price, below, calibrated / 2)


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """(intercept, slope >= 0) of the least-squares line through the points, or None while
    fewer than two distinct xs make one."""
    if len(set(xs)) < 2:
        return None
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread)
    return mean_y - slope * mean_x, slope


class AdaptivePolicy:
    """Chooses the draft length k (0: plain decoding) with the most expected tokens per second,
    E(k) / price(k). The prices (`Prices`) start from the costs measured once per machine and
    model (`StepCosts`, from costs.py: draft cost plus one target forward over k + 1
    rows), so no step is spent timing, and follow the wall times of the steps decoding pays;
    acceptance is learned from every step's outcome. Prices that have no plain step's time yet
    get `TRUSTED` plain steps first: every draft length is weighed against plain decoding, and a
    calibrated one-row forward is not what a plain step costs (it overlaps the one before).

    E(k), the tokens a step of k drafts yields: per draft depth d, the chance q_d that the d-th
    token passes once the ones before it did (decayed counts, behind a prior of the depth
    above's q), gives a chain's 1 + q_1 + q_1 q_2 + .... For a drafter of trees (`costs.trees`) that
    is only the prior (weight `PRIOR` steps) of what steps of k nodes yielded (a mean decayed
    over ~50 steps at that size), since a tree of k nodes over several branches yields more
    than a chain of k, by an amount that depends on k. A larger tree holds the smaller one
    (its best nodes by probability), so E never falls with k.

    While drafting, the size held changes (to another size or to plain decoding) only for one
    `SWITCH_GAIN` faster. Exploration: every `explore_every` steps three steps try a
    neighbouring size, the one above and the one below in turn (a tree's yield at a size is
    only known by trying it; only the middle step is priced, see `Prices`). Switched off
    (best k = 0, or drafting could not pay even if every draft passed), a drafter is
    re-checked with three steps of the cheapest draft that could pay (judged as soon as they
    are read), at gaps that keep that check (and a draft model's catch-up on the skipped
    tokens) within `PROBE_BUDGET` of plain decoding time, doubling while it stays off;
    where the prior says drafting does not pay, the first check comes at once for drafters
    with no catch-up and after one gap for the others. Switching off and on again is logged
    (`--verbose` shows it).
    """

    def __init__(
        self,
        costs: StepCosts,
        max_k: int = 8,
        decay: float = 0.95,
        explore_every: int = 32,
        prices: Prices | None = None,
        before: AdaptivePolicy | None = None,
    ):
        if max_k < 0:
            raise ValueError(f"max_k must be >= 0, got {max_k}")
        self.costs = costs
        self.max_k = max_k
        self.sizes = candidate_lengths(max_k)
        self.decay = decay
        self.explore_every = explore_every
        self._passed = [0.0] * max_k  # decayed passes of the token at depth d + 1 ...
        self._tried = [0.0] * max_k  # ... and how often it was verified after its parent passed
        self._yield: dict[int, list[float]] = {}  # trees: k -> [decayed tokens, steps]
        self._plan: list[int] = []
        self._until_explore = explore_every
        self._gap = 0  # plain steps between re-checks while switched off
        self._checking = False  # a re-check's steps are planned: judge them next
        self.drafting: bool | None = None  # whether the last choice drafted (None: none yet)
        self._last: int | None = None  # the last observed step's draft length
        self._held = 0  # the drafting size chosen last (exploration aside)
        self._next: int | None = None  # the last choice: the step after the one observed
        self._up = False  # the last exploration's turn was the size above
        self._look_around()
        self.prices = prices or Prices(costs, self.sizes)
        # Plain steps to time first: the first and last of them are beside other sizes.
        self._timing = 0 if self.prices.trusted(0) else TRUSTED + 2
        self._step = self.prices.step  # kept current by the prices
        # Judged on the calibration: prices from a slow moment must not rule drafting out
        # for good (re-checks go to these sizes).
        calibrated = self.prices.calibrated
        self._useful = [k for k in self.sizes if k and (k + 1) * calibrated[0] > calibrated[k]]
        if not self._useful and max_k:
            log.info("drafting off: even if every draft passed it would not pay here")
        if before is not None and before.max_k == max_k:
            self._carry(before)

    def _carry(self, before: AdaptivePolicy) -> None:
        """Goes on from where the drafter's last generation left off: its acceptance, worth
        at most `CARRIED` steps (it depends on the prompt, but says more of the next one than
        the prior of 1/2), whether it drafted and its size, and the exploration and re-check
        schedule. Started afresh, a head that passes most drafts looks like a coin to every
        generation, and one switched off waits a new gap: short generations end first."""
        self.drafting, self._held, self._gap = before.drafting, before._held, before._gap
        self._until_explore, self._up = before._until_explore, before._up
        self._backoff, self._skips = dict(before._backoff), dict(before._skips)
        tried = before._tried[0] if before._tried else 0.0
        scale = min(1.0, CARRIED / tried) if tried else 0.0
        self._passed = [scale * p for p in before._passed]
        self._tried = [scale * t for t in before._tried]
        for k, (tokens, steps) in before._yield.items():
            kept = min(1.0, CARRIED / steps) if steps else 0.0
            self._yield[k] = [kept * tokens, kept * steps]

    @property
    def acceptance(self) -> float:
        """The pooled chance that a verified draft token passes (prior 1/2)."""
        return (sum(self._passed) + 1) / (sum(self._tried) + 2)

    def expected_tokens(self, k: int, acceptance: float | None = None) -> float:
        """Tokens a step drafting k yields: at the given per-token acceptance, or as learned."""
        if acceptance is not None:
            return sum(acceptance**i for i in range(k + 1))
        return self._learned(k, self._chains(k)[k])

    def _learned(self, k: int, chain: float) -> float:
        """A tree drafter's yield at size k behind the prior of a chain's; a chain's as is."""
        if not self.costs.trees:
            return chain
        tokens, steps = self._yield.get(k, (0.0, 0.0))
        return (tokens + PRIOR * chain) / (steps + PRIOR)

    def _chains(self, k: int) -> list[float]:
        """[1, 1 + q_1, 1 + q_1 + q_1 q_2, ...] up to depth k, from the per-depth counts; each
        depth's prior is the estimate of the depth above it (the first's, the pooled rate), so
        depths never verified yet go on like the deepest ones that were."""
        q, chains, reach = self.acceptance, [1.0], 1.0
        for d in range(k):
            q = (self._passed[d] + PRIOR * q) / (self._tried[d] + PRIOR)
            reach *= q
            chains.append(chains[-1] + reach)
        return chains

    def rates(self, acceptance: float | None = None) -> dict[int, float]:
        """Expected tokens per second of each candidate k (E never falls with k)."""
        chains = None if acceptance is not None else self._chains(self.sizes[-1])
        rates, floor = {}, 0.0
        for k in self.sizes:
            tokens = (
                self.expected_tokens(k, acceptance)
                if chains is None
                else self._learned(k, chains[k])
            )
            floor = max(floor, tokens)
            rates[k] = floor / self._step[k]
        return rates

    def best(self, acceptance: float | None = None) -> int:
        """The k with the most expected tokens per second (ties: the smaller k)."""
        return self._best(self.rates(acceptance))

    def _best(self, rates: dict[int, float]) -> int:
        return max(self.sizes, key=lambda k: (rates[k], -k))

    def choose(self) -> int:
        self._next = self._choose()
        return self._next

    def _choose(self) -> int:
        if self._plan:
            return self._plan.pop(0)
        if not self._useful:
            return 0
        if self._timing:
            self._timing -= 1
            return 0
        if self.drafting is False and self._until_explore > 1:
            # Off until the next re-check: without drafts acceptance stays as it was.
            self._until_explore -= 1
            return 0
        best = self._hold(self.rates())
        if best != self._held:  # a move
            self._look_around()
        self._held = best
        checked, self._checking = self._checking, False
        if checked and best == 0:  # the re-check did not pay: off until the next one
            self._until_explore = self._gap
            return 0
        if self.drafting is not False and best == 0:
            if self.drafting:
                log.info(
                    "drafting off: acceptance %.0f%% does not pay for the draft here",
                    100 * self.acceptance,
                )
            self._gap = self._probe_gap()
            # Never drafted yet: check the prior against real steps at once, unless the
            # check costs a catch-up of more than a step (a draft model would first prefill
            # the whole prompt).
            first = self.drafting is None and self.prices.catch_up <= self._step[0]
            self._until_explore = 1 if first else self._gap
        elif self.drafting is False and best > 0:
            log.info("drafting on: acceptance %.0f%%", 100 * self.acceptance)
            self._until_explore = self.explore_every
        self.drafting = best > 0
        self._until_explore -= 1
        if self._until_explore > 0:
            return best
        if best == 0:  # re-check: three steps, the first may pay a catch-up, the second priced
            self._gap = min(2 * self._gap, 8 * self._probe_gap())
            self._until_explore, self._checking = 1, True  # judged right after
            self._plan = [self._useful[0]] * 2
            return self._useful[0]
        self._until_explore = self.explore_every
        i = self.sizes.index(best)
        self._up = up = not self._up  # one neighbour a time, above and below in turn
        above, below = list(self.sizes[i + 1 : i + 2]), [k for k in self.sizes[i - 1 : i] if k]
        if not (above if up else below):
            up = not up
        if self._skips[up]:
            self._skips[up] -= 1
            return best
        self._plan = (above if up else below) * 3  # its middle step is priced
        if self._plan and self.prices.trusted(self._plan[0]):
            # A neighbour with its own price that keeps losing (a tree beside a chain, four
            # plain steps a step) is tried at doubling gaps; a move resets them.
            self._backoff[up] = min(2 * self._backoff[up], 8)
            self._skips[up] = self._backoff[up] - 1
        return self._plan.pop(0) if self._plan else best

    def _look_around(self) -> None:
        """Every exploration turn taken again on both sides (above: True): per side, the turns
        it skips after a neighbour with its own price there moved nothing, doubling up to 8,
        and the turns left to skip."""
        self._backoff, self._skips = {True: 1, False: 1}, {True: 0, False: 0}

    def _hold(self, rates: dict[int, float]) -> int:
        """The best k, unless a drafting size is held and the best is not `SWITCH_GAIN`
        faster: estimates of nearby sizes are close and noisy, and the first step at another
        size pays for its own draft (`Prices`), or a catch-up when drafting resumes."""
        best, held = self._best(rates), self._held
        if not held or rates[best] > (1 + SWITCH_GAIN) * rates[held]:
            return best
        return held

    def _probe_gap(self) -> int:
        """Plain steps between re-checks, so that they cost at most PROBE_BUDGET."""
        plain = self._step[0]
        extra = 3 * max(0.0, self._step[self._useful[0]] - plain) + self.prices.catch_up
        return max(self.explore_every, round(extra / (PROBE_BUDGET * plain)))

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        # The loop chooses the next step before it reads this one (decode.Decoder.steps).
        switched = not drafted == self._last == self._next
        self.prices.observe(drafted, seconds, self._last == 0, switched)
        self._last = drafted
        if drafted == 0:
            return
        tokens, steps = self._yield.get(drafted, (0.0, 0.0))
        slow = self.decay**0.4  # a mean of noisy yields needs a longer memory
        self._yield[drafted] = [slow * tokens + accepted + 1, slow * steps + 1]
        decay = self.decay
        for d in range(self.max_k):
            self._passed[d] *= decay
            self._tried[d] *= decay
        for d in range(min(accepted + 1, drafted, self.max_k)):
            self._tried[d] += 1
            self._passed[d] += d < accepted
