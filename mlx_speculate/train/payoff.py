"""Whether a trained drafter will pay: the tokens a step its held-out accuracy promises.

Training measures the first draft token's held-out top-1 accuracy a (the share of positions
where the drafter's first guess is the target's own next token). If every draft of a chain of
k were accepted with that probability, given the ones before, a step would yield
1 + a + a^2 + ... + a^k tokens. Later drafts guess further ahead and are rarely better than
the first, so this is an estimate from above: a drafter that falls short of the break-even
even so will not pay.

The break-even is 2 tokens a step (BREAK_EVEN): a drafted step runs the drafter and a target
forward over the whole chain, which costs more than a plain step, about two to three of them
on the small targets of docs/results.md (tau over speedup there). Fewer than 2 tokens a step
cannot make up for that; more may, and only a benchmark says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BREAK_EVEN = 2.0  # tokens a step below which a drafter is slower than none (see above)


@dataclass(frozen=True)
class Payoff:
    top1: float  # the best held-out first-draft top-1 accuracy (nan or < 0: none measured)
    drafts: int  # the chain the estimate is for
    tokens_per_step: float  # at most, from `top1` (nan: unknown)

    @property
    def pays(self) -> bool | None:
        """False when even the estimate from above is below BREAK_EVEN (None: unknown)."""
        if math.isnan(self.tokens_per_step):
            return None
        return self.tokens_per_step >= BREAK_EVEN

    def describe(self) -> str:
        """One line: the estimate, and a warning when the drafter will likely not pay."""
        if self.pays is None:
            return "no held-out accuracy (no epoch ended, or none held out): no estimate"
        estimate = (
            f"held-out first-draft top-1 {self.top1:.1%}: chains of {self.drafts} yield at most "
            f"about {self.tokens_per_step:.2f} tokens a step"
        )
        if self.pays:
            return f"{estimate} (measure it: a drafted step costs more than a plain one)"
        return (
            f"warning: {estimate}, below the break-even of {BREAK_EVEN:g}: this drafter will "
            "likely be slower than plain decoding (train on more data or for longer; see "
            "docs/training.md)"
        )


def tokens_per_step(top1: float, drafts: int) -> float:
    """1 + a + ... + a^k for a chain of k = `drafts` accepted at `top1` = a each."""
    return sum(top1**i for i in range(drafts + 1))


def payoff(top1: float, drafts: int) -> Payoff:
    """The estimate for a best held-out accuracy `top1` (nan, or below 0 when no epoch ended:
    unknown)."""
    known = not math.isnan(top1) and top1 >= 0
    return Payoff(top1, drafts, tokens_per_step(top1, drafts) if known else math.nan)
