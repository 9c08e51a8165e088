"""Every method stays lossless under the adaptive policy: on a flat cost curve (as on Metal) the
policy keeps drafting and its exploration changes the draft length or tree size from step to
step, so each drafter is verified at many sizes in one generation, as in real use."""

import pytest

from mlx_speculate.drafters import (
    DraftModelSpec,
    EagleGrowth,
    EagleSpec,
    LookupSpec,
    MedusaSpec,
    make_drafter,
)
from mlx_speculate.policy.adaptive import AdaptivePolicy, candidate_lengths
from mlx_speculate.policy.costs import StepCosts

from .helpers import (
    assert_clear_argmax,
    decode,
    greedy_reference,
    random_eagle_head,
    tiny_config,
    tiny_model,
)
from .test_medusa import random_heads

PROMPT = [1, 5, 9, 33, 7, 2, 60]
DEEP = {"num_hidden_layers": 6}


class Untimed(AdaptivePolicy):
    """Told no step times (0: not timed), so its prices stay the calibrated ones."""

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        super().observe(drafted, accepted, 0.0)


def flat_policy(drafter, trees: bool) -> AdaptivePolicy:
    """The adaptive policy on a cost curve where rows and drafts are free (and stay so, untimed):
    it always drafts, and re-tries the neighbouring sizes every 3 steps."""
    sizes = candidate_lengths(drafter.max_draft)
    costs = StepCosts({1: 0.01, 64: 0.01}, {k: 0.0 for k in sizes if k}, trees=trees)
    return Untimed(costs, drafter.max_draft, explore_every=3)


def spec_for(method: str, target):
    if method == "draft model":
        return DraftModelSpec(model=tiny_model("llama", seed=7, num_hidden_layers=1))
    if method.startswith("lookup"):
        return LookupSpec(max_ngram=2, branches=3 if "tree" in method else 1)
    if method == "medusa":
        return MedusaSpec(heads=random_heads(64, 97, seed=3))
    head = random_eagle_head(tiny_config("llama", **DEEP), 1, 5)
    return EagleSpec(heads=head, tree=EagleGrowth(16, 4, 4))


@pytest.mark.parametrize("method", ["draft model", "lookup", "lookup tree", "medusa", "eagle"])
def test_greedy_under_the_adaptive_policy_equals_plain(method):
    target = tiny_model("llama", seed=0, **DEEP)
    reference = greedy_reference(target, PROMPT, 60)
    assert_clear_argmax(target, PROMPT, reference)
    drafter = make_drafter(spec_for(method, target), target)
    policy = flat_policy(drafter, trees=method in ("lookup tree", "medusa", "eagle"))
    tokens, steps, _ = decode(target, PROMPT, 60, drafter, policy)
    assert tokens == reference
    drafted = {s.drafted for s in steps if s.drafted}
    assert len(drafted) >= 2  # verified at several sizes, not one
