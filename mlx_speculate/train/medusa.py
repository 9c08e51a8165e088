"""Fitting Medusa heads to a target's own continuations (self-distillation).

1. Roll the target out from the prompts (`rollout`: sampled at `temperature`, greedy at 0),
   keeping the final hidden state (lm_head's input) that chose each generated token.
2. Head k learns, by cross-entropy, the token k+2 places after each hidden state.

Heads start as Medusa does: ResBlocks at zero (the identity) and every projection a copy of the
target's lm_head, so before training each head already guesses "the next token".
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from ..heads.medusa import MedusaHeads
from ..models.base import CausalLM
from .rollout import rollout


def training_pairs(
    groups: Sequence[tuple[mx.array, mx.array]], num_heads: int
) -> tuple[mx.array, mx.array]:
    """(N, hidden) final hidden states and (N, num_heads) labels: head k's is the token k+2
    places ahead (`generated[:, i + k + 1]` after `hidden[:, i]`)."""
    features, labels = [], []
    for hidden, generated in groups:
        n = generated.shape[1] - num_heads  # positions whose labels all exist
        if n <= 0:
            continue
        features.append(hidden[:, :n].reshape(-1, hidden.shape[-1]))
        ahead = [generated[:, k + 1 : k + 1 + n] for k in range(num_heads)]  # K x (B, n)
        labels.append(mx.stack(ahead, axis=-1).reshape(-1, num_heads))
    if not features:
        raise ValueError(f"rollouts need more than {num_heads} tokens to fit {num_heads} heads")
    return mx.concatenate(features), mx.concatenate(labels)


def _output_weight(model: CausalLM) -> mx.array:
    """The (V, hidden) vocabulary projection, dequantized if need be."""
    layer = model.model.embed_tokens if model.args.tie_word_embeddings else model.lm_head
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return mx.dequantize(
            layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits
        ).astype(mx.float32)
    return layer.weight.astype(mx.float32)


def init_heads(model: CausalLM, num_heads: int, num_layers: int = 1) -> MedusaHeads:
    heads = MedusaHeads(model.args.hidden_size, model.args.vocab_size, num_heads, num_layers)
    weight = _output_weight(model)
    for head in heads.heads:
        for block in head[:-1]:
            block.linear.weight = mx.zeros_like(block.linear.weight)
            block.linear.bias = mx.zeros_like(block.linear.bias)
        head[-1].weight = mx.array(weight)
    return heads


def fit_medusa_heads(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    *,
    num_heads: int = 4,
    num_layers: int = 1,
    length: int = 64,
    temperature: float = 1.0,
    steps: int = 300,
    batch_size: int = 256,
    learning_rate: float = 3e-3,
    seed: int = 0,
) -> MedusaHeads:
    """Heads fitted to `model`'s continuations of `prompts` (each rolled out `length` tokens).

    Fit to the decoding that will use them: rollouts at temperature 1 teach the model's own
    distribution; greedy rollouts (temperature 0) from varied prompts, e.g. `sampled_prompts`,
    teach greedy decoding and make far better heads for it.
    """
    x, y = training_pairs(rollout(model, prompts, length, temperature, seed), num_heads)
    heads = init_heads(model, num_heads, num_layers)

    def loss_fn(heads: MedusaHeads, x: mx.array, y: mx.array) -> mx.array:
        logits = heads(x)  # (K, B, V)
        return nn.losses.cross_entropy(logits, y.T, reduction="mean")

    optimizer = optim.Adam(learning_rate=learning_rate)
    step_fn = nn.value_and_grad(heads, loss_fn)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        rows = mx.array(rng.integers(0, x.shape[0], size=min(batch_size, x.shape[0])))
        _, grads = step_fn(heads, x[rows], y[rows])
        optimizer.update(heads, grads)
        mx.eval(heads.parameters(), optimizer.state)
    heads.set_dtype(model.model.norm.weight.dtype)
    return heads
