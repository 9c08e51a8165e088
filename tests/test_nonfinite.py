"""NaN weights fail the generation in one line instead of emitting token 0 over and over: the
step's logits are checked on the device with its acceptance (no sync of their own), by the
single-stream loop (plain, pipelined and fused steps alike) and by the batch engine."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_speculate.batch import batch_generate
from mlx_speculate.generation import generate

from .helpers import tiny_model
from .markov import StubTokenizer
from .test_hybrid import tiny_hybrid

PROMPT = [1, 5, 9, 33, 7, 2, 60, 11, 5, 9]


def poisoned(model, name: str):
    """`model` with one NaN in its parameter `name`: in its second row (token 1's, for an
    embedding: every prompt here starts with it)."""
    value = dict(tree_flatten(model.parameters()))[name]
    flat, at = value.reshape(-1), value.shape[-1] if value.ndim > 1 else 0
    nan = mx.array([float("nan")], value.dtype)
    broken = mx.concatenate([flat[:at], nan, flat[at + 1 :]]).reshape(value.shape)
    model.load_weights([(name, broken)], strict=False)
    return model


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.q_proj.weight",
        "model.embed_tokens.weight",
        "model.layers.1.mlp.down_proj.weight",
    ],
)
@pytest.mark.parametrize("method", [{}, {"prompt_lookup": True}, {"draft_model": "self"}])
def test_nan_weights_fail_in_one_line(name, method):
    model = poisoned(tiny_model("llama", 0), name)
    options = {"draft_model": tiny_model("llama", 3)} if "draft_model" in method else method
    with pytest.raises(ValueError, match="not finite") as error:
        generate(model, StubTokenizer(), PROMPT, max_tokens=8, **options)
    assert "\n" not in str(error.value)


def test_a_hybrids_nan_decay_fails_in_one_line():
    model = poisoned(tiny_hybrid("qwen3_5_text"), "model.layers.0.linear_attn.A_log")
    with pytest.raises(ValueError, match="not finite"):
        generate(model, StubTokenizer(), PROMPT, max_tokens=8)


def test_the_batch_fails_the_requests_in_one_line():
    model = poisoned(tiny_model("llama", 0), "model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(ValueError, match="not finite"):
        batch_generate(model, StubTokenizer(), [PROMPT, PROMPT[:4]], max_tokens=8)


def test_healthy_weights_with_masked_tokens_pass():
    """-inf logits (a grammar's masked tokens) are a distribution: only NaN and +inf fail."""
    from mlx_speculate.sequence import finite

    rows = mx.array([[0.0, -mx.inf, 1.0], [2.0, 3.0, -mx.inf]])
    assert finite(rows).item()
    assert not finite(mx.array([[0.0, mx.nan, 1.0]])).item()
    assert not finite(mx.array([[0.0, mx.inf, 1.0]])).item()
