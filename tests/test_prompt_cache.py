"""Prompt-cache files (mlx_speculate/prompt_cache/): every cache kind round-trips exactly
(attention, sliding-window and per-layer-shaped families, the hybrids' recurrent state), a
generation started from the file equals plain greedy decoding of the whole prompt (plain, prompt
lookup, a draft model) while prefilling only the continuation, each wrong file is a one-line
error, mlx-lm reads an attention model's file, and the CLIs work end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_speculate.cache_prompt import main as cache_prompt_main
from mlx_speculate.generate import main as generate_main
from mlx_speculate.generation import stream_generate
from mlx_speculate.loading import build_model, load
from mlx_speculate.prompt_cache import (
    PromptCache,
    cache_prompt,
    load_prompt_cache,
    save_prompt_cache,
)
from mlx_speculate.prompt_cache.file import FORMAT
from mlx_speculate.state_cache import HybridCache

from .helpers import greedy_reference, random_weights, tiny_config, tiny_model
from .markov import StubTokenizer
from .test_cli import tiny_folder
from .test_medusa import random_heads

ROOT = Path(__file__).resolve().parents[1]
# Attention; Gemma 3's sliding layer; Gemma 4's layers of two head sizes; the hybrids.
KINDS = ["llama", "gemma3_text", "gemma4_text", "qwen3_next", "qwen3_5_text"]
CACHED = [int(t) for t in np.random.default_rng(0).integers(3, 90, 70)] * 2  # repeats: lookup
MORE = [5, 9, 33, 7, 2, 60, 11]


def model_of(model_type: str, seed: int = 0, **overrides):
    return tiny_model(model_type, seed, **overrides)


@pytest.fixture(scope="module")
def models():
    return {t: model_of(t) for t in KINDS}


def saved(tmp_path: Path, model, tokens=CACHED, name: str = "x.safetensors") -> Path:
    path = tmp_path / name
    save_prompt_cache(path, model, cache_prompt(model, tokens, name="tiny"))
    return path


def next_logits(model, cache) -> mx.array:
    return model(mx.array([MORE]), cache).logits


@pytest.mark.parametrize("model_type", KINDS)
def test_every_cache_kind_round_trips_exactly(tmp_path, models, model_type):
    """The loaded cache holds the same prompt, offset and arrays, rolls back as far, and the
    next forward on it gives the same logits as on the cache that was saved."""
    model = models[model_type]
    made = cache_prompt(model, CACHED)
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, model, made)
    loaded = load_prompt_cache(path, model)
    n = len(CACHED)
    assert loaded.tokens == tuple(CACHED) and loaded.model == ""
    assert type(loaded.cache) is type(made.cache) and loaded.cache.offset == n
    rings = made.cache.rings * 2
    attention = made.cache.keys + made.cache.values
    for a, b, ring in zip(attention, loaded.cache.keys + loaded.cache.values, rings, strict=True):
        if ring is None:
            assert mx.array_equal(a[..., :n, :], b[..., :n, :])
        else:  # a sliding layer's ring, wrapped: the file keeps what later tokens see
            assert a.shape[2] == ring < n
            seen = mx.remainder(mx.arange(n - made.cache.window + 1, n), ring)
            assert mx.array_equal(mx.take(a, seen, axis=2), mx.take(b, seen, axis=2))
    if isinstance(made.cache, HybridCache):
        recurrent = made.cache.conv + made.cache.ring
        for a, b in zip(recurrent, loaded.cache.conv + loaded.cache.ring, strict=True):
            assert mx.array_equal(a, b)
        assert loaded.cache.base.item() == made.cache.base.item() == n - 1
    assert loaded.cache.restorable(n - 1) == made.cache.restorable(n - 1) == n - 1
    assert mx.array_equal(next_logits(model, made.cache), next_logits(model, loaded.cache))


def test_a_hybrid_rolls_the_loaded_state_back_to_the_last_prompt_token(tmp_path, models):
    """The loaded state at the cached prompt's last token gives what the whole prompt's
    forward gives: the cached prompt sent again re-runs that token alone."""
    model = models["qwen3_5_text"]
    loaded = load_prompt_cache(saved(tmp_path, model), model)
    loaded.cache.truncate(len(CACHED) - 1)
    rerun = model(mx.array([CACHED[-1:]]), loaded.cache).logits[0, -1]
    whole = model(mx.array([CACHED])).logits[0, -1]
    np.testing.assert_allclose(np.array(rerun), np.array(whole), rtol=1e-4, atol=1e-4)


def draft_model():
    return model_of("llama", seed=3)


METHODS = {
    "plain": dict,
    "prompt_lookup": lambda: {"prompt_lookup": True, "num_draft_tokens": 4},
    "draft_model": lambda: {"draft_model": draft_model(), "num_draft_tokens": 4},
}


# Every method on an attention, a sliding-window and a hybrid family; the other hybrid plainly.
RUNS = [(t, m) for t in ("llama", "gemma3_text", "qwen3_5_text") for m in METHODS]


@pytest.mark.parametrize("model_type, method", [*RUNS, ("qwen3_next", "plain")])
def test_generation_from_the_file_equals_greedy_decoding_of_the_whole_prompt(
    tmp_path, models, model_type, method
):
    """`prompt_cache_file=` with a continuation: the cached tokens are not prefilled again,
    and the tokens equal plain greedy decoding of cached prompt + continuation."""
    model = models[model_type]
    path = saved(tmp_path, model)
    out = list(
        stream_generate(
            model, StubTokenizer(), MORE, max_tokens=16, prompt_cache_file=path, **METHODS[method]()
        )
    )
    assert [r.token for r in out] == greedy_reference(model, CACHED + MORE, 16)
    assert out[0].cached_tokens == len(CACHED)
    assert out[0].prompt_tokens == len(CACHED) + len(MORE)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text"])
def test_an_empty_continuation_reruns_only_the_last_cached_token(tmp_path, models, model_type):
    model = models[model_type]
    path = saved(tmp_path, model)
    out = list(stream_generate(model, StubTokenizer(), [], max_tokens=8, prompt_cache_file=path))
    assert [r.token for r in out] == greedy_reference(model, CACHED, 8)
    assert out[0].cached_tokens == len(CACHED) - 1


def test_mlx_lm_reads_an_attention_models_file(tmp_path, models):
    from mlx_lm.models.cache import load_prompt_cache as mlx_lm_load

    model = models["llama"]
    path = saved(tmp_path, model)
    caches, metadata = mlx_lm_load(str(path), return_metadata=True)
    ours = load_prompt_cache(path, model).cache
    assert len(caches) == len(ours.keys) and metadata["model"] == "tiny"
    for layer, cache in enumerate(caches):
        assert type(cache).__name__ == "KVCache" and cache.offset == len(CACHED)
        assert mx.array_equal(cache.keys, ours.keys[layer][..., : len(CACHED), :])
        assert mx.array_equal(cache.values, ours.values[layer][..., : len(CACHED), :])


def test_saving_replaces_the_file_atomically(tmp_path, models):
    """A second save replaces the first whole and leaves no staging folder; a save that fails
    leaves the old file as it was."""
    model = models["llama"]
    path = saved(tmp_path, model, CACHED[:20])
    saved(tmp_path, model, CACHED[:30])
    assert load_prompt_cache(path, model).tokens == tuple(CACHED[:30])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]
    before = path.read_bytes()
    with pytest.raises(ValueError, match="must hold its 3 prompt tokens, it holds 0"):
        save_prompt_cache(path, model, PromptCache((1, 2, 3), model.make_cache()))
    assert path.read_bytes() == before
    nested = tmp_path / "new" / "folder" / "c.safetensors"
    save_prompt_cache(nested, model, cache_prompt(model, CACHED[:5]))
    assert load_prompt_cache(nested, model).tokens == tuple(CACHED[:5])


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def rewritten(path: Path, change) -> Path:
    """The file saved again after `change(arrays, metadata)` edits it."""
    arrays, metadata = mx.load(str(path), return_metadata=True)
    change(arrays, metadata)
    out = path.with_name("changed.safetensors")
    mx.save_safetensors(str(out), arrays, metadata)
    return out


def test_wrong_files_are_one_line_errors(tmp_path, models):
    model = models["llama"]
    path = saved(tmp_path, model)
    with pytest.raises(FileNotFoundError) as e:
        load_prompt_cache(tmp_path / "missing.safetensors", model)
    assert "missing.safetensors does not exist" in one_line(e)
    with pytest.raises(FileNotFoundError, match="is a folder"):
        load_prompt_cache(tmp_path, model)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError) as e:
        load_prompt_cache(junk, model)
    assert "is not a prompt-cache file (no safetensors header)" in one_line(e)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError) as e:
        load_prompt_cache(truncated, model)
    assert "is a corrupt prompt-cache file" in one_line(e)
    foreign = rewritten(path, lambda arrays, meta: meta.pop("0.format"))
    with pytest.raises(ValueError) as e:
        load_prompt_cache(foreign, model)
    assert f"not a prompt-cache file of mlx_speculate (format {FORMAT})" in one_line(e)

    def shorter(arrays, meta):
        arrays["1.0"] = arrays["1.0"][:, :, :-1]

    with pytest.raises(ValueError) as e:
        load_prompt_cache(rewritten(path, shorter), model)
    assert "corrupt prompt-cache file (entry 1 holds a" in one_line(e)

    def bad_tokens(arrays, meta):
        meta["0.tokens"] = json.dumps(CACHED[:-1] + [10_000])

    with pytest.raises(ValueError, match="corrupt prompt-cache file \\(its prompt tokens\\)"):
        load_prompt_cache(rewritten(path, bad_tokens), model)


def test_a_file_of_another_model_or_settings_is_a_one_line_error(tmp_path, models):
    path = saved(tmp_path, models["llama"])
    cases = {
        "was made with a llama model, not this gemma3_text one": models["gemma3_text"],
        "was made with another llama model (its config or shapes differ)": model_of(
            "llama", num_hidden_layers=3
        ),
        "was made with other weights of this llama architecture": model_of("llama", seed=1),
    }
    config = tiny_config("llama")
    weights = {k: v.astype(mx.float16) for k, v in random_weights(config, 0).items()}
    half = build_model(config, weights)
    cases["was made with the model computing in float32, not float16 (--dtype float32)"] = half
    for message, other in cases.items():
        with pytest.raises(ValueError) as e:
            load_prompt_cache(path, other)
        assert message in one_line(e)


def test_a_head_drafter_is_refused_in_one_line(tmp_path, models):
    model = models["llama"]
    path = saved(tmp_path, model)
    heads = random_heads(model.args.hidden_size, model.args.vocab_size)
    with pytest.raises(ValueError) as e:
        list(stream_generate(model, StubTokenizer(), MORE, prompt_cache_file=path, medusa=heads))
    assert "not the features a head drafter" in one_line(e)


# -- the command lines --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_folder(tmp_path_factory.mktemp("prompt_cache") / "tiny", 256)


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory) -> Path:
    """The tiny folder with a chat template in its vocabulary's words: w91 opens a user
    message, w93 ends a turn, w94 starts the answer."""
    folder = tiny_folder(tmp_path_factory.mktemp("prompt_cache") / "chat", 256)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}{{ 'w91' if m.role == 'user' else 'w92' }} {{ m.content }}"
        " w93 {% endfor %}{% if add_generation_prompt %}w94 {% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


DOCUMENT = " ".join(f"w{3 + (i * 7) % 80}" for i in range(60))
QUESTION = "w5 w6 w7"


def generated(capsys, argv) -> str:
    assert generate_main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out


@pytest.mark.parametrize("chat", [False, True])
def test_cache_prompt_then_generate_equals_the_whole_prompt(
    tmp_path, capsys, folder, chat_folder, chat
):
    """cache_prompt, then generate with the file and no --model (the file names it): the
    text of generate over document + question, the question continuing the cached message."""
    model = chat_folder if chat else folder
    raw = [] if chat else ["--ignore-chat-template"]
    path = tmp_path / "doc.safetensors"
    argv = ["--model", str(model), "--prompt-cache-file", str(path), "--prompt", DOCUMENT, *raw]
    assert cache_prompt_main(argv) == 0
    assert "Cached 6" in capsys.readouterr().err
    ours = generated(
        capsys, ["--prompt-cache-file", str(path), "--prompt", QUESTION, "-m", "12", *raw]
    )
    whole = generated(
        capsys, ["--model", str(model), "--prompt", f"{DOCUMENT} {QUESTION}", "-m", "12", *raw]
    )
    assert ours == whole and len(ours.split()) == 12


def exit_status(main, argv) -> int:
    """What `main` returns, or the status argparse exits with."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_the_clis_say_what_is_wrong_in_one_line(tmp_path, capsys, folder):
    path = tmp_path / "doc.safetensors"
    missing = ["--prompt-cache-file", str(path), "--prompt", "w5"]
    for main, argv, message in [
        (generate_main, missing, f"error: prompt-cache file {path} does not exist"),
        (
            generate_main,
            [*missing, "--system-prompt", "w6"],
            "error: --system-prompt: a cached prompt holds its own (give it to cache_prompt)",
        ),
        (
            cache_prompt_main,
            ["--model", str(folder), "--prompt-cache-file", str(tmp_path), "--prompt", "w5"],
            f"error: --prompt-cache-file {tmp_path} is a folder, not a file",
        ),
    ]:
        assert exit_status(main, argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.endswith(message), err


def test_cache_prompt_runs_as_a_module(tmp_path, folder):
    """A fresh process, the prompt on stdin; the file names the folder by its absolute path."""
    path = tmp_path / "doc.safetensors"
    command = [sys.executable, "-m", "mlx_speculate.cache_prompt", "--model", str(folder)]
    command += ["--prompt-cache-file", str(path), "--ignore-chat-template"]
    result = subprocess.run(
        command, input=DOCUMENT.encode(), capture_output=True, cwd=ROOT, timeout=300
    )
    assert result.returncode == 0, result.stderr.decode()
    model, _ = load(folder)
    assert load_prompt_cache(path, model).model == str(folder.resolve())
