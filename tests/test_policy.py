"""Draft-length policies on synthetic cost curves and simulated acceptance (no models, no
clocks: the simulated steps report the time their curve gives)."""

import itertools
import logging

import mlx.nn as nn
import numpy as np
import pytest

from mlx_speculate.policy.adaptive import (
    CARRIED,
    TRUSTED,
    AdaptivePolicy,
    FixedPolicy,
    Prices,
    candidate_lengths,
)
from mlx_speculate.policy.costs import StepCosts
from mlx_speculate.policy.measure import default_policy

ROWS = (1, 2, 4, 8, 16, 32, 64)


def curve(verify, draft=lambda k: 0.0, catch_up=0.0, max_k=64, trees=False) -> StepCosts:
    """StepCosts from functions of the row count and of the draft length."""
    return StepCosts(
        {r: verify(r) for r in ROWS}, {k: draft(k) for k in range(1, max_k + 1)}, catch_up, trees
    )


# Verify cost per row count as measured on three kinds of machine (the shape, not the scale).
METAL = curve(lambda r: 0.01 * max(1.0, r / 16))  # flat to 16 rows, then linear
CPU = curve(lambda r: 0.01 * r)  # every row costs a forward
CUDA = curve(lambda r: 0.007 + 0.00002 * r)  # launch overhead dominates


def chain_tokens(alpha, k):
    return sum(alpha**i for i in range(k + 1))


def run(policy, costs, alpha, steps, seed=0, tokens=None):
    """Simulates `steps` steps that cost what `costs` says (whatever the policy was calibrated
    with); returns (choices, tokens per second relative to plain). A drafting step after plain
    ones pays the catch-up. `tokens(k)` (trees) replaces the chain's per-token acceptance with
    a yield curve."""
    rng = np.random.default_rng(seed)
    choices, total, seconds, skipped = [], 0.0, 0.0, 0
    for i in range(steps):
        k = policy.choose()
        if tokens is None:
            a = alpha(i) if callable(alpha) else alpha
            accepted = 0
            while accepted < k and rng.random() < a:
                accepted += 1
        else:
            mean = tokens(k) - 1
            accepted = min(k, int(mean) + (rng.random() < mean % 1))
        step = costs.step(k)
        if k > 0:
            step += costs.catch_up * (skipped > 0)
            skipped = 0
        else:
            skipped += 1
        policy.observe(k, accepted, step)
        choices.append(k)
        total, seconds = total + accepted + 1, seconds + step
    return choices, total / seconds * costs.step(0)


def best_rate(costs, yields, sizes):
    """The best fixed setting's tokens per second relative to plain decoding."""
    return max(yields(k) / costs.step(k) for k in sizes) * costs.step(0)


def test_fixed_policy():
    policy = FixedPolicy(4)
    policy.observe(4, 0, 100.0)
    assert policy.choose() == 4
    with pytest.raises(ValueError, match="num_draft_tokens must be >= 0"):
        FixedPolicy(-1)


@pytest.mark.parametrize(
    "costs, alpha, max_k",
    [
        (METAL, 0.8, 32),  # long drafts are free up to 15
        (METAL, 0.5, 32),
        (CPU, 0.9, 8),  # nothing pays: plain decoding
        (CPU, 0.3, 8),
        (CUDA, 0.7, 16),
        (curve(lambda r: 0.007 + 0.00002 * r, lambda k: 0.0015 * k), 0.7, 8),  # a draft model
        (curve(lambda r: 0.01 * (0.5 + 0.5 * r)), 0.8, 8),  # a CPU with some batching gain
    ],
)
def test_within_five_percent_of_the_best_fixed_length(costs, alpha, max_k):
    policy = AdaptivePolicy(costs, max_k)
    _, speed = run(policy, costs, alpha, 1500)
    sizes = candidate_lengths(max_k)
    best = best_rate(costs, lambda k: chain_tokens(alpha, k), sizes)
    assert speed >= 0.95 * best
    exact = max(sizes, key=lambda k: chain_tokens(alpha, k) / costs.step(k))
    rates = policy.rates(alpha)
    assert rates[policy.best()] >= 0.97 * rates[exact]


def test_flat_curve_drafts_long_and_linear_curve_drafts_nothing():
    policy = AdaptivePolicy(METAL, 32)
    choices, _ = run(policy, METAL, 0.9, 300)
    assert np.mean(choices[100:]) > 10
    policy = AdaptivePolicy(CPU, 8)
    choices, _ = run(policy, CPU, 0.6, 300)
    assert choices[100:].count(0) >= 0.97 * 200


@pytest.mark.parametrize("steps", [100, 1000])
def test_useless_and_same_cost_drafts_cost_little(steps):
    # A random draft (5% acceptance) whose catch-up after plain steps costs 5 forwards, and a
    # draft as dear as the target (its own 4-bit copy) accepted 60% of the time.
    useless = curve(lambda r: 0.01 * r, lambda k: 0.002 * k, catch_up=0.05)
    _, speed = run(AdaptivePolicy(useless, 8), useless, 0.05, steps)
    assert speed >= 0.95
    same = curve(lambda r: 0.01 * (0.6 + 0.4 * r), lambda k: 0.01 * k, catch_up=0.1)
    _, speed = run(AdaptivePolicy(same, 8), same, 0.6, steps)
    assert speed >= 0.95


def test_switches_off_and_on_with_acceptance(caplog):
    costs = curve(lambda r: 0.01 * (1 + 0.1 * r))
    policy = AdaptivePolicy(costs, 8)
    with caplog.at_level(logging.INFO, logger="mlx_speculate.policy.adaptive"):
        choices, _ = run(policy, costs, lambda i: 0.9 if i < 200 or i >= 600 else 0.0, 1200)
    assert np.mean(choices[150:200]) > 4
    assert np.mean(np.array(choices[400:600]) == 0) > 0.9
    assert np.mean(choices[1000:]) > 4
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("drafting off: acceptance") for m in messages)
    assert any(m.startswith("drafting on") for m in messages)


def test_never_drafts_where_it_cannot_pay(caplog):
    # Every step of k drafts costs more than k + 1 plain ones: nothing to learn.
    costs = curve(lambda r: 0.01 * r, lambda k: 0.001)
    with caplog.at_level(logging.INFO, logger="mlx_speculate.policy.adaptive"):
        policy = AdaptivePolicy(costs, 8)
    assert set(run(policy, costs, 1.0, 100)[0]) == {0}
    assert "even if every draft passed" in caplog.records[0].getMessage()


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.6, 0.9])
def test_acceptance_estimate(alpha):
    policy = AdaptivePolicy(CPU, 4)
    rng = np.random.default_rng(0)
    for _ in range(300):
        accepted = 0
        while accepted < 4 and rng.random() < alpha:
            accepted += 1
        policy.observe(4, accepted, 0.0)
    assert abs(policy.acceptance - alpha) < 0.15
    assert policy.expected_tokens(4) == pytest.approx(chain_tokens(alpha, 4), rel=0.2, abs=0.1)


def test_acceptance_per_depth_predicts_longer_chains():
    # Lookup-like: the first token often misses, but a match once found runs on. Steps of 2
    # drafts predict longer ones better than one pooled rate would.
    policy = AdaptivePolicy(METAL, 8)
    rng = np.random.default_rng(0)
    for _ in range(200):
        accepted = 0 if rng.random() < 0.5 else 1 + (rng.random() < 0.95)
        policy.observe(2, accepted, 0.0)
    assert policy.expected_tokens(2) == pytest.approx(1 + 0.5 + 0.5 * 0.95, abs=0.15)
    assert policy.expected_tokens(8) > chain_tokens(policy.acceptance, 8) + 0.5


def test_tree_sizes_are_searched_on_a_grid():
    """A 59-node tree is weighed at a dozen sizes, and the search reaches the best one: trees
    yield more with size (tokens = 1 + 2.5 (1 - e^(-k/12))) while verifying costs nothing up to
    24 rows and then grows."""
    assert candidate_lengths(59) == (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 18, 27, 40, 59)
    assert candidate_lengths(5) == (0, 1, 2, 3, 4, 5)
    costs = curve(lambda r: 0.01 * (1 + 0.08 * max(0, r - 25)), trees=True)

    def tokens(k):
        return 1 + 2.5 * (1 - np.exp(-k / 12))

    policy = AdaptivePolicy(costs, 59)
    _, speed = run(policy, costs, None, 1500, tokens=tokens)
    best = max(policy.sizes, key=lambda k: tokens(k) / costs.step(k))
    assert best == 18  # 2.94 tokens for one row's cost; 27 yields 3.24 for 1.24 rows' cost
    assert policy.best() == best
    assert speed >= 0.95 * best_rate(costs, tokens, policy.sizes)


def test_zero_max_is_plain_decoding():
    policy = AdaptivePolicy(METAL, 0)
    assert set(run(policy, METAL, 0.9, 50)[0]) == {0}


def test_first_check_waits_where_it_costs_a_catch_up():
    # The prior (acceptance 1/2) says drafting does not pay on a linear-ish CPU curve: a
    # lookup-like drafter checks at once, a draft model (whose first draft prefills the prompt)
    # only after a gap.
    verify = lambda r: 0.01 * (0.2 + 0.8 * r)  # noqa: E731
    cheap, dear = curve(verify), curve(verify, lambda k: 0.002 * k, catch_up=0.05)
    assert AdaptivePolicy(cheap, 8).best() == AdaptivePolicy(dear, 8).best() == 0
    choices = run(AdaptivePolicy(cheap, 8), cheap, 0.0, TRUSTED + 4)[0]
    assert choices == [0] * (TRUSTED + 2) + [1, 1]  # after timing plain steps
    assert set(run(AdaptivePolicy(dear, 8), dear, 0.0, 30)[0]) == {0}


# Calibrated on a CPU with some batching gain, where one draft at 60% acceptance would pay a
# little; decoding pays more per drafting step (a fused EAGLE step's head and next tree).
CALIBRATED = curve(lambda r: 0.01 * (0.5 + 0.5 * r))
PAID = curve(lambda r: 0.01 * (0.5 + 0.5 * r), lambda k: 0.012)


def test_step_times_correct_a_calibration_that_underprices_drafting():
    assert AdaptivePolicy(CALIBRATED, 8).best(0.6) == 1
    policy = AdaptivePolicy(CALIBRATED, 8)
    choices, speed = run(policy, PAID, 0.6, 1000)
    assert choices[100:].count(0) >= 0.95 * 900
    assert speed >= 0.97
    assert policy.best(0.6) == 0
    # Where drafting still pays at the price paid, it goes on.
    choices, speed = run(AdaptivePolicy(CALIBRATED, 8), PAID, 0.95, 1000)
    assert np.mean(choices[100:]) > 2
    assert speed >= 0.95 * best_rate(PAID, lambda k: chain_tokens(0.95, k), candidate_lengths(8))


@pytest.mark.parametrize("calibrated, paid", [(0.5, 0.1), (0.2, 0.05)])
def test_rows_cheaper_than_calibrated_are_found(calibrated, paid):
    # Calibrated while multi-row forwards ran slower than they do now: the best size is several
    # sizes above the one the calibration points to. Priced as the calibration plus a shift,
    # the sizes above the tried ones kept the calibration's dear rows (0.93-0.94 of the best).
    calibration = curve(lambda r: 0.01 * (1 + calibrated * r))
    costs = curve(lambda r: 0.01 * (1 + paid * r))
    _, speed = run(AdaptivePolicy(calibration, 24), costs, 0.9, 1500)
    assert speed >= 0.95 * best_rate(costs, lambda k: chain_tokens(0.9, k), candidate_lengths(24))


def test_a_dear_long_draft_prices_shorter_ones_between_it_and_plain():
    # Calibrated where rows were cheap, the first draft is the longest, and it is paid at
    # rows three times dearer. The shorter sizes cost their calibrated price plus its whole
    # excess before, each above what plain decoding yields, so drafting went off for good
    # (0.47 of the best fixed size under the noise tests' load, seed 18).
    calibration = curve(lambda r: 0.01 * (1 + 0.1 * r))
    paid = curve(lambda r: 0.01 * (1 + 0.3 * r))
    sizes = candidate_lengths(24)
    prices = Prices(calibration, sizes)
    for k in [0] * 5:
        prices.observe(k, paid.step(k))
    prices.observe(24, paid.step(24), after_plain=True)  # the catch-up, priced apart
    for k in [24] * 4:
        prices.observe(k, paid.step(k))
    assert prices.trusted(0) and prices.trusted(24) and not prices.trusted(7)
    for k in sizes[1:-1]:
        assert prices.step[k] / prices.step[0] == pytest.approx(paid.step(k) / paid.step(0))
    exact = max(sizes, key=lambda k: chain_tokens(0.9, k) / paid.step(k))
    assert AdaptivePolicy(calibration, 24, prices=prices).best(0.9) == exact


def test_a_slow_step_is_one_outlier():
    # A graph traced for a new shape costs 50 steps once; the choice stays.
    policy = AdaptivePolicy(METAL, 32)
    run(policy, METAL, 0.8, 200)
    best = policy.best()
    policy.observe(best, 3, 50 * METAL.step(best))
    assert policy.best() == best


def test_catch_up_learned_from_step_times():
    # Calibrated without a catch-up (an EAGLE head's features wait lazily), a drafter whose
    # first step after plain ones costs five forwards, at 5% acceptance: re-checks are spaced
    # for what they cost.
    calibrated = curve(lambda r: 0.01 * (0.5 + 0.5 * r), lambda k: 0.001 * k)
    paid = curve(lambda r: 0.01 * (0.5 + 0.5 * r), lambda k: 0.001 * k, catch_up=0.05)
    policy = AdaptivePolicy(calibrated, 8)
    _, speed = run(policy, paid, 0.05, 2000)
    assert policy.prices.catch_up == pytest.approx(0.05)
    assert speed >= 0.97


class Drafter:
    """What `default_policy` reads of a drafter: its cap and the modules it drafts with."""

    max_draft = 8
    head: nn.Module | None = None

    def weights(self) -> tuple[nn.Module, ...]:
        return () if self.head is None else (self.head,)


@pytest.fixture
def calibrated(monkeypatch):
    """`default_policy` finds CALIBRATED as this machine's costs."""
    monkeypatch.setattr("mlx_speculate.policy.measure.load_costs", lambda *a, **k: CALIBRATED)


@pytest.mark.usefixtures("calibrated")
def test_prices_carry_over_between_generations_of_a_drafter():
    drafter = Drafter()
    first = default_policy(drafter, None)
    run(first, PAID, 0.6, 100)
    again = default_policy(drafter, None)
    assert again is not first and again.prices is first.prices
    assert again.best(0.6) == 0  # priced as paid, where the calibration alone says 1
    assert default_policy(Drafter(), None).prices is not first.prices
    # Drafters over the same weights (a heads folder loaded once) share them; others do not.
    head, other = nn.Linear(2, 2), nn.Linear(2, 2)
    shared = [Drafter(), Drafter(), Drafter()]
    for d, h in zip(shared, (head, head, other), strict=True):
        d.head = h
    assert default_policy(shared[0], None).prices is default_policy(shared[1], None).prices
    assert default_policy(shared[2], None).prices is not default_policy(shared[0], None).prices


def switching(policy, costs, alpha, steps, switch=0.012):
    """`run` for a drafter that grows its next draft inside a step (a fused EAGLE step) or
    queues it on the last step's count, timed as `Decoder.steps` times it: the next step is
    chosen before this one is read, and a step's wall time holds the building of the next.
    A step before another size builds nothing and reads almost at once (its time moves on),
    and the first drafting step at another size pays a call of its own (`switch` seconds,
    1.2 plain steps by default). Returns (choices, tokens per second relative to plain)."""
    rng = np.random.default_rng(0)
    last, k, carried, choices, tokens, seconds = None, policy.choose(), 0.0, [], 0, 0.0
    for _ in range(steps):
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        after = policy.choose()
        cost = costs.step(k) + (switch if k and k != last else 0.0)
        seen = carried + (cost if after == k else 0.1 * cost)
        carried = carried + cost - seen
        policy.observe(k, accepted, seen)
        choices.append(k)
        last, k, tokens, seconds = k, after, tokens + accepted + 1, seconds + cost
    return choices, tokens / seconds * costs.step(0)


def test_the_first_step_at_another_size_prices_nothing():
    # Priced by such steps, explored sizes looked dear and the calibrated best (4, where 8
    # pays most) stayed chosen.
    calibrated = curve(lambda r: 0.01, lambda k: 0.004 * k)
    paid = curve(lambda r: 0.01, lambda k: 0.001 * k)
    policy = AdaptivePolicy(calibrated, 8)
    assert policy.best(0.9) == 4
    _, speed = switching(policy, paid, 0.9, 1500)
    sizes = candidate_lengths(8)
    trusted = [k for k in sizes if policy.prices.trusted(k)]
    assert len(trusted) >= 5
    for k in trusted:
        assert policy.prices.step[k] == pytest.approx(paid.step(k))
    best = best_rate(paid, lambda k: chain_tokens(0.9, k), sizes)
    assert speed >= 0.85 * best  # 0.58-0.79 priced by switches


def test_nearby_sizes_do_not_trade_places_on_noise():
    # A flat curve (stories260K's EAGLE chains: each level adds about 0.45 plain steps): the
    # rates of sizes 3 to 8 are within 10 % of each other, and each move pays a switch.
    costs = curve(lambda r: 0.01, lambda k: 0.004 + 0.0045 * k)
    choices, speed = switching(AdaptivePolicy(costs, 8), costs, 0.9, 3200)
    moves = sum(a != b for a, b in itertools.pairwise(choices))
    assert moves < 400  # 906 moving to whichever looked best
    best = best_rate(costs, lambda k: chain_tokens(0.9, k), candidate_lengths(8))
    assert speed >= 0.95 * best  # 0.91


def test_a_dear_neighbour_is_explored_at_doubling_gaps():
    # EAGLE's default tree next to a one-node draft (a chain): the trees cost four plain
    # steps a step, and three-step explorations of them every 32 steps cost 18 % of the best
    # fixed size; after a neighbour that has its price loses, its side waits doubling turns.
    costs = curve(lambda r: 0.01, lambda k: 0.003 if k == 1 else 0.03 + 0.0005 * k)
    best = best_rate(costs, lambda k: chain_tokens(0.82, k), candidate_lengths(8))
    _, speed = switching(AdaptivePolicy(costs, 8), costs, 0.82, 3000)
    assert speed >= 0.9 * best
    # Generations of 100 steps over shared prices, as `default_policy` makes them: the gaps
    # go on from one to the next (0.83 of the best when each started looking around anew).
    policy, speeds = None, []
    for _ in range(30):
        prices = None if policy is None else policy.prices
        policy = AdaptivePolicy(costs, 8, prices=prices, before=policy)
        speeds.append(switching(policy, costs, 0.82, 100)[1])
    assert np.mean(speeds[10:]) >= 0.9 * best


def test_a_re_check_that_pays_resumes_drafting_at_once():
    # Switched off at acceptance 0, then a re-check whose drafts all pass: drafting resumes
    # right after its steps, not a whole gap of plain steps later.
    policy = AdaptivePolicy(CALIBRATED, 8)
    run(policy, CALIBRATED, 0.0, 10)
    k = policy.choose()
    while k == 0:
        policy.observe(0, 0, CALIBRATED.step(0))
        k = policy.choose()
    for _ in range(3):  # the check
        policy.observe(k, k, CALIBRATED.step(k))
        k = policy.choose()
    assert policy.best() > 0
    assert k > 0


@pytest.mark.usefixtures("calibrated")
def test_a_new_generation_starts_from_the_last_ones_acceptance():
    # From the prior of 1/2 every generation started unsure whether drafting pays; the last
    # generation's acceptance, worth at most CARRIED steps, lets the next draft at once.
    drafter = Drafter()
    fresh = default_policy(drafter, None)
    assert fresh.acceptance == 0.5
    run(fresh, CALIBRATED, 0.95, 300)
    again = default_policy(drafter, None)
    assert again.acceptance > 0.85
    assert again._tried[0] == pytest.approx(CARRIED)
    assert all(run(again, CALIBRATED, 0.95, 10)[0])
    assert default_policy(Drafter(), None).acceptance == 0.5  # another drafter's is its own


def test_a_switched_off_drafter_is_re_checked_across_short_generations():
    # A draft model whose catch-up costs 5 plain steps is re-checked every few hundred steps;
    # generations of 100 steps each started that count afresh and were never re-checked
    # (drafted steps per generation: all 0, against 41 in the fourth and 95 in each after).
    costs = curve(lambda r: 0.01 * (0.5 + 0.5 * r), lambda k: 0.001 * k, catch_up=0.05)
    policy, drafted = None, []
    for generation in range(10):
        policy = AdaptivePolicy(costs, 8, before=policy)
        choices, _ = run(policy, costs, 0.0 if generation == 0 else 0.95, 100, seed=generation)
        drafted.append(sum(k > 0 for k in choices))
    assert drafted[0] == 0
    assert sum(drafted[-5:]) >= 0.9 * 500


def test_only_a_step_between_steps_of_its_size_is_priced():
    # A plain step read right before a drafting one queued nothing and reads almost at once;
    # the first drafting step after plain ones prices the catch-up instead.
    prices = Prices(CALIBRATED, candidate_lengths(8))
    for _ in range(TRUSTED):
        prices.observe(0, 0.007)
    for _ in range(5):
        prices.observe(0, 0.0001, after_plain=True, switched=True)
        prices.observe(2, 0.05, after_plain=True, switched=True)
        prices.observe(2, 0.0001, switched=True)  # before another size
    assert prices.seconds(0) == pytest.approx(0.007)  # at the load of the last steps
    assert not prices.trusted(2)
    assert prices.catch_up * prices.level == pytest.approx(0.05 - prices.seconds(2))


def test_plain_steps_are_timed_before_drafting():
    # A plain step overlaps the one before and costs 0.7 of the calibrated one-row forward:
    # at 60% acceptance one draft pays against the calibration, not against plain decoding.
    paid = curve(lambda r: 0.007 if r == 1 else 0.01 * (0.5 + 0.5 * r))
    assert AdaptivePolicy(CALIBRATED, 8).best(0.6) == 1
    policy = AdaptivePolicy(CALIBRATED, 8)
    choices, speed = run(policy, paid, 0.6, 1000)
    assert choices[:TRUSTED] == [0] * TRUSTED
    assert choices[100:].count(0) >= 0.95 * 900
    assert speed >= 0.97


def test_step_time_noise_is_no_catch_up():
    # A drafter without a catch-up (prompt lookup) whose steps after plain ones vary by 10%:
    # a later generation still checks its prior at once.
    costs = curve(lambda r: 0.01 * (0.2 + 0.8 * r))
    prices = Prices(costs, candidate_lengths(8))
    rng = np.random.default_rng(0)
    for _ in range(20):
        prices.observe(0, costs.step(0) * (1 + 0.1 * rng.standard_normal()))
        prices.observe(1, costs.step(1) * (1 + 0.1 * rng.standard_normal()), after_plain=True)
    assert prices.catch_up < 0.2 * costs.step(0)
    assert run(AdaptivePolicy(costs, 8, prices=prices), costs, 0.0, 2)[0] == [1, 1]
