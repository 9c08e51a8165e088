"""Gemma 3 270M from its Q4_K_M GGUF, converted with -q, end to end: the folder keeps the
file's quantization, greedy decoding equals transformers' (float32, on the same dequantized
weights) for 64 tokens, prompt lookup, a self-draft, Medusa and EAGLE-1/EAGLE-3 (random
heads) stay lossless, `generate` runs it.

The GGUF comes from $MLX_SPECULATE_GEMMA3_GGUF or the user cache, fetched there on first use
(conftest.py's `gemma3_file`); skipped when it cannot be had, failed under CI=true. One prompt
by default, all with `-m slow`.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_speculate.convert import convert
from mlx_speculate.drafters import EagleGrowth, EagleSpec, make_drafter
from mlx_speculate.drafters.draft_model import DraftModelDrafter
from mlx_speculate.drafters.lookup import LookupDrafter
from mlx_speculate.drafters.medusa import MedusaDrafter
from mlx_speculate.generate import main as generate_main
from mlx_speculate.gguf.reader import read_gguf
from mlx_speculate.heads.medusa import MedusaHeads
from mlx_speculate.loading import load
from mlx_speculate.policy.adaptive import FixedPolicy

from .helpers import decode, greedy_reference, random_eagle_head
from .serving import serve

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "<start_of_turn>user\nWhat is 17 times 23?<end_of_turn>\n<start_of_turn>model\n",
]
SAMPLE = [pytest.param(p, marks=() if i == 0 else pytest.mark.slow) for i, p in enumerate(PROMPTS)]
N = 64


@pytest.fixture(scope="module")
def gguf_file(gemma3_file: Path) -> Path:
    return gemma3_file


@pytest.fixture(scope="module")
def folder(gguf_file: Path, tmp_path_factory) -> Path:
    return convert(gguf_file, tmp_path_factory.mktemp("gemma3") / "q4km", quantize=True)


@pytest.fixture(scope="module")
def target(folder: Path):
    return load(folder, dtype=mx.float32)


@pytest.fixture(scope="module")
def reference(folder: Path, target):
    """transformers' Gemma3ForCausalLM in float32 on the target's own weights, dequantized."""
    torch = pytest.importorskip("torch")
    import transformers

    model = target[0]
    params = dict(tree_flatten(model.parameters()))
    state = {}
    for name, value in params.items():
        module, _, part = name.rpartition(".")
        if part in ("scales", "biases"):
            continue
        if f"{module}.scales" in params:
            layer = model
            for key in module.split("."):
                layer = layer[int(key)] if key.isdigit() else getattr(layer, key)
            value = mx.dequantize(
                value, params[f"{module}.scales"], params[f"{module}.biases"],
                group_size=layer.group_size, bits=layer.bits,
            )  # fmt: skip
        state[name] = torch.from_numpy(np.array(value.astype(mx.float32)))
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization"), config.pop("quantization_config")
    hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig.from_dict(config))
    hf = hf.float().eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])  # tied to the embedding
    hf.tie_weights()
    return hf


def test_folder_keeps_the_gguf_quantization(gguf_file: Path, folder: Path) -> None:
    kept = read_gguf(gguf_file, keep_quantization=True)
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"] == config["quantization_config"] == kept.quantization
    stored = mx.load(str(folder / "model.safetensors"))
    assert stored.keys() == kept.weights.keys()
    for name, value in kept.weights.items():
        if (
            name.endswith((".weight", ".scales", ".biases"))
            and f"{name.rpartition('.')[0]}.scales" in kept.weights
        ):
            assert (
                mx.array_equal(stored[name], value).item() and stored[name].dtype == value.dtype
            ), name
        else:  # norms: float16 by default, as for every GGUF
            assert mx.array_equal(stored[name], value.astype(mx.float16)).item(), name


@pytest.mark.parametrize("prompt", SAMPLE)
def test_greedy_equals_transformers(target, reference, prompt: str) -> None:
    import torch

    model, tokenizer = target
    ids = tokenizer.encode(prompt)
    ours = greedy_reference(model, ids, N)
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([ids]), max_new_tokens=N, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
    assert ours == out[0, len(ids) :].tolist()


@pytest.mark.parametrize("prompt", SAMPLE)
def test_prompt_lookup_and_self_draft_are_lossless(folder: Path, target, prompt: str) -> None:
    model, tokenizer = target
    ids = tokenizer.encode(prompt)
    expected = greedy_reference(model, ids, N)
    draft, _ = load(folder, dtype=mx.float32)
    for drafter in (LookupDrafter(), DraftModelDrafter(draft, model.args.vocab_size)):
        tokens, steps, _ = decode(model, ids, N, drafter, FixedPolicy(4))
        assert tokens == expected, type(drafter).__name__
    assert len(steps) < N  # the self-draft is accepted: fewer target steps than tokens


def random_medusa(hidden: int, vocab: int) -> MedusaHeads:
    """Two random heads, 4-bit like the target (float32 heads over 262k tokens: 1.3 GB)."""
    heads = MedusaHeads(hidden, vocab, num_heads=2, num_layers=1)
    mx.random.seed(3)
    heads.update(nn.utils.tree_map(lambda a: 0.1 * mx.random.normal(a.shape), heads.parameters()))
    nn.quantize(heads, group_size=64, bits=4)
    mx.eval(heads.parameters())
    return heads


# A drafting step over 262k tokens is slow on a CPU: 16 tokens, EAGLE-3 by default.
METHODS = [
    pytest.param(m, marks=() if m == "eagle-3" else pytest.mark.slow)
    for m in ("eagle-3", "eagle-1", "medusa")
]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("prompt", SAMPLE)
def test_medusa_and_eagle_with_random_heads_are_lossless(target, prompt: str, method: str):
    model, tokenizer = target
    ids = tokenizer.encode(prompt)
    expected = greedy_reference(model, ids, 16)
    config = model.args
    if method == "medusa":
        drafter = MedusaDrafter(random_medusa(config.hidden_size, config.vocab_size))
    else:
        layers = config.num_hidden_layers
        head = random_eagle_head(
            vars(config), 3, seed=5, draft_vocab=4096, taps=(1, layers // 2, layers - 3)
        ) if method == "eagle-3" else random_eagle_head(vars(config), 1, seed=5)  # fmt: skip
        drafter = make_drafter(EagleSpec(heads=head, tree=EagleGrowth(8, 2, 3)), model)
    tokens, steps, _ = decode(model, ids, 16, drafter, FixedPolicy(7))
    assert tokens == expected
    assert sum(s.drafted for s in steps) > 0


def test_generate_runs_it(folder: Path, capsys) -> None:
    args = ["--model", str(folder), "--prompt", "The capital of France is", "-m", "8"]
    assert generate_main([*args, "--ignore-chat-template"]) == 0
    assert capsys.readouterr().out.strip()


def test_the_server_serves_it(target) -> None:
    """Through the openai client: a completion equals plain greedy, a chat turn answers."""
    model, tokenizer = target
    ids = tokenizer.encode(PROMPTS[0])
    expected = greedy_reference(model, ids, 8)
    with serve(model, tokenizer, model_id="gemma") as running:
        client = running.client()
        completion = client.completions.create(
            model="gemma", prompt=ids, max_tokens=8, temperature=0
        )
        messages = [{"role": "user", "content": "What is 17 times 23?"}]
        chat = client.chat.completions.create(
            model="gemma", messages=messages, max_tokens=8, temperature=0
        )
    assert completion.choices[0].text == tokenizer.decode(expected)
    assert completion.usage.completion_tokens == 8
    assert chat.choices[0].message.content.strip()
    assert chat.choices[0].finish_reason in ("stop", "length")
