"""Draft-length policies, driven by simulated step costs and acceptance (no models)."""

import numpy as np
import pytest

from mlx_speculate.policy import AdaptivePolicy, FixedPolicy, candidate_lengths


def simulate(policy, cost, alpha, steps, seed=0, spikes=0.0, catch_up=0.0):
    """Runs `policy` against steps that take cost(k) seconds (5% noise, and with probability
    `spikes` a 10x outlier) and accept each draft token with probability alpha(step). A drafting
    step pays `catch_up` seconds per plain step before it, up to 32 (a draft model catching up:
    DraftModelDrafter restarts on a window rather than catch up on more)."""
    rng = np.random.default_rng(seed)
    choices, skipped = [], 0
    for i in range(steps):
        k = policy.choose()
        seconds = cost(k) * (1 + 0.05 * rng.standard_normal())
        if rng.random() < spikes:
            seconds *= 10
        if k > 0:
            seconds, skipped = seconds + catch_up * min(skipped, 32), 0
        else:
            skipped += 1
        accepted = 0
        while accepted < k and rng.random() < alpha(i):
            accepted += 1
        policy.observe(k, accepted, seconds)
        choices.append(k)
    return choices


def speed(policy, cost, alpha, steps, catch_up=0.0):
    """Tokens per second over `steps` simulated steps, relative to plain decoding."""
    choices = []
    rng = np.random.default_rng(1)
    tokens = seconds = 0.0
    skipped = 0
    for _ in range(steps):
        k = policy.choose()
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        step = cost(k)
        if k > 0:
            step, skipped = step + catch_up * min(skipped, 32), 0
        else:
            skipped += 1
        policy.observe(k, accepted, step)
        choices.append(k)
        tokens, seconds = tokens + accepted + 1, seconds + step
    return tokens / seconds * cost(0)


def test_fixed_policy():
    policy = FixedPolicy(4)
    policy.observe(4, 0, 100.0)
    assert policy.choose() == 4
    with pytest.raises(ValueError, match="num_draft_tokens must be >= 0"):
        FixedPolicy(-1)


@pytest.mark.parametrize("steps", [200, 2000])
def test_useless_draft_costs_little(steps):
    # An equal-size draft accepted 5% of the time; catching up costs 0.2 plain steps per token
    # (CPU: a 33-token forward costs 6 one-token ones). Warm-up and probes at doubling gaps
    # keep the speed close to plain decoding.
    speed_ratio = speed(AdaptivePolicy(max_k=8), lambda k: 0.01 * (1 + k), 0.05, steps, 0.002)
    assert speed_ratio > (0.9 if steps == 200 else 0.97)


def test_plain_decoding_when_drafting_does_not_pay():
    # Verify cost grows with every token (4-bit matmul on a CPU) and few drafts are accepted.
    policy = AdaptivePolicy(max_k=8)
    choices = simulate(policy, lambda k: 0.01 * (k + 1), lambda i: 0.1, 400)
    assert policy.best() == 0
    # After warm-up it stays plain; exploration only ever tries one draft token.
    steady = choices[100:]
    assert steady.count(0) >= 0.9 * len(steady)
    assert max(steady) == 1


def test_long_drafts_when_verification_is_flat():
    # Metal-like: verifying more tokens costs almost nothing, and the draft is good.
    policy = AdaptivePolicy(max_k=8)
    choices = simulate(policy, lambda k: 0.01 * (1 + 0.02 * k), lambda i: 0.9, 300)
    # 6, 7 and 8 differ by less than the timing noise; all are long drafts.
    assert policy.best() >= 6
    assert np.mean(choices[100:]) > 6


def test_finds_the_knee_of_a_measured_cost_curve():
    # Flat up to 4 draft tokens, then three times dearer: the best length is 4, and the policy
    # has to measure its way there (its first guess from k <= 2 extrapolates flat).
    policy = AdaptivePolicy(max_k=8)
    simulate(policy, lambda k: 0.01 if k <= 4 else 0.03, lambda i: 0.8, 500)
    assert policy.best() == 4


def test_robust_to_outliers():
    policy = AdaptivePolicy(max_k=8)
    simulate(policy, lambda k: 0.01 * (k + 1), lambda i: 0.1, 400, spikes=0.05)
    assert policy.best() == 0
    policy = AdaptivePolicy(max_k=8)
    simulate(policy, lambda k: 0.01 * (1 + 0.02 * k), lambda i: 0.9, 300, spikes=0.05)
    assert policy.best() >= 6


def test_follows_a_drop_in_acceptance():
    # The text changes character: drafts stop matching, and the policy stops drafting.
    policy = AdaptivePolicy(max_k=8)
    choices = simulate(
        policy, lambda k: 0.01 * (1 + 0.25 * k), lambda i: 0.9 if i < 200 else 0.0, 400
    )
    assert np.mean(choices[150:200]) > 2
    assert policy.best() == 0
    assert np.mean(np.array(choices[300:]) == 0) > 0.88  # probes: 2 steps in 32


def test_returns_to_drafting_despite_catch_up_costs():
    # Drafts are useless for a while, then good again; probes away from k = 0 pay the draft
    # model's catch-up over the skipped tokens, which must not be mistaken for the cost of k.
    # Probes come at most 8 * 64 steps apart: within two such gaps the policy drafts again.
    policy = AdaptivePolicy(max_k=8)
    choices = simulate(
        policy, lambda k: 0.01 * (1 + 0.25 * k), lambda i: 0.0 if i < 200 else 0.9, 1400,
        catch_up=0.005,
    )
    assert np.mean(np.array(choices[150:200]) == 0) > 0.9
    assert np.mean(choices[1224:]) > 2


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.6, 0.9])
def test_acceptance_estimate(alpha):
    # Per-token acceptance from truncated runs: accepted tokens against rejections.
    policy = AdaptivePolicy(max_k=4)
    simulate(FixedDrafting(policy, 4), lambda k: 0.01, lambda i: alpha, 300)
    assert abs(policy.acceptance - alpha) < 0.15  # a memory of about 20 steps


class FixedDrafting:
    """Feeds `policy` the outcomes of always drafting k tokens."""

    def __init__(self, policy, k):
        self.policy, self.k = policy, k

    def choose(self):
        return self.k

    def observe(self, drafted, accepted, seconds):
        self.policy.observe(drafted, accepted, seconds)


def test_warm_up_and_catch_up_steps_are_not_timed():
    policy = AdaptivePolicy(max_k=4)
    assert policy.cost(0) is None
    policy.observe(0, 0, 1.0)  # first step at a length: allocation, first kernels
    policy.observe(0, 0, 0.01)
    policy.observe(2, 1, 5.0)  # first at 2, and the draft's catch-up after a plain step
    assert policy.cost(2) == 0.01  # extrapolated from k = 0 alone
    policy.observe(2, 1, 0.02)
    policy.observe(0, 0, 0.01)
    policy.observe(2, 1, 3.0)  # catch-up after a plain step
    assert policy.cost(2) == 0.02 and policy.cost(0) == 0.01
    assert policy.cost(1) == pytest.approx(0.015)  # interpolated
    assert policy.cost(4) == pytest.approx(0.03)  # extrapolated with the fitted slope


def test_zero_max_is_plain_decoding():
    policy = AdaptivePolicy(max_k=0)
    assert set(simulate(policy, lambda k: 0.01, lambda i: 0.9, 50)) == {0}



def test_expected_tokens_follow_measured_tree_yield():
    """Tree steps of 4 nodes over branches that accept 3 tokens yield 4, above the 3.05 a chain
    of 4 at the acceptance those steps imply (3 of 4) predicts; chain-like steps keep gain ~1."""
    policy = AdaptivePolicy(max_k=16)
    for _ in range(64):
        policy.observe(4, 3, 0.01)
    assert policy.acceptance == pytest.approx(0.75, abs=0.02)
    assert policy.expected_tokens(4, policy.acceptance) < 3.1
    assert policy.expected_tokens(4) == pytest.approx(4.0, rel=0.05)

    rng = np.random.default_rng(0)
    policy = AdaptivePolicy(max_k=16)
    for _ in range(400):
        accepted = 0
        while accepted < 4 and rng.random() < 0.7:
            accepted += 1
        policy.observe(4, accepted, 0.01)
    assert policy.expected_tokens(4) == pytest.approx(
        policy.expected_tokens(4, policy.acceptance), rel=0.1
    )


def test_tree_sizes_are_searched_on_a_grid():
    """A 59-node tree is weighed at a dozen sizes, and the search reaches the best one: here
    trees yield more with size (tokens = 1 + 2.5 (1 - e^(-k/12))) while verifying costs nothing
    up to 24 rows and then grows."""
    assert candidate_lengths(59) == (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 18, 27, 40, 59)
    assert candidate_lengths(5) == (0, 1, 2, 3, 4, 5)
    policy = AdaptivePolicy(max_k=59)
    rng = np.random.default_rng(0)

    def cost(k):
        return 0.01 * (1 + 0.08 * max(0, k - 24))

    def tokens(k):
        return 1 + 2.5 * (1 - np.exp(-k / 12))

    for _ in range(1500):
        k = policy.choose()
        accepted = min(k, int(tokens(k)) + (rng.random() < tokens(k) % 1) - 1)
        policy.observe(k, accepted, cost(k) * (1 + 0.03 * rng.standard_normal()))
    best = max(policy.sizes, key=lambda k: tokens(k) / cost(k))
    assert best == 18  # 2.94 tokens for one row's cost; 27 yields 3.24 for 1.24 rows' cost
    assert policy.best() == best
