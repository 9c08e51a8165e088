"""Checks every newer family (Qwen3-MoE, gpt-oss, Gemma 4) runs: parity with transformers on
a folder transformers saved, tree verification, lossless greedy speculation with each method,
and 4-bit conversion that mlx-lm loads. Each family's test module calls these with its own
configs, so the checks are written once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_speculate.convert import convert
from mlx_speculate.decode import Decoder
from mlx_speculate.drafters import EagleGrowth, EagleSpec, make_drafter
from mlx_speculate.drafters.draft_model import DraftModelDrafter
from mlx_speculate.drafters.lookup import LookupDrafter
from mlx_speculate.drafters.medusa import MedusaDrafter
from mlx_speculate.generation import stream_generate
from mlx_speculate.loading import build_model, load, load_model
from mlx_speculate.policy.adaptive import FixedPolicy
from mlx_speculate.sampling import SamplingParams
from mlx_speculate.sequence import Sequence
from mlx_speculate.tree import Tree

from .helpers import (
    assert_clear_argmax,
    decode,
    greedy_reference,
    leading_tokens,
    random_eagle_head,
    random_weights,
    tiny_config,
)
from .markov import StubTokenizer, assert_follows_marginal
from .test_medusa import random_heads
from .test_models import assert_close, hf_forward
from .test_tree_forward import CHOICES, check_tree_against_paths, random_tokens

PROMPT = [1, 5, 9, 33, 7, 2, 60]
# A prompt that repeats itself, so that prompt lookup finds matches to propose.
REPEATING = [1, 5, 9, 33, 7, 2, 60, 11, 5, 9, 33, 7, 2, 60, 11, 5, 9]


def randomize(model, seed: int, scales: dict[str, float] | None = None) -> None:
    """Seeded random weights for a transformers model, in place, float32-representable: norms
    near 1, q/k projections large enough that attention is far from uniform (RoPE bugs show
    in the logits), the rest small; `scales` sets the std of parameters whose name contains a
    key (first match)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    scales = scales or {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            std = next((s for key, s in scales.items() if key in name), None)
            if std is not None:
                value = std * noise
            elif "norm" in name and name.endswith("weight"):
                value = 1.0 + 0.1 * noise
            elif "q_proj" in name or "k_proj" in name:
                value = 0.3 * noise
            elif "embed" in name:
                value = 0.1 * noise
            else:
                value = 0.05 * noise
            param.copy_(value.to(param.dtype))


def save_hf(
    folder: Path, config: dict[str, Any], seed: int = 0, scales: dict[str, float] | None = None
):
    """A random transformers model for `config` saved in float32 by `save_pretrained` into
    `folder`; returns the model in float64 with eager attention, the reference."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {"pad_token_id": None, "eos_token_id": None, "bos_token_id": None, **config}
    # Eager experts: the grouped-matmul kernel takes no float64.
    hf_config = AutoConfig.for_model(
        **config, attn_implementation="eager", experts_implementation="eager"
    )
    model = AutoModelForCausalLM.from_config(hf_config).float().eval()
    randomize(model, seed, scales)
    model.save_pretrained(folder)
    return model.double()


def prompt(length: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (1, length))


def check_prompt_parity(folder: Path, ref, length: int, taps: tuple[int, ...] = (0, 1)) -> None:
    """A full-prompt forward of the folder's model gives transformers' logits, final hidden
    state and the hidden states entering the tapped layers."""
    model = load_model(folder)[0]
    tokens = prompt(length, model.args.vocab_size)
    expected = hf_forward(ref, tokens, hidden=True)
    out = model(mx.array(tokens), taps=taps)
    assert_close(out.logits, expected.logits)
    assert_close(out.hidden, expected.hidden_states[-1])
    for tap, ours in zip(taps, out.taps, strict=True):
        assert_close(ours, expected.hidden_states[tap])


def check_cached_parity(folder: Path, ref, length: int, prefill: int) -> None:
    """Prefill then one token a step gives transformers' logits (with its cache) each step."""
    from transformers import DynamicCache

    model = load_model(folder)[0]
    tokens = prompt(length, model.args.vocab_size, seed=1)
    ref_cache, cache = DynamicCache(config=ref.config), model.make_cache()
    steps = [(0, prefill)] + [(t, t + 1) for t in range(prefill, length)]
    for start, end in steps:
        expected = hf_forward(ref, tokens[:, start:end], ref_cache).logits
        assert_close(model(mx.array(tokens[:, start:end]), cache).logits, expected)


def check_tree(model, prefix: int = 9) -> None:
    """One forward over a depth-4 tree equals cached forwards along each root-to-leaf path."""
    tree = Tree.from_paths(CHOICES)
    vocab = model.args.vocab_size
    check_tree_against_paths(
        model, tree, random_tokens(prefix, vocab, 0), random_tokens(tree.num_nodes, vocab, 1)
    )


def related_draft(model_type: str, seed: int, other: int, mix: float = 0.1, **overrides):
    """A draft model that often agrees with `tiny_model(model_type, seed, **overrides)` and
    often not: its weights moved a fraction `mix` of the way to another seed's."""
    config = tiny_config(model_type, **overrides)
    near, far = random_weights(config, seed), random_weights(config, other)
    mixed = {k: v + mix * (far[k] - v) for k, v in near.items()}
    return build_model(config, mixed)


def check_greedy_methods(target, draft, n: int = 40) -> None:
    """Greedy speculation equals plain greedy decoding token for token, with a draft model
    (which must disagree somewhere, so rejections are exercised), prompt lookup (chains and
    trees), random Medusa heads and random EAGLE-1 / EAGLE-3 heads."""
    for prompt_ in (PROMPT, REPEATING):
        reference = greedy_reference(target, prompt_, n)
        assert_clear_argmax(target, prompt_, reference)
        vocab = target.args.vocab_size
        drafters = {
            "draft": DraftModelDrafter(draft, vocab),
            "lookup": LookupDrafter(max_ngram=3, branches=1),
            "lookup-tree": LookupDrafter(max_ngram=3, branches=3),
            "medusa": MedusaDrafter(random_heads(target.args.hidden_size, vocab, seed=3)),
        }
        for name, drafter in drafters.items():
            tokens, steps, _ = decode(target, prompt_, n, drafter, FixedPolicy(4))
            assert tokens == reference, name
            drafted = sum(s.drafted for s in steps)
            accepted = sum(s.accepted for s in steps)
            if name == "draft":
                assert 0 < accepted < drafted, (accepted, drafted)
        # The public entry, with each method's keyword and the default (adaptive) policy.
        for options in ({"prompt_lookup": True}, {"draft_model": draft}):
            out = stream_generate(target, StubTokenizer(), prompt_, max_tokens=n, **options)
            assert [r.token for r in out] == reference, options
    config = {k: v for k, v in vars(target.args).items() if not k.startswith("_")}
    layers = target.args.num_hidden_layers  # at least 3: EAGLE-3 taps three layers
    for version, taps in ((1, None), (3, (0, layers // 2, layers - 1))):
        head = random_eagle_head(config, version, 5, draft_vocab=None, taps=taps)
        for settings in (EagleGrowth(16, 4, 4), EagleGrowth.chain(4)):
            drafter = make_drafter(EagleSpec(heads=head, tree=settings), target)
            reference = greedy_reference(target, PROMPT, n)
            tokens, steps, _ = decode(target, PROMPT, n, drafter, FixedPolicy(settings.total - 1))
            assert tokens == reference, (version, settings)
            assert sum(s.drafted for s in steps) > 0


def check_sampled_marginal(target, draft, temperature: float = 1.0, draws: int = 500) -> None:
    """With a draft model at temperature > 0, the second token of many generations follows
    the target's exact marginal for it (Pearson's test; tests/markov.py)."""
    mx.random.seed(0)
    vocab = target.args.vocab_size
    decoder = Decoder(Sequence(target, DraftModelDrafter(draft, vocab)))
    sampling = SamplingParams(temperature=temperature)
    start = [t % vocab for t in PROMPT]
    seconds = [
        leading_tokens(decoder, start, sampling, FixedPolicy(3), 2, 4)[1] for _ in range(draws)
    ]
    assert_follows_marginal(target, start, temperature, 1, seconds)


def check_convert_loads_in_mlx_lm(hf: Path, out: Path, vocab: int, n: int = 12) -> Path:
    """`convert -q` of a transformers folder gives a 4-bit folder that this package and mlx-lm
    both load, whose logits agree and whose greedy tokens (where margins are clear) agree."""
    import mlx_lm

    from .test_convert import save_tokenizer

    save_tokenizer(hf, vocab)
    dst = convert(hf, out, quantize=True, q_group_size=32)
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    ours, _ = load(dst)
    theirs, _ = mlx_lm.load(str(dst))
    tokens = mx.array([PROMPT + [11, 40, 3, 80, 12, 17, 23]])  # past the tiny windows
    a, b = ours(tokens).logits, theirs(tokens)
    scale = mx.abs(b).max().item()
    assert mx.abs(a - b).max().item() < 1e-4 * max(scale, 1.0)
    reference = greedy_reference(ours, PROMPT, n)
    logits = theirs(mx.array([PROMPT + reference]))[0, len(PROMPT) - 1 : -1]
    top2 = mx.sort(logits, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0] > 1e-3).tolist()
    picked = mx.argmax(logits, axis=-1).tolist()
    assert sum(clear) > n // 2
    assert [p for p, c in zip(picked, clear, strict=True) if c] == [
        r for r, c in zip(reference, clear, strict=True) if c
    ]
    return dst
