"""Sliding-window layers kept as rings (cache.py): a ring holds the window plus RING_ROWS slots
whatever the context, and decoding through it (plain, speculative with chains and trees, one
sequence or a batch, rollbacks and prefix reuse) gives what a full forward over the whole
context gives."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_speculate.cache import RING_ROWS, KVCache
from mlx_speculate.drafters.draft_model import DraftModelDrafter
from mlx_speculate.drafters.lookup import LookupDrafter
from mlx_speculate.models.quantized_kv import KVQuantization
from mlx_speculate.policy.adaptive import FixedPolicy
from mlx_speculate.sequence import Sequence

from .gemma4_models import DEEP as GEMMA4_DEEP
from .gemma4_models import tiny_gemma4
from .helpers import assert_clear_argmax, decode, greedy_reference, tiny_model
from .test_batch import clear, drafters, run
from .test_quantized_kv import generated

WINDOW = 6
# Past the ring's size (WINDOW + RING_ROWS) several times over: every column is rewritten.
LENGTH = 3 * (WINDOW + RING_ROWS)
PROMPT = [1, 5, 9, 33, 7, 2, 60, 11, 4, 9, 33, 7]
# Families whose sliding layers become rings, with a seed whose long greedy continuation keeps
# a clear top-2 margin at every step (asserted): mixed sliding and global layers, every layer
# sliding (mistral), KV-sharing layers reading a ring (gemma4), attention sinks (gpt_oss).
FAMILIES = {"gemma3_text": 13, "gemma4_text": 28, "mistral": 7, "gpt_oss": 4}


def ring_model(family: str, seed: int):
    window = {"sliding_window": WINDOW, "max_position_embeddings": 2048}
    if family == "gemma4_text":  # layers reading other layers' keys, rings among them
        return tiny_gemma4(seed, **GEMMA4_DEEP, **window)
    return tiny_model(family, seed=seed, **window)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def target(request):
    family = request.param
    model = ring_model(family, FAMILIES[family])
    reference = greedy_reference(model, PROMPT, LENGTH)
    return family, model, reference


def test_plain_decoding_matches_full_forwards(target):
    family, model, reference = target
    # The full forward attends over the whole context under the window's mask: no ring.
    assert_clear_argmax(model, PROMPT, reference)
    cache = model.make_cache()
    model(mx.array([PROMPT + reference]), cache)
    sizes = [k.shape[2] for k in cache.keys if k is not None]
    rings = [r is not None for r in cache.rings]
    assert any(rings), family
    for size, ring in zip(sizes, rings, strict=True):
        if ring:
            assert size == WINDOW + RING_ROWS
        else:
            assert size >= len(PROMPT) + LENGTH


def test_ring_logits_match_a_full_cache():
    model = ring_model("gemma3_text", 13)
    tokens = mx.array([PROMPT * 30])  # 360 tokens, in chunks through each cache
    full = KVCache(len(model.kv_shapes()))  # no sliding flags: every slot kept, windows masked
    ring = model.make_cache()
    assert ring.ring_size is not None and full.ring_size is None
    for start in range(0, tokens.shape[1], 50):
        chunk = tokens[:, start : start + 50]
        a = model(chunk, full).logits
        b = model(chunk, ring).logits
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-5).item(), start


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("kind", ["self", "random"])
def test_draft_model_through_rings_equals_plain(target, kind, k):
    family, model, reference = target
    draft = model if kind == "self" else ring_model(family, 7)
    tokens, steps, decoder = decode(
        model, PROMPT, LENGTH, DraftModelDrafter(draft, model.args.vocab_size), FixedPolicy(k)
    )
    assert tokens == reference
    assert sum(s.drafted for s in steps) > 0
    if kind == "self":
        assert all(s.accepted == s.drafted for s in steps)


@pytest.mark.parametrize("tree", [False, True])
def test_lookup_trees_through_rings_equal_plain(target, tree):
    _, model, reference = target
    drafter = LookupDrafter(max_ngram=3, branches=3 if tree else 1)
    tokens, steps, _ = decode(model, PROMPT, LENGTH, drafter, FixedPolicy(6))
    assert tokens == reference
    assert sum(s.accepted for s in steps) > 0  # the drafts were used: rollbacks and compaction


def test_a_prompt_sharing_a_prefix_reuses_only_what_the_ring_holds():
    model = ring_model("gemma3_text", 13)
    sequence = Sequence(model, None)
    long = (PROMPT * 40)[:400]
    sequence.prefill(long)
    # A prompt sharing a short prefix: the rings overwrote its window, so it starts afresh.
    assert sequence.reusable(long[:20] + [3, 3]) == 0
    # One sharing all but the last tokens reuses them (the window is still in the rings).
    assert sequence.reusable(long[:-2] + [3, 3]) == 398
    with pytest.raises(ValueError, match="rings no longer hold that window"):
        sequence.cache.truncate(20)


def test_a_verify_wider_than_the_ring_allows_is_refused_in_one_line():
    cache = ring_model("gemma3_text", 13).make_cache()
    cache.check_verify(RING_ROWS // 2, is_chain=False)
    with pytest.raises(ValueError, match="wider than a sliding-window cache follows"):
        cache.check_verify(RING_ROWS // 2 + 1, is_chain=False)


@pytest.mark.parametrize("method", ["none", "draft model", "lookup tree", "eagle-1 tree"])
def test_a_batch_of_ring_sequences_equals_each_alone(method):
    """Three sequences at different offsets past the ring's size, in one batch."""
    model = ring_model("gemma3_text", 13)
    n = 160
    candidates = [PROMPT, (PROMPT * 12)[:140], PROMPT[::-1], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
    candidates += [PROMPT[3:] + [8, 8], (PROMPT * 5)[:50], [17] * 30]
    prompts = [p for p in candidates if clear(model, p, n)][:3]
    assert len(prompts) == 3
    alone = [greedy_reference(model, p, n) for p in prompts]
    make = drafters(model, ring_model("gemma3_text", 7))[method]
    tokens, handles = run(model, prompts, make, n, fixed=None if method == "none" else 4)
    assert tokens == alone
    if method != "none":
        assert sum(h.last.stats.drafted for h in handles) > 0


@pytest.mark.parametrize("drafter", ["draft model", "lookup tree"])
def test_a_quantized_ring_speculates_as_it_decodes(drafter):
    """Rings of packed keys (kv_bits): speculation gives plain decoding's tokens under the
    same quantization, past the ring's size."""
    model = ring_model("gemma3_text", 13)
    kv = KVQuantization(bits=8, group_size=32, start=0)
    make = {
        "draft model": lambda: DraftModelDrafter(model, model.args.vocab_size),
        "lookup tree": lambda: LookupDrafter(max_ngram=3, branches=3),
    }[drafter]
    plain, _ = generated(model, None, kv, PROMPT, 300)
    tokens, decoder = generated(model, make(), kv, PROMPT, 300)
    assert tokens == plain
    assert decoder.accepted > 0


@pytest.mark.parametrize(
    "method", ["medusa", "eagle-1 tree", "eagle-3 chain", "dflash tree", "lookup tree"]
)
def test_every_head_drafter_through_rings_equals_plain(method):
    """One sequence past the ring's size with each head drafter (their own caches stay full;
    the target's rings verify their chains and trees)."""
    model = ring_model("gemma3_text", 13)
    reference = greedy_reference(model, PROMPT, 250)
    make = drafters(model, ring_model("gemma3_text", 7))[method]
    tokens, steps, _ = decode(model, PROMPT, 250, make(), FixedPolicy(4))
    assert tokens == reference
    assert sum(s.drafted for s in steps) > 0
