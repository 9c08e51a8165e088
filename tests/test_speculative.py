"""Speculative decoding with a draft model: lossless against plain decoding, greedy and sampled."""

import functools
import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_speculate.decode import Decoder
from mlx_speculate.drafters.draft_model import DraftModelDrafter, check_vocabularies
from mlx_speculate.drafters.lookup import LookupDrafter
from mlx_speculate.loading import load
from mlx_speculate.policy.adaptive import FixedPolicy
from mlx_speculate.sampling import SamplingParams, log_probs
from mlx_speculate.sequence import Sequence

from .helpers import MODELS, assert_clear_argmax, decode, greedy_reference, tiny_model
from .markov import MarkovLM, assert_markov

GREEDY = SamplingParams()
PROMPT = [1, 5, 9, 33, 7, 2, 60]
FAMILIES = ("llama", "qwen2", "phi3")  # also as real checkpoints in tests/data
TINY_FAMILIES = (*FAMILIES, "qwen3", "gemma3_text", "mistral", "ministral3", "gemma2")
# Batched (verify) and one-token float32 forwards differ by well under 1e-5 in the logits; a
# top-2 gap of 1e-3 at every reference step means both paths must pick the same argmax, so
# equal outputs are a real comparison and not a coin flip on near-ties.
# Seeds whose greedy continuations of PROMPT keep that margin (asserted, not assumed).
TARGET_SEED = {
    "llama": 0,
    "qwen2": 1,
    "phi3": 1,
    "qwen3": 0,
    "gemma3_text": 13,
    "mistral": 4,
    "ministral3": 6,
    "gemma2": 4,
}


load_cached = functools.lru_cache(load)


def draft_for(kind, family, target):
    if kind == "self":
        return target
    if kind == "random":
        return tiny_model(family, seed=7, num_hidden_layers=1)
    return tiny_model(family, seed=8, vocab_size=128)  # padded: ids 97.. never proposed


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("kind", ["self", "random", "padded"])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_equals_plain(family, kind, k):
    target = tiny_model(family, seed=TARGET_SEED[family])
    reference = greedy_reference(target, PROMPT, 40)
    assert_clear_argmax(target, PROMPT, reference)
    drafter = DraftModelDrafter(draft_for(kind, family, target), 97)
    tokens, steps, _ = decode(target, PROMPT, 40, drafter, FixedPolicy(k))
    assert tokens == reference
    drafted = sum(s.drafted for s in steps)
    accepted = sum(s.accepted for s in steps)
    assert drafted > 0
    if kind == "self":
        assert accepted == drafted  # the target as its own draft agrees everywhere
        # The prompt's forward gives the first token; each later step emits k + 1 tokens.
        assert len(steps) == 1 + math.ceil(39 / (k + 1))
        assert not steps[0].verified and all(s.verified for s in steps[1:])


def test_draft_with_smaller_vocabulary_is_lossless():
    # Target ids beyond the draft's range are clipped on the way in, never proposed.
    target = tiny_model("llama", seed=0)
    draft = tiny_model("llama", seed=0, vocab_size=40)
    reference = greedy_reference(target, PROMPT, 40)
    assert any(t >= 40 for t in reference)
    tokens, _, _ = decode(target, PROMPT, 40, DraftModelDrafter(draft, 97), FixedPolicy(3))
    assert tokens == reference


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_real_pair_greedy_equals_plain(family, k):
    target, tokenizer = load_cached(MODELS / f"stories260K-{family}")
    draft, _ = load_cached(MODELS / "llama2xs281K-llama")
    prompt = tokenizer.encode("Lily and Tom went to the park.")
    reference = greedy_reference(target, prompt, 100)
    assert_clear_argmax(target, prompt, reference)
    drafter = DraftModelDrafter(draft, 512)
    tokens, steps, _ = decode(target, prompt, 100, drafter, FixedPolicy(k))
    assert tokens == reference
    # A real draft: most of its proposals are right, so steps emit several tokens.
    assert sum(s.accepted for s in steps) > 0.3 * sum(s.drafted for s in steps)


def test_draft_never_reruns_cached_tokens():
    target = tiny_model("llama", seed=0)
    draft = tiny_model("llama", seed=7, num_hidden_layers=1)
    fed = []

    class Counting:
        args = draft.args
        traceable = False  # counted per call, so never compiled
        recurrent = False

        def make_cache(self):
            return draft.make_cache()

        def __call__(self, tokens, cache, **kwargs):
            fed.append(tokens.shape[1])
            return draft(tokens, cache, **kwargs)

    drafter = DraftModelDrafter(Counting(), 97)
    tokens, steps, decoder = decode(target, PROMPT, 60, drafter, FixedPolicy(3))
    # Every draft input token is a context token or a proposal, each fed at most once: the
    # inputs add up to the context minus the pending token, plus the proposals still cached.
    assert sum(fed) == drafter.cache.offset + sum(
        s.drafted - min(s.accepted + 1, s.drafted) for s in steps
    )
    assert drafter.cache.offset <= len(decoder.sequence.context) - 1


class ScriptedPolicy:
    """Draft lengths from a list, cycled (a stand-in for an adaptive policy's choices)."""

    def __init__(self, ks):
        self.ks, self.i = ks, 0

    def choose(self):
        self.i += 1
        return self.ks[(self.i - 1) % len(self.ks)]

    def observe(self, drafted, accepted, seconds):
        pass


def assert_draft_cache_matches(draft, drafter, context):
    """The draft cache holds context[:SINK] + context[SINK + skipped : end], as if fed fresh."""
    offset, sink, skipped = drafter.cache.offset, drafter.SINK, drafter.skipped
    held = context[: min(offset, sink)] + context[sink + skipped : offset + skipped]
    assert len(held) == offset
    token = context[offset + skipped]  # the next token it would be fed
    step = draft(mx.array([[token]]), drafter.cache).logits[0, -1]
    fresh = draft(mx.array([held + [token]])).logits[0, -1]
    assert mx.allclose(step, fresh, atol=1e-4).item()


@pytest.mark.parametrize("draft_context", [256, 64])
def test_draft_restarts_after_plain_stretches(draft_context):
    # Long plain stretches leave the draft far behind, and a short draft context overflows:
    # the draft restarts on a window; the output stays the target's.
    target = tiny_model("llama", seed=0)
    draft = tiny_model("llama", seed=7, num_hidden_layers=1, max_position_embeddings=draft_context)
    reference = greedy_reference(target, PROMPT, 150)
    assert_clear_argmax(target, PROMPT, reference)
    drafter = DraftModelDrafter(draft, 97, max_catch_up=16)
    policy = ScriptedPolicy([2] * 10 + [0] * 40)
    windowed = 0
    decoder = Decoder(Sequence(target, drafter))
    decoder.sequence.prefill(PROMPT)
    tokens = []
    for step in decoder.steps(GREEDY, policy):
        tokens.extend(step.tokens)
        windowed += step.drafted > 0 and drafter.skipped > 0
        if drafter.cache.offset > 0:
            assert drafter.cache.offset <= draft_context
        if len(tokens) >= 150:
            break
    assert tokens[:150] == reference
    assert windowed > 0
    assert_draft_cache_matches(draft, drafter, decoder.sequence.context)


def test_cache_consistent_after_many_rejections():
    target = tiny_model("qwen2", seed=1)
    draft = tiny_model("qwen2", seed=9, num_hidden_layers=1)
    drafter = DraftModelDrafter(draft, 97)
    mx.random.seed(3)
    sampling = SamplingParams(temperature=1.0)
    _, steps, decoder = decode(target, PROMPT, 150, drafter, FixedPolicy(4), sampling)
    assert sum(s.accepted < s.drafted for s in steps) >= 20
    context = list(decoder.sequence.context)
    # Plain decoding continues from the caches left behind: same logits as a fresh forward.
    for model, cache in ((target, decoder.sequence.cache), (draft, drafter.cache)):
        sequence = list(context)
        assert cache.offset <= len(sequence) - 1
        logits = model(mx.array([sequence[cache.offset :]]), cache).logits[0, -1]
        for _ in range(5):
            fresh = model(mx.array([sequence])).logits[0, -1]
            assert mx.allclose(logits, fresh, atol=1e-4).item()
            sequence.append(int(mx.argmax(logits).item()))
            logits = model(mx.array([sequence[-1:]]), cache).logits[0, -1]


# Sampling: end to end through the loop, with stub models whose logits depend on the previous
# token only, so the emitted sequence must be a Markov chain with the target's transitions.

V = 6


TARGET_TABLE = np.random.default_rng(0).normal(scale=1.5, size=(V, V))
# A loosely related draft: its filtered rows keep tokens that the target's filters remove.
DRAFT_TABLE = 0.5 * TARGET_TABLE + np.random.default_rng(1).normal(scale=1.5, size=(V, V))
SAMPLED = 3000


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.3, top_p=0.8),
    ],
    ids=["plain", "top_k", "top_p"],
)
@pytest.mark.parametrize("drafter_kind", ["draft_model", "lookup", "lookup_tree"])
def test_sampling_follows_target(sampling, drafter_kind):
    mx.random.seed(11)
    target = MarkovLM(TARGET_TABLE)
    p = np.exp(np.asarray(log_probs(mx.array(TARGET_TABLE, mx.float32), sampling)))
    q = np.exp(np.asarray(log_probs(mx.array(DRAFT_TABLE, mx.float32), sampling)))
    if sampling.top_k or sampling.top_p < 1:
        assert ((p == 0) & (q > 0.1)).any()  # the draft proposes what the target never emits
    if drafter_kind == "draft_model":
        drafter = DraftModelDrafter(MarkovLM(DRAFT_TABLE), V)
    elif drafter_kind == "lookup":
        drafter = LookupDrafter(max_ngram=2, branches=1)
    else:  # several matches verified as one tree: the rule tries siblings in turn
        drafter = LookupDrafter(max_ngram=2, branches=3)
    tokens, steps, _ = decode(target, [0], SAMPLED, drafter, FixedPolicy(3), sampling)
    # Both branches of the rule are exercised: many acceptances and many rejections.
    assert sum(s.accepted for s in steps) > 200
    assert sum(s.accepted < s.drafted for s in steps) > 200
    assert_markov(tokens, TARGET_TABLE, sampling)


@pytest.mark.parametrize("mix", [1.0, 0.2])
def test_sampling_check_has_power(mix):
    # Tokens from the draft's rows, or from rows a fifth of the way there, fail the check.
    sampling = SamplingParams(temperature=1.0)
    mx.random.seed(0)
    target = log_probs(mx.array(TARGET_TABLE, mx.float32), sampling)
    draft = log_probs(mx.array(DRAFT_TABLE, mx.float32), sampling)
    rows = mx.log((1 - mix) * mx.exp(target) + mix * mx.exp(draft))
    draws = mx.random.categorical(rows, num_samples=SAMPLED).tolist()  # (V, SAMPLED)
    tokens = [0]
    for i in range(SAMPLED):
        tokens.append(draws[tokens[-1]][i])
    with pytest.raises(AssertionError):
        assert_markov(tokens, TARGET_TABLE, sampling)


# Vocabulary agreement.


def test_vocabularies_padded_and_mismatched():
    _, tokenizer = load(MODELS / "stories260K-llama")
    assert check_vocabularies(512, 512, tokenizer, tokenizer) == 512
    assert check_vocabularies(512, 640, tokenizer, tokenizer) == 512  # padding beyond 512 ids
    assert check_vocabularies(576, 512, tokenizer) == 512
    with pytest.raises(ValueError, match="draft vocabulary 400 does not match target 512"):
        check_vocabularies(512, 400, tokenizer)
    with pytest.raises(ValueError, match="draft vocabulary 600 does not match target 512"):
        check_vocabularies(512, 600)


class ShiftedTokenizer:
    """A tokenizer that disagrees with `base`: ids moved by `shift`, or another EOS."""

    def __init__(self, base, shift=0, eos=None):
        self.base, self.shift = base, shift
        self.bos_token_id = base.bos_token_id
        self.eos_token_id = base.eos_token_id if eos is None else eos

    def encode(self, text, add_special_tokens=True):
        return [(t + self.shift) % 512 for t in self.base.encode(text, add_special_tokens=False)]

    def get_vocab(self):
        return self.base.get_vocab()


def test_vocabularies_disagreeing_tokenizers():
    _, tokenizer = load(MODELS / "stories260K-llama")
    assert check_vocabularies(512, 512, tokenizer, ShiftedTokenizer(tokenizer)) == 512
    with pytest.raises(
        ValueError, match=r"draft tokenizer \(vocabulary 512\) does not encode 'Hello, world!'"
    ):
        check_vocabularies(512, 512, tokenizer, ShiftedTokenizer(tokenizer, shift=1))
    with pytest.raises(ValueError, match="eos_token_id 3 does not match the target's 2"):
        check_vocabularies(512, 512, tokenizer, ShiftedTokenizer(tokenizer, eos=3))
