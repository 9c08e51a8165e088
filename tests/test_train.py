"""Training heads: tiny EAGLE-1, EAGLE-3 and Medusa heads on stories260K's own samples learn
(loss falls, held-out accuracy rises), resume to the same weights after a Ctrl-C, load in every
layout, keep greedy decoding lossless; prompt files and bad input."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_speculate import generate, load
from mlx_speculate.heads.dflash_format import load_dflash
from mlx_speculate.heads.eagle_format import load_eagle_heads
from mlx_speculate.heads.medusa import load_medusa_heads
from mlx_speculate.sampling import SamplingParams
from mlx_speculate.train import loop
from mlx_speculate.train.__main__ import main
from mlx_speculate.train.data import answer, make_data, read_prompts
from mlx_speculate.train.loop import TrainConfig
from mlx_speculate.train.recipe import Recipe, train_head

from .helpers import (
    BESIDE,
    EAGLE_HEADS,
    MODELS,
    assert_clear_argmax,
    assert_float32_close,
    greedy_reference,
    require,
    tiny_model,
)

STORIES = MODELS / "stories260K-llama"
SAMPLES = dict(self_samples=24, max_tokens=64)


def recipe(kind: str, **train) -> Recipe:
    settings = dict(epochs=5, learning_rate=3e-3, warmup=2, batch_tokens=128, holdout=0.25,
                    patience=5, save_every=4) | train  # fmt: skip
    return Recipe(kind, draft_vocab=256, ttt_steps=3, medusa_heads=2, train=TrainConfig(**settings),
                  **SAMPLES)  # fmt: skip


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    """The data stage once (24 samples from BOS), shared by every head kind."""
    model = STORIES
    folder = tmp_path_factory.mktemp("cache")
    train_head("eagle1", model, folder / "probe", cache=folder, progress=False,
               recipe=recipe("eagle1", max_steps=1))  # fmt: skip
    shutil.rmtree(folder / "train-eagle1")
    return folder


def cache_copy(data_cache, tmp_path):
    dst = tmp_path / "cache"
    shutil.copytree(data_cache, dst, ignore=shutil.ignore_patterns("train-*"))
    return dst


@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "medusa", "dflash"])
def test_heads_learn_and_keep_greedy_lossless(data_cache, tmp_path, kind):
    out = tmp_path / kind
    # A DFlash drafter starts from nothing of the target's but its embedding and lm_head.
    settings = dict(epochs=12, patience=12) if kind == "dflash" else {}
    result = train_head(kind, STORIES, out, cache=cache_copy(data_cache, tmp_path),
                        recipe=recipe(kind, **settings), progress=False)  # fmt: skip
    accuracies = [h["held_out_top1"] for h in result.history]
    assert result.held_out_top1 == max(accuracies) > accuracies[0]
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    check_layout(kind, out)
    assert result.bytes_per_token > 0 and set(result.seconds) == {"data", "features", "train"}
    model, tokenizer = load(STORIES)
    options = dict(max_tokens=60)
    prompt = [1]  # BOS: what the heads were trained from
    plain = generate(model, tokenizer, prompt, **options)
    if kind == "medusa":
        heads = load_medusa_heads(out, model)
        assert heads.num_heads == 2
        assert generate(model, tokenizer, prompt, medusa=heads, **options) == plain
    elif kind == "dflash":
        drafter = load_dflash(out, model)
        assert generate(model, tokenizer, prompt, dflash=drafter, **options) == plain
        tree = generate(model, tokenizer, prompt, dflash=drafter, dflash_top_k=2, **options)
        assert tree == plain
    else:
        head = load_eagle_heads(out, model)
        assert generate(model, tokenizer, prompt, eagle=head, **options) == plain


def test_a_wider_draft_mlp_is_saved_loaded_and_lossless(data_cache, tmp_path):
    """`intermediate_size` widens the draft layer's MLP (the official loaders read the width
    from config.json); the saved head loads at that width and drafts losslessly."""
    out = tmp_path / "wide"
    short = TrainConfig(epochs=1, batch_tokens=128, max_steps=3)
    wide = Recipe("eagle3", draft_vocab=256, ttt_steps=3, intermediate_size=200, train=short,
                  **SAMPLES)  # fmt: skip
    train_head("eagle3", STORIES, out, cache=cache_copy(data_cache, tmp_path), recipe=wide,
               progress=False)  # fmt: skip
    assert json.loads((out / "config.json").read_text())["intermediate_size"] == 200
    model, tokenizer = load(STORIES)
    head = load_eagle_heads(out, model)
    assert head.midlayer.mlp.gate_proj.weight.shape == (200, model.args.hidden_size)
    plain = generate(model, tokenizer, [1], max_tokens=60)
    assert generate(model, tokenizer, [1], eagle=head, max_tokens=60) == plain


def check_layout(kind: str, out) -> None:
    """Keys and configs as SafeAILab's and Medusa's loaders read them."""
    from safetensors.numpy import load_file

    file = "medusa_lm_head.safetensors" if kind == "medusa" else "model.safetensors"
    names = load_file(str(out / file))
    config = json.loads((out / "config.json").read_text())
    if kind == "eagle1":
        assert config["bias"] is False and config["num_hidden_layers"] == 1
        assert {"fc.weight", "layers.0.self_attn.q_proj.weight"} < set(names)
    if kind == "eagle3":
        assert config["draft_vocab_size"] == 256
        assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]  # the last three of 5 layers
        need = {"fc.weight", "midlayer.hidden_norm.weight", "norm.weight", "lm_head.weight"}
        assert need < set(names)
        d2t, t2d = names["d2t"], names["t2d"]
        assert d2t.dtype == np.int64 and t2d.dtype == bool and t2d.sum() == 256
        assert np.array_equal(np.nonzero(t2d)[0], np.arange(256) + d2t)
    if kind == "dflash":  # z-lab's layout: one layer reading layers 1 and 3 of 5 (the default)
        assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 8
        assert config["dflash_config"]["target_layer_ids"] == [1, 3]
        assert config["num_target_layers"] == 5 and config["num_hidden_layers"] == 1
        assert {"fc.weight", "hidden_norm.weight", "layers.0.self_attn.k_norm.weight"} < set(names)
        assert not any(name.startswith(("embed_tokens", "lm_head")) for name in names)
    if kind == "medusa":
        assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (2, 1)
        assert {"0.0.linear.weight", "0.0.linear.bias", "0.1.weight"} < set(names)


def test_a_ctrl_c_resumes_to_the_same_weights(data_cache, tmp_path, monkeypatch):
    short = recipe("eagle1", epochs=2)
    whole = train_head("eagle1", STORIES, tmp_path / "whole", progress=False, recipe=short,
                       cache=cache_copy(data_cache, tmp_path / "a"))  # fmt: skip
    calls = {"n": 0}
    collate = loop.collate

    def interrupted(*args):
        calls["n"] += 1
        if calls["n"] == 7:  # past a checkpoint (every 4 steps), within the first epoch
            raise KeyboardInterrupt
        return collate(*args)

    cache = cache_copy(data_cache, tmp_path / "b")
    monkeypatch.setattr(loop, "collate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_head("eagle1", STORIES, tmp_path / "resumed", cache=cache, progress=False,
                   recipe=short)  # fmt: skip
    assert not (tmp_path / "resumed").exists()
    monkeypatch.setattr(loop, "collate", collate)
    resumed = train_head("eagle1", STORIES, tmp_path / "resumed", cache=cache, progress=False,
                         recipe=short)  # fmt: skip
    assert resumed.history == whole.history
    a = dict(tree_flatten(load_eagle_heads(whole.out).parameters()))
    b = dict(tree_flatten(load_eagle_heads(resumed.out).parameters()))
    assert all(mx.array_equal(a[k], b[k]) for k in a)


def test_held_out_accuracy_reads_the_features_without_training_noise(data_cache, tmp_path):
    """As the official test loader: the uniform feature noise is for training steps only."""
    from mlx_speculate.train.features import open_features
    from mlx_speculate.train.objectives import eagle1_loss
    from mlx_speculate.train.recipe import build

    model, _ = load(STORIES)
    features = open_features(data_cache / "features-final")
    short = recipe("eagle1", epochs=1)
    config = short.train
    head, loss_fn, frozen = build("eagle1", model, features, short, ())
    batch = loop.collate(features, np.arange(2), config.batch_tokens)
    clean = loss_fn(head, batch, *frozen, None)[0].item()
    assert clean == eagle1_loss(head, batch, *frozen, mx.random.key(0), noise=0.0)[0].item()
    assert clean != loss_fn(head, batch, *frozen, mx.random.key(0))[0].item()
    keys = []

    def recording(h, b, *rest):
        keys.append(rest[-1])
        return loss_fn(h, b, *rest)

    loop.train(head, recording, frozen, features, tmp_path, config, progress=False)
    held = loop.split(features.conversations, config.holdout, config.seed)[1]
    evaluations = len(loop.batches(features, held, config.batch_tokens, None))
    assert keys[-evaluations:] == [None] * evaluations and keys[0] is not None


def test_features_keep_the_targets_top_k_from_the_token_before_the_answer(tmp_path):
    """Stage 2 stores the target's k likeliest next tokens, best first, at each position whose
    next token the target wrote; the prompt's rows before that stay zero (no loss reads them)."""
    from mlx_speculate.train.data import Conversation
    from mlx_speculate.train.features import make_features

    model, _ = load(str(STORIES))
    rng = np.random.default_rng(0)
    conversations = [
        Conversation(tuple(int(t) for t in rng.integers(1, 512, n)), answer)
        for n, answer in ((40, 12), (25, 1), (30, 29))
    ]
    features = make_features(model, conversations, tmp_path, (), model.args.hidden_size, 5,
                             progress=False)  # fmt: skip
    for i, c in enumerate(conversations):
        rows, first = features.rows(i), c.answer - 1
        logits = np.array(model(mx.array([c.tokens])).logits[0, first:])
        best = -np.sort(-logits, axis=-1)[:, :5]
        ids, top = features.top_ids[rows][first:], features.top_logits[rows][first:]
        np.testing.assert_allclose(top, best, rtol=2e-3, atol=2e-3)  # stored as float16
        # The stored ids come from a batched forward: a near tie may swap by its rounding.
        assert_float32_close(np.take_along_axis(logits, ids, axis=-1), best)
        assert not features.top_ids[rows][:first].any()
        assert not features.top_logits[rows][:first].any()
        assert list(features.answer[rows]) == [0] * c.answer + [1] * (len(c.tokens) - c.answer)


def test_the_loss_logsumexp_keeps_mlx_values_and_gradients():
    """The losses' logsumexp reuses its forward softmax in the backward pass; value and
    gradient equal MLX's own, compiled or not, on wide rows with large logits."""
    from mlx_speculate.train.objectives import _logsumexp

    z = mx.random.normal((5, 3000), key=mx.random.key(1)) * 30
    w = mx.random.normal((5,), key=mx.random.key(2))

    def ours(z):
        return mx.sum(w * _logsumexp(z))

    def theirs(z):
        return mx.sum(w * mx.logsumexp(z, axis=-1))

    expected_value, expected_grad = mx.value_and_grad(theirs)(z)
    for f in (mx.value_and_grad(ours), mx.compile(mx.value_and_grad(ours))):
        value, grad = f(z)
        assert mx.allclose(value, expected_value, rtol=1e-6).item()
        assert mx.allclose(grad, expected_grad, atol=1e-7).item()
        assert mx.abs(grad).max().item() > 0.1  # large logits: a peaked softmax


@pytest.mark.parametrize(
    ("content", "suffix", "expected"),
    [
        (["Hi there", "Tell me a story"], ".json", ["Hi there", "Tell me a story"]),
        ([{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "x"}]}],
         ".json", [[{"role": "user", "content": "Hi"}]]),
        ([{"messages": [{"role": "system", "content": "Be brief"},
                        {"role": "user", "content": "Why?"}]}], ".jsonl",
         [[{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Why?"}]]),
    ],
)  # fmt: skip
def test_prompt_files(tmp_path, content, suffix, expected):
    file = tmp_path / f"p{suffix}"
    text = "\n".join(map(json.dumps, content)) if suffix == ".jsonl" else json.dumps(content)
    file.write_text(text)
    assert read_prompts(file) == expected


def test_bad_input_is_one_line_with_exit_2(data_cache, tmp_path, capsys):
    base = ["--model", str(STORIES), "--quiet", "--max-tokens", "64"]
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    cases = [
        (["eagle1", "--prompts", str(empty), "--out", str(tmp_path / "a")], "holds no prompts"),
        (["eagle3", "--self-samples", "2", "--taps", "9", "--out", str(tmp_path / "b")],
         "are not layers of a 5-layer target"),
        (["eagle1", "--self-samples", "2", "--out", str(tmp_path)], "exists"),
        (["eagle1", "--prompts", str(tmp_path / "p.json"), "--out", str(tmp_path / "c")],
         "no chat template"),
    ]  # fmt: skip
    (tmp_path / "p.json").write_text(json.dumps(["Once upon a time"]))
    for args, message in cases:
        assert main([*args, *base]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    cache = cache_copy(data_cache, tmp_path / "d")
    (cache / "features-final" / "features.npy").write_bytes(b"junk")
    args = ["eagle1", "--self-samples", "24", "--out", str(tmp_path / "e"), "--cache", str(cache)]
    assert main([*args, *base]) == 2
    err = capsys.readouterr().err
    assert "feature cache" in err and "corrupt" in err and err.count("\n") == 1


def test_default_taps_are_the_official_three_or_a_shallow_targets_last_three():
    from types import SimpleNamespace

    from mlx_speculate.train.recipe import _taps

    for layers, taps in ((3, (0, 1, 2)), (5, (2, 3, 4)), (6, (3, 4, 5)), (7, (2, 3, 4)),
                         (28, (2, 14, 25)), (30, (2, 15, 27))):  # fmt: skip
        target = SimpleNamespace(args=SimpleNamespace(num_hidden_layers=layers))
        assert _taps("eagle3", target, None) == taps, layers
        assert _taps("eagle1", target, None) == ()
    # DFlash: the states after max(2, draft layers) layers spread from 1 to L - 2 (36 layers, 5
    # draft layers: 1, 9, 18, 26, 34), or after the named ones; never the last layer's.
    target = SimpleNamespace(args=SimpleNamespace(num_hidden_layers=36))
    assert _taps("dflash", target, None, 5) == (2, 10, 19, 27, 35)
    assert _taps("dflash", target, (0, 34), 1) == (1, 35)
    with pytest.raises(ValueError, match="layers 0 to 34 of a 36-layer target, not \\[35\\]"):
        _taps("dflash", target, (35,), 1)


def test_a_recipe_setting_below_one_is_a_one_line_error():
    for setting in ("max_tokens", "top_k", "draft_vocab", "ttt_steps", "data_batch",
                    "intermediate_size", "draft_layers", "anchors"):  # fmt: skip
        with pytest.raises(ValueError, match="must be >= 1"):
            Recipe("eagle1", **{setting: 0})
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        Recipe("dflash", block_size=1)


class ChatStub:
    """A tokenizer whose chat template makes `length` tokens of any prompt."""

    has_chat_template = True
    eos_token_ids = [3]

    def __init__(self, length: int):
        self.length = length

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return [1 + i % 90 for i in range(self.length)]


def test_prompts_longer_than_the_context_and_answers_with_a_template(tmp_path):
    model = tiny_model("llama")  # context 256
    with pytest.raises(ValueError, match="prompt 0 has 300 tokens, the model's context is 256"):
        make_data(model, ChatStub(300), tmp_path, prompts=["a", "b"], progress=False)
    data = make_data(model, ChatStub(20), tmp_path, prompts=["a", "b", "c"], max_tokens=8,
                     progress=False)  # fmt: skip
    assert [c.answer for c in data] == [20, 20, 20]
    assert all(20 < len(c.tokens) <= 28 for c in data)
    assert data[0].tokens == data[1].tokens  # greedy answers, batched alike
    again = make_data(model, ChatStub(20), tmp_path, prompts=["a", "b", "c"], max_tokens=8,
                      progress=False)  # fmt: skip
    assert again == data  # read back from data.jsonl, not answered again


# Seeds whose greedy continuations below keep a clear top-2 margin (asserted, not assumed).
@pytest.mark.parametrize("family,seed", [("llama", 1), ("qwen2", 0), ("phi3", 2), ("qwen3", 1)])
def test_a_padded_batch_answers_as_each_prompt_alone(family, seed):
    """Prompts of four lengths in one left-padded batch: each row is plain greedy decoding of
    its prompt, up to its own end token or length (rows leave the batch as they end)."""
    model = tiny_model(family, seed)
    prompts = [[1, 5, 9], [7, 2, 60, 33, 8, 11, 4, 90, 21], [42], [3, 3, 3, 3, 3, 3]]
    references = [greedy_reference(model, p, 20) for p in prompts]
    for p, r in zip(prompts, references, strict=True):
        assert_clear_argmax(model, p, r)  # equal outputs are not a coin flip on near-ties
    eos, limits = [references[1][5]], [20, 20, 12, 7]
    expected = []
    for r, limit in zip(references, limits, strict=True):
        ends = [i + 1 for i, t in enumerate(r[:limit]) if t in eos]
        expected.append(r[: min(ends + [limit])])
    assert len({len(e) for e in expected}) == 4  # rows end at different steps
    assert answer(model, prompts, limits, eos, SamplingParams(), mx.random.key(0)) == expected


def test_self_samples_are_a_sampled_start_then_greedy(tmp_path):
    model = tiny_model("llama", seed=1)
    with pytest.raises(ValueError, match="need a sampled prefix"):
        make_data(model, None, tmp_path, self_samples=2, sample_prefix=0, progress=False)
    data = make_data(model, None, tmp_path, self_samples=3, sample_prefix=4, max_tokens=12,
                     progress=False)  # fmt: skip
    starts = [c.tokens[:5] for c in data]
    assert len(set(starts)) == 3 and all(s[0] == 0 for s in starts)  # BOS (0), then drawn
    for c in data:
        assert c.answer == 1
        assert list(c.tokens[5:]) == greedy_reference(model, list(c.tokens[:5]), 12)


def test_a_sliding_window_model_batches_equal_lengths_only(tmp_path):
    model = tiny_model("gemma3_text")
    with pytest.raises(ValueError, match="equal-length prompts only"):
        answer(model, [[1, 2], [3]], [4, 4], [], SamplingParams(), mx.random.key(0))
    data = make_data(model, ChatStub(9), tmp_path, prompts=["a", "b"], max_tokens=6,
                     progress=False)  # fmt: skip
    alone = tuple(greedy_reference(model, list(data[0].tokens[:9]), 6))
    assert [c.tokens[9:] for c in data] == [alone, alone]


def test_saved_heads_have_the_official_keys_shapes_and_dtypes(tmp_path):
    """What the recipe writes for SmolLM2 matches, key for key (shape and dtype: what a strict
    torch load checks), the heads the official trainer made (../shared/eagle) and, for
    EAGLE-3, what speculators' converter made of them; the package's loader reads both back."""
    from types import SimpleNamespace

    from mlx_speculate.heads.eagle import Eagle1Head, Eagle3Head, EagleConfig
    from mlx_speculate.heads.eagle_format import save_official
    from mlx_speculate.train.recipe import _layer

    eagle = require(EAGLE_HEADS, BESIDE)
    torch = pytest.importorskip("torch")  # the official heads are torch pickles
    config = json.loads((eagle / "smollm2-eagle1" / "config.json").read_text())
    target = SimpleNamespace(args=SimpleNamespace(**config))  # the target's sizes and rope
    heads = {
        "smollm2-eagle1": Eagle1Head(EagleConfig(version=1, layer=_layer(target, None))),
        "smollm2-eagle3": Eagle3Head(EagleConfig(version=3, layer=_layer(target, 10000.0),
                                                 taps=(2, 15, 27), draft_vocab_size=4096)),
    }  # fmt: skip

    def layout(weights) -> dict[str, tuple[tuple[int, ...], str]]:
        return {k: (tuple(v.shape), str(v.dtype).rpartition(".")[2]) for k, v in weights.items()}

    for name, head in heads.items():
        out = save_official(head, tmp_path / name)
        ours = layout(mx.load(str(out / "model.safetensors")))
        official = torch.load(eagle / name / "pytorch_model.bin", map_location="cpu")
        assert ours == layout(official), name
        assert load_eagle_heads(out).config.version == head.config.version
    shared = eagle / "smollm2-eagle3-speculators"
    out = save_official(heads["smollm2-eagle3"], tmp_path / "speculators", layout="speculators")
    assert layout(mx.load(str(out / "model.safetensors"))) == layout(
        mx.load(str(shared / "model.safetensors"))
    )
    ours, theirs = (json.loads((f / "config.json").read_text()) for f in (out, shared))
    assert ours.keys() <= theirs.keys()
    mine, official_layer = ours["transformer_layer_config"], theirs["transformer_layer_config"]
    for key in ("hidden_size", "num_key_value_heads", "head_dim", "intermediate_size"):
        assert mine[key] == official_layer[key], key
    assert mine["rope_parameters"]["rope_theta"] == official_layer["rope_parameters"]["rope_theta"]
    for key in ("architectures", "speculators_model_type", "draft_vocab_size",
                "eagle_aux_hidden_state_layer_ids", "norm_before_residual"):  # fmt: skip
        assert ours[key] == theirs[key], key
    a = dict(tree_flatten(load_eagle_heads(out).parameters()))
    b = dict(tree_flatten(heads["smollm2-eagle3"].parameters()))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]) for k in a)
