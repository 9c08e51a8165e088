"""Prompt lookup: proposals on crafted contexts, and lossless greedy decoding with it."""

import functools

import numpy as np
import pytest

from mlx_speculate.decode import Decoder
from mlx_speculate.drafters.lookup import KEEP, MAX_MATCH, LookupDrafter
from mlx_speculate.loading import load
from mlx_speculate.policy.adaptive import FixedPolicy
from mlx_speculate.sampling import SamplingParams
from mlx_speculate.sequence import Sequence
from mlx_speculate.tree import Tree

from .helpers import MODELS, greedy_reference, tiny_model
from .test_speculative import PROMPT, TARGET_SEED, TINY_FAMILIES, assert_clear_argmax

load_cached = functools.lru_cache(load)
GREEDY = SamplingParams()


def proposal(context, k=3, max_ngram=3):
    draft = LookupDrafter(max_ngram=max_ngram, branches=1).propose(context, k, GREEDY)
    return None if draft is None else draft.tokens.tolist()


def brute_force(context, k, max_ngram):
    """The specification, scanned from scratch: among the latest KEEP occurrences of each
    suffix n-gram, the longest match measured back (then the latest) is copied."""
    length, found = len(context), {}
    for n in range(min(max_ngram, length), 0, -1):
        suffix = context[length - n :]
        ends = [e for e in range(length - 1, n - 1, -1) if context[e - n : e] == suffix]
        for end in ends[:KEEP]:
            m = n
            while m < MAX_MATCH and m < end and context[end - 1 - m] == context[length - 1 - m]:
                m += 1
            found.setdefault(end, m)
    if not found:
        return None
    end = max(found, key=lambda e: (found[e], e))
    out = []
    for i in range(end, end + k):
        out.append(context[i] if i < length else out[i - length])
    return out


@pytest.mark.parametrize(
    ("context", "max_ngram", "want"),
    [
        # [1, 2, 3] occurs twice before the end: the most recent one wins.
        ([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3, [7, 5, 1]),
        # No earlier [8, 2, 7]; [2, 7] matches; [7] alone would have matched later, at [1, 8, 2].
        ([4, 2, 7, 9, 7, 1, 8, 2, 7], 3, [9, 7, 1]),
        # Only single tokens indexed, but each match is measured back: [2, 7] is still longest.
        ([4, 2, 7, 9, 7, 1, 8, 2, 7], 1, [9, 7, 1]),
        # The older match runs 4 tokens back, the latest only 2: the longer one is copied.
        ([5, 1, 2, 3, 8, 4, 2, 3, 6, 5, 1, 2, 3], 2, [8, 4, 2]),
        # A match running into the end continues with its own proposal: periodic text.
        ([5, 6, 5, 6, 5], 3, [6, 5, 6]),
        ([3, 3], 3, [3, 3, 3]),
        ([1, 2, 3, 4], 3, None),
        ([1], 3, None),
    ],
)
def test_proposals(context, max_ngram, want):
    assert proposal(context, max_ngram=max_ngram) == want


def test_drafts_are_deterministic_chains_and_k_is_capped():
    drafter = LookupDrafter(max_ngram=2, max_draft=2)
    draft = drafter.propose([1, 2, 3, 1, 2], 5, SamplingParams(temperature=1.0))
    assert draft.tokens.tolist() == [3, 1]
    assert draft.tree == Tree.chain(2)
    assert draft.logprobs is None  # deterministic picks: the rule accepts x with p(x)
    assert drafter.propose([1, 2, 3, 1, 2], 0, GREEDY) is None


def test_incremental_index_matches_brute_force():
    # Grow random low-entropy contexts the way the loop does, with rewinds and a fresh context.
    rng = np.random.default_rng(0)
    drafter = LookupDrafter(max_ngram=3, branches=1)  # a chain: the longest match
    for _ in range(3):
        context = rng.integers(0, 4, size=3).tolist()
        for _ in range(150):
            k = int(rng.integers(1, 6))
            draft = drafter.propose(context, k, GREEDY)
            assert (None if draft is None else draft.tokens.tolist()) == brute_force(context, k, 3)
            context = context + rng.integers(0, 4, size=int(rng.integers(1, 4))).tolist()
            drafter.rewind(len(context) - 1)
        drafter.rewind(0)


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("k", [1, 4, 7])
@pytest.mark.parametrize("branches", [1, 3])
def test_greedy_equals_plain(family, k, branches):
    model = tiny_model(family, seed=TARGET_SEED[family])
    prompt = PROMPT
    reference = greedy_reference(model, prompt, 48)
    assert_clear_argmax(model, prompt, reference)
    decoder = Decoder(Sequence(model, LookupDrafter(branches=branches)))
    decoder.sequence.prefill(prompt)
    tokens, accepted = [], 0
    for step in decoder.steps(GREEDY, FixedPolicy(k)):
        tokens.extend(step.tokens)
        accepted += step.accepted
        if len(tokens) >= 48:
            break
    assert tokens[:48] == reference
    assert accepted > 0  # random models fall into loops, which lookup finds


def test_repetitive_prompt_speeds_up_real_model():
    model, tokenizer = load_cached(MODELS / "stories260K-llama")
    text = "Tom had a red ball. Tom had a red ball. Tom had a red ball. Tom had a"
    prompt = tokenizer.encode(text)
    reference = greedy_reference(model, prompt, 64)
    assert_clear_argmax(model, prompt, reference)
    decoder = Decoder(Sequence(model, LookupDrafter()))
    decoder.sequence.prefill(prompt)
    tokens, forwards, accepted, drafted = [], 0, 0, 0
    for step in decoder.steps(GREEDY, FixedPolicy(4)):
        tokens.extend(step.tokens)
        forwards += 1
        accepted += step.accepted
        drafted += step.drafted
        if len(tokens) >= 64:
            break
    assert tokens[:64] == reference
    assert len(tokens) / forwards > 1.5
    assert accepted > 0.3 * drafted


def test_several_matches_make_one_tree():
    # [1, 2, 3] occurred three times, each match 3 tokens long; their continuations are merged
    # where they agree ("4" twice, so it scores highest) and the 12 best nodes kept: nodes
    # score by depth, ties in node order.
    context = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3, 4, 6, 1, 2, 3]
    drafter = LookupDrafter(max_ngram=3, max_draft=16, branches=3)
    draft = drafter.propose(context, 12, GREEDY)
    assert draft.tokens.tolist() == [4, 6, 1, 2, 3, 7, 8, 1, 2, 5, 9, 1]
    assert draft.tree == Tree((-1, 0, 1, 2, 3, 4, 0, 6, 7, 8, 1, 10, 11))
    assert draft.logprobs is None
    # Fewer nodes: the best prefix of the same tree (the shared "4", then each branch's next).
    small = drafter.propose(context, 4, GREEDY)
    assert small.tokens.tolist() == [4, 6, 7, 8] and small.tree == Tree((-1, 0, 1, 0, 3))
    # One match: the same chain as without branches.
    single = LookupDrafter(max_ngram=3, branches=3).propose([5, 1, 2, 7, 1, 2], 3, GREEDY)
    assert single.tokens.tolist() == [7, 1, 2] and single.tree == Tree.chain(3)


def test_match_length_sets_the_draft_length():
    """A 3-token match outweighs a 2-token one: small trees follow it alone, and the shorter
    match's continuation only comes in deep into the longer one's."""
    context = [10, 11, 12, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    context += [9, 11, 12, 40, 41, 42, 43, 5, 10, 11, 12]
    drafter = LookupDrafter(max_ngram=3, max_draft=16, branches=2)
    assert drafter.matches(context) == [(3, 3), (2, 16)]
    small = drafter.propose(context, 4, GREEDY)
    assert small.tokens.tolist() == [20, 21, 22, 23] and small.tree == Tree.chain(4)
    large = drafter.propose(context, 12, GREEDY)
    assert large.tokens.tolist() == [*range(20, 30), 40, 41]
    assert large.tree == Tree((-1, *range(10), 0, 11))


def test_tree_index_stays_fast_on_long_contexts():
    # Each step indexes only new tokens: 20,000 tokens proposed on in 2,000 steps of 10.
    rng = np.random.default_rng(0)
    drafter = LookupDrafter(max_ngram=3, branches=4)
    context = rng.integers(0, 50, size=10).tolist()
    for _ in range(2000):
        drafter.propose(context, 8, GREEDY)
        context += rng.integers(0, 50, size=10).tolist()
    assert drafter._indexed == len(context) - 11
    assert all(len(ends) <= KEEP for table in drafter._ends for ends in table.values())
