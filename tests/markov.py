"""Sampling checks: a Markov-chain stand-in target, whose emitted sequences must follow its
transition table, the chi-square test that checks they do, and a token-id tokenizer."""

from __future__ import annotations

import math
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_speculate.cache import KVCache
from mlx_speculate.models.base import ModelOutput, Origin
from mlx_speculate.sampling import SamplingParams, log_probs


class MarkovLM(nn.Module):
    """logits = table[previous token]; its hidden state (and every tap) is the token's one-hot,
    and its embedding too, so that heads read real features. It keeps no keys, and runs the
    loop's steps uncompiled: a tiny table, where tracing each shape would cost more than the
    thousands of short sampled generations the distribution tests run save."""

    traceable = False
    recurrent = False

    def __init__(self, table):
        super().__init__()
        self.table = mx.array(table, dtype=mx.float32)  # (V, V)
        vocab = self.table.shape[0]
        self.args = SimpleNamespace(
            vocab_size=vocab,
            hidden_size=vocab,
            num_hidden_layers=6,
            max_position_embeddings=1 << 20,
        )
        self.model = SimpleNamespace(embed_tokens=lambda tokens: mx.eye(vocab)[tokens])
        self.origin = Origin()

    def make_cache(self):
        return KVCache(1)

    def __call__(self, tokens, cache=None, *, positions=None, mask=None, taps=()):
        if cache is not None:
            cache.advance(tokens.shape[1])
        hidden = self.model.embed_tokens(tokens)  # (B, L, V)
        return ModelOutput(self.project(hidden), hidden, tuple(hidden for _ in taps))

    def project(self, hidden):
        return hidden @ self.table


def chi_square_limit(df: int, z: float = 4.75) -> float:
    """Upper chi-square quantile (Wilson-Hilferty); z = 4.75 leaves about 1e-6 in the tail."""
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def markov_statistic(tokens: list[int], table, sampling: SamplingParams) -> tuple[float, float]:
    """Pearson's statistic of the transition counts against `table`'s processed rows (visited
    rows pooled), and its 1e-6 upper quantile. A token the filters remove counts as infinite."""
    probs = np.exp(np.asarray(log_probs(mx.array(table, mx.float32), sampling), np.float64))
    vocab = probs.shape[0]
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (tokens[:-1], tokens[1:]), 1)
    if counts[probs == 0].sum() > 0:
        return math.inf, 0.0
    seen = counts.sum(axis=1) > 0  # (V,) rows that were visited
    live = (probs > 0) & seen[:, None]
    expected = counts.sum(axis=1, keepdims=True) * probs
    statistic = (((counts - expected)[live]) ** 2 / expected[live]).sum()
    return statistic, chi_square_limit(int(live.sum()) - int(seen.sum()))


def assert_markov(tokens: list[int], table, sampling: SamplingParams) -> None:
    statistic, limit = markov_statistic(tokens, table, sampling)
    assert statistic < limit, (statistic, limit)


class StubDetokenizer:
    """Token ids as text, each followed by a space."""

    def __init__(self):
        self.text = ""

    def reset(self) -> None:
        self.text = ""

    def add_token(self, token: int) -> None:
        self.text += f"{token} "

    def finalize(self) -> None:
        pass


class StubTokenizer:
    """Token ids as text: enough for stream_generate. A detokenizer per caller, as mlx-lm's
    tokenizer gives (streams are detokenized concurrently in a batch)."""

    eos_token_ids = ()

    @property
    def detokenizer(self) -> StubDetokenizer:
        return StubDetokenizer()

    def encode(self, text):
        return [int(t) for t in text.split()]


def assert_follows_marginal(target, prompt: list[int], temperature: float, position: int, tokens):
    """`tokens` (the one at `position`, 0 the first, of many generations after `prompt`) pass
    Pearson's test against that token's exact marginal under `target` at `temperature`:
    summed over every continuation before it (vocabulary ** position contexts)."""
    vocab = target.args.vocab_size
    contexts, joint = [[]], mx.ones((1,))  # every continuation so far and its probability
    for _ in range(position + 1):
        logits = target(mx.array([prompt + c for c in contexts])).logits[:, -1]
        rows = mx.softmax(logits / temperature, axis=-1)  # (contexts, V) next-token rows
        marginal = (joint[:, None] * rows).sum(axis=0)  # of the token after them
        joint = (joint[:, None] * rows).reshape(-1)
        contexts = [c + [t] for c in contexts for t in range(vocab)]
    observed = np.bincount(tokens, minlength=vocab)
    expected = len(tokens) * np.array(marginal, dtype=np.float64)
    statistic = float(((observed - expected) ** 2 / expected).sum())
    assert statistic < chi_square_limit(vocab - 1)
