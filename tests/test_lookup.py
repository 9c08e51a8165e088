"""Prompt lookup: proposals on crafted contexts, and lossless greedy decoding with it."""

import functools

import numpy as np
import pytest

from mlx_speculate.decode import Decoder
from mlx_speculate.drafters.lookup import LookupDrafter
from mlx_speculate.loading import load
from mlx_speculate.policy import FixedPolicy
from mlx_speculate.sampling import SamplingParams
from mlx_speculate.tree import Tree

from .helpers import greedy_reference, tiny_model
from .test_speculative import PROMPT, TARGET_SEED, TINY_FAMILIES, assert_clear_argmax

load_cached = functools.lru_cache(load)
GREEDY = SamplingParams()


def proposal(context, k=3, max_ngram=3):
    draft = LookupDrafter(max_ngram=max_ngram).propose(context, k, GREEDY)
    return None if draft is None else draft.tokens.tolist()


def brute_force(context, k, max_ngram):
    """The specification, scanned from scratch."""
    length = len(context)
    for n in range(min(max_ngram, length), 0, -1):
        suffix = context[length - n :]
        for end in range(length - 1, n - 1, -1):
            if context[end - n : end] == suffix:
                out = []
                for i in range(end, end + k):
                    out.append(context[i] if i < length else out[i - length])
                return out
    return None


@pytest.mark.parametrize(
    ("context", "max_ngram", "want"),
    [
        # [1, 2, 3] occurs twice before the end: the most recent one wins.
        ([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3, [7, 5, 1]),
        # No earlier [8, 2, 7]; [2, 7] matches; [7] alone would have matched later, at [1, 8, 2].
        ([4, 2, 7, 9, 7, 1, 8, 2, 7], 3, [9, 7, 1]),
        ([4, 2, 7, 9, 7, 1, 8, 2, 7], 1, [1, 8, 2]),
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
    drafter = LookupDrafter(max_ngram=3)
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
def test_greedy_equals_plain(family, k):
    model = tiny_model(family, seed=TARGET_SEED[family])
    prompt = PROMPT
    reference = greedy_reference(model, prompt, 48)
    assert_clear_argmax(model, prompt, reference)
    decoder = Decoder(model, LookupDrafter())
    decoder.prefill(prompt)
    tokens, accepted = [], 0
    for step in decoder.steps(GREEDY, FixedPolicy(k)):
        tokens.extend(step.tokens)
        accepted += step.accepted
        if len(tokens) >= 48:
            break
    assert tokens[:48] == reference
    assert accepted > 0  # random models fall into loops, which lookup finds


def test_repetitive_prompt_speeds_up_real_model(shared_models):
    model, tokenizer = load_cached(shared_models / "stories260K-llama")
    text = "Tom had a red ball. Tom had a red ball. Tom had a red ball. Tom had a"
    prompt = tokenizer.encode(text)
    reference = greedy_reference(model, prompt, 64)
    assert_clear_argmax(model, prompt, reference)
    decoder = Decoder(model, LookupDrafter())
    decoder.prefill(prompt)
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
