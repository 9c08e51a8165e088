"""A prompt that repeats the last one (a regenerated answer, the server's prefix cache) reuses
its prefill where the cache itself could no longer return there: sliding-window rings and a
hybrid's recurrent state move on as a generation goes, and the checkpoint taken at the end of
the prompt (`KVCache.checkpoint`) takes them back, with the same output as a fresh prefill."""

from __future__ import annotations

import pytest

from mlx_speculate.decode import Decoder
from mlx_speculate.drafters.draft_model import DraftModelDrafter
from mlx_speculate.models.quantized_kv import KVQuantization
from mlx_speculate.policy.adaptive import FixedPolicy
from mlx_speculate.sampling import SamplingParams
from mlx_speculate.sequence import Sequence

from .helpers import greedy_reference
from .test_hybrid import tiny_hybrid
from .test_hybrid_methods import llama_draft
from .test_rings import PROMPT, ring_model

# Longer than the recurrent layers' per-row window of 64 rows: the prefill's last forward is cut
# to keep its rows' states.
LONG = (PROMPT * 8)[:90]
MODELS = {  # (target, draft): past the rings' 134 slots; a hybrid with a llama draft
    "rings": (lambda: (m := ring_model("gemma3_text", 13), m), 220),
    "hybrid": (lambda: (tiny_hybrid("qwen3_5_text", 0), llama_draft()), 100),
}


def generate(decoder: Decoder, prompt: list[int], n: int) -> list[int]:
    decoder.sequence.prefill(prompt)
    tokens = []
    for step in decoder.steps(SamplingParams(), FixedPolicy(3)):
        tokens.extend(step.tokens)
        if len(tokens) >= n:
            return tokens[:n]
    return tokens


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_repeated_prompt_reuses_its_prefill_after_a_long_generation(kind):
    make, n = MODELS[kind]
    model, draft = make()
    reference = greedy_reference(model, LONG, n)
    decoder = Decoder(Sequence(model, DraftModelDrafter(draft, model.args.vocab_size)))
    sequence = decoder.sequence
    assert generate(decoder, LONG, n) == reference
    last = len(LONG) - 1
    assert sequence.cache.offset > len(LONG) + 60
    # The cache alone can no longer go back there (the ring or the per-row states moved on)...
    assert sequence.cache.restorable(last) == 0
    # ...the checkpoint can, for the same prompt or one that differs in its last token only.
    assert sequence.reusable(LONG) == last
    assert sequence.reusable([*LONG[:-1], 5]) == last
    assert sequence.reusable([*LONG[:40], 5, 5]) == 0  # shares less: afresh
    assert generate(decoder, LONG, n) == reference  # regenerated from the checkpoint
    assert sequence.reusable(LONG) == last  # the new prefill checkpointed it again
    # A prompt sharing less starts afresh and drops the checkpoint.
    other = [*LONG[:40], 3, 3]
    assert generate(decoder, other, 20) == greedy_reference(model, other, 20)
    assert sequence.reusable(LONG) == sequence.cache.restorable(40)


def test_a_checkpoint_from_before_the_cache_was_quantized_is_not_taken():
    """The cache switched to packed keys after the prompt (quantized_kv_start past it): the
    float rings kept at the prompt's end no longer fit, so the prompt is prefilled afresh."""
    model = ring_model("gemma3_text", 13)
    kv = KVQuantization(bits=8, group_size=32, start=len(LONG) + 10)
    decoder = Decoder(Sequence(model, None, kv=kv))
    first = generate(decoder, LONG, 60)
    assert decoder.sequence.cache.codec is not None
    assert decoder.sequence.reusable(LONG) == 0
    assert generate(decoder, LONG, 60) == first
