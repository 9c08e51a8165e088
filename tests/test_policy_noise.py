"""The adaptive policy on a loaded machine: simulated steps cost what a synthetic curve says,
times multiplicative noise and load phases (other processes slowing every size alike, x1 to x4
for tens of steps), with fixed seeds. Decisions must hold: near the best fixed size where
drafting pays, plain decoding where it cannot."""

import numpy as np
import pytest

from mlx_speculate.policy.adaptive import AdaptivePolicy, candidate_lengths

from .test_policy import CPU, METAL, curve

SEEDS = range(6)
STEPS = 1500


def load(steps: int, seed: int, noise: float = 0.15) -> np.ndarray:
    """Per-step slowdown: phases of 10 to 60 steps at x1 to x4, times lognormal noise."""
    rng = np.random.default_rng(seed)
    levels: list[float] = []
    while len(levels) < steps:
        levels += [rng.uniform(1, 4)] * int(rng.integers(10, 60))
    return np.array(levels[:steps]) * np.exp(noise * rng.standard_normal(steps))


def accepted_counts(alpha, seed: int):
    """Accepted drafts of a step drafting k at step i (a chain at per-token acceptance)."""
    rng = np.random.default_rng(seed + 1000)

    def accepted(i: int, k: int) -> int:
        a = alpha(i) if callable(alpha) else alpha
        n = 0
        while n < k and rng.random() < a:
            n += 1
        return n

    return accepted


def simulate(policy, costs, alpha, slowdown, seed):
    """(choices, tokens per second) of `policy` on steps slowed by `slowdown`; a drafting step
    after plain ones also pays the catch-up."""
    accepted = accepted_counts(alpha, seed)
    choices, tokens, seconds, skipped = [], 0, 0.0, 0
    for i, factor in enumerate(slowdown):
        k = policy.choose()
        n = accepted(i, k)
        step = costs.step(k) + (costs.catch_up if k and skipped else 0.0)
        skipped = 0 if k else skipped + 1
        policy.observe(k, n, step * factor)
        choices.append(k)
        tokens, seconds = tokens + n + 1, seconds + step * factor
    return choices, tokens / seconds


def fixed_rate(costs, alpha, k, slowdown, seed) -> float:
    """Tokens per second of always drafting k, on the same slowdowns and draws."""
    accepted = accepted_counts(alpha, seed)
    tokens = sum(accepted(i, k) + 1 for i in range(len(slowdown)))
    return tokens / (costs.step(k) * float(np.sum(slowdown)))


PAYS = {  # (costs, acceptance, max_k)
    "flat rows (Metal), 80%": (METAL, 0.8, 32),
    "float32 with BLAS, 60%": (curve(lambda r: 0.01 * (1 + 0.1 * r)), 0.6, 24),
    "float32 with BLAS, copying 90%": (curve(lambda r: 0.01 * (1 + 0.1 * r)), 0.9, 24),
    "some batching gain, 90%": (curve(lambda r: 0.01 * (0.5 + 0.5 * r)), 0.9, 8),
    "a draft model, 70%": (
        curve(lambda r: 0.007 + 0.00002 * r, lambda k: 0.0015 * k, catch_up=0.01),
        0.7,
        8,
    ),
}


@pytest.mark.parametrize("case", list(PAYS))
def test_near_the_best_fixed_size_under_load(case):
    # Priced by absolute step times, 0.70-0.93 of the best fixed size (worst seed): plain
    # steps timed in a busy phase and drafting ones in a calm one, or the reverse.
    costs, alpha, max_k = PAYS[case]
    ratios = []
    for seed in SEEDS:
        slowdown = load(STEPS, seed)
        _, rate = simulate(AdaptivePolicy(costs, max_k), costs, alpha, slowdown, seed)
        best = max(fixed_rate(costs, alpha, k, slowdown, seed) for k in candidate_lengths(max_k))
        ratios.append(rate / best)
    assert min(ratios) >= 0.88 and np.mean(ratios) >= 0.93, np.round(ratios, 2)


CANNOT_PAY = {  # (costs, acceptance, max_k): drafting is slower than plain decoding
    "every row a forward, 90%": (CPU, 0.9, 24),
    "nearly linear rows, 50% with lucky runs": (
        curve(lambda r: 0.01 * (0.2 + 0.8 * r)),
        lambda i: 1.0 if i % 300 < 8 else 0.5,
        8,
    ),
    "a useless draft model": (
        curve(lambda r: 0.01 * r, lambda k: 0.002 * k, catch_up=0.05),
        0.05,
        8,
    ),
}


@pytest.mark.parametrize("case", list(CANNOT_PAY))
def test_never_settles_on_drafting_that_cannot_pay_under_load(case):
    costs, alpha, max_k = CANNOT_PAY[case]
    for seed in SEEDS:
        slowdown = load(STEPS, seed)
        choices, rate = simulate(AdaptivePolicy(costs, max_k), costs, alpha, slowdown, seed)
        plain = fixed_rate(costs, alpha, 0, slowdown, seed)
        assert np.mean(np.array(choices[STEPS // 5 :]) > 0) < 0.1, seed
        assert rate >= 0.95 * plain, seed


def test_a_slow_window_does_not_switch_off_drafting_that_pays():
    # Drafting at tau ~5 for hundreds of steps, then every step four times slower for 60
    # steps: the window slows drafting and plain steps alike, so drafting goes on.
    costs = curve(lambda r: 0.01 * (1 + 0.1 * r))
    slowdown = np.ones(700)
    slowdown[400:460] = 4.0
    choices, _ = simulate(AdaptivePolicy(costs, 24), costs, 0.9, slowdown, 0)
    assert all(k > 0 for k in choices[300:700])


# Calibrated at one load, decoding at another: the machine's rows cost otherwise than the
# curve says (a busy machine's multi-row forwards slow more than its one-row ones, or less).
DRIFTED = {  # (calibrated, paid, acceptance, max_k)
    "rows dearer than calibrated, 90%": (
        curve(lambda r: 0.01 * (1 + 0.1 * r)),
        curve(lambda r: 0.01 * (1 + 0.3 * r)),
        0.9,
        24,
    ),
}


@pytest.mark.parametrize("case", list(DRIFTED))
def test_near_the_best_fixed_size_when_rows_cost_otherwise_than_calibrated(case):
    # Sizes without a price of their own were the calibrated one plus the median excess of
    # the sizes tried: 0.59-0.95 of the best fixed size (mean 0.89), climbing a size at a time.
    calibrated, paid, alpha, max_k = DRIFTED[case]
    ratios = []
    for seed in SEEDS:
        slowdown = load(STEPS, seed)
        _, rate = simulate(AdaptivePolicy(calibrated, max_k), paid, alpha, slowdown, seed)
        best = max(fixed_rate(paid, alpha, k, slowdown, seed) for k in candidate_lengths(max_k))
        ratios.append(rate / best)
    assert min(ratios) >= 0.88 and np.mean(ratios) >= 0.95, np.round(ratios, 2)
