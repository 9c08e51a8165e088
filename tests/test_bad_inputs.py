"""Bad input that once ended in a traceback, or loaded without a word, now gets one line naming
what is wrong: exit 2 on the CLIs, a ValueError/TypeError naming the argument in the API."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlx_speculate.chat import apply_chat_template
from mlx_speculate.convert import main as convert_main
from mlx_speculate.generate import main as generate_main
from mlx_speculate.generation import stream_generate
from mlx_speculate.loading import build_model, load

from .helpers import random_weights, tiny_config, tiny_model
from .markov import StubTokenizer
from .serving import serve
from .test_loading import write_folder

PROMPT = [1, 5, 9, 33]


def one_line(error: pytest.ExceptionInfo, *words: str) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message
    return message


def cli_error(capsys, argv: list[str], entry=generate_main) -> str:
    capsys.readouterr()
    try:
        code = entry(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert "error: " in line, err
    return line


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    config = tiny_config()
    return write_folder(tmp_path / "tiny", config, random_weights(config))


def rewrite_config(folder: Path, **changes) -> Path:
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# -- the Python API ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, kind, words",
    [
        ({"seed": -1, "temperature": 0.8}, ValueError, ("seed", "2**64")),
        ({"seed": 2**70, "temperature": 0.8}, ValueError, ("seed", str(2**70))),
        ({"seed": 2.5}, TypeError, ("seed", "integer")),
        ({"seed": "x"}, TypeError, ("seed", "'x'")),
        ({"seed": True}, TypeError, ("seed",)),
        ({"max_tokens": "20"}, TypeError, ("max_tokens", "'20'")),
        ({"temperature": None}, TypeError, ("temperature", "number")),
        ({"temperature": 10**400}, ValueError, ("temperature", "finite")),
        ({"top_k": 2.0, "temperature": 1.0}, TypeError, ("top_k", "integer")),
        ({"stop": [None]}, TypeError, ("stop", "strings")),
        ({"stop": [""]}, ValueError, ("stop", "empty")),
        ({"temprature": 0.5}, TypeError, ("'temprature'", "did you mean 'temperature'")),
    ],
)
def test_api_arguments_name_themselves(model, kwargs, kind, words):
    with pytest.raises(kind) as error:
        next(stream_generate(model, StubTokenizer(), PROMPT, **kwargs))
    message = one_line(error, *words)
    assert "spec_from_keywords" not in message


@pytest.mark.parametrize("prompt", [None, 5])
def test_a_prompt_that_is_neither_text_nor_ids(model, prompt):
    with pytest.raises(TypeError) as error:
        next(stream_generate(model, StubTokenizer(), prompt))
    one_line(error, "prompt must be a string or a sequence of token ids")


@pytest.mark.parametrize("prompt", [b"\x01\x05\t", bytearray(b"\x01\x05"), memoryview(b"\x01")])
def test_a_bytes_prompt_is_not_read_as_token_ids(model, prompt):
    """Bytes are a sequence of ints, which once went in as token ids."""
    from mlx_speculate.generation import Session
    from mlx_speculate.sampling import SamplingParams

    with pytest.raises(TypeError) as error:
        next(stream_generate(model, StubTokenizer(), prompt))
    one_line(error, "got " + type(prompt).__name__, "decode it to a str first")
    session = Session(model, StubTokenizer())
    with pytest.raises(TypeError) as error:
        next(session.stream(prompt, sampling=SamplingParams(), max_tokens=2))
    one_line(error, "decode it to a str first")


def test_edge_seeds_and_a_lone_stop_string_run(model):
    for seed in (0, 2**64 - 1):
        out = list(stream_generate(model, StubTokenizer(), PROMPT, max_tokens=3, seed=seed,
                                   temperature=0.8))
        assert len(out) == 3
    # A lone string is one stop string, not one per character.
    assert len(list(stream_generate(model, StubTokenizer(), PROMPT, max_tokens=3, stop="zz"))) == 3


def test_load_takes_a_dtype_by_name_and_lists_the_valid_ones(folder):
    model, _ = load(folder, dtype="float16")
    assert model.compute_dtype == mx.float16
    with pytest.raises(ValueError) as error:
        load(folder, dtype="fp16")
    one_line(error, "dtype must be one of float16, bfloat16, float32", "'fp16'")


# -- config.json ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"num_attention_heads": 0}, "'num_attention_heads' must be >= 1, got 0"),
        ({"num_attention_heads": 0, "head_dim": 16}, "'num_attention_heads' must be >= 1"),
        ({"hidden_size": 0}, "'hidden_size' must be >= 1, got 0"),
        ({"num_key_value_heads": 3}, "multiple of 'num_key_value_heads' (3)"),
        ({"num_attention_heads": 5, "num_key_value_heads": 5}, "give 'head_dim'"),
        ({"rope_theta": 0.0}, "'rope_theta' must be > 0, got 0.0"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "'rope_scaling.factor' must"),
        ({"partial_rotary_factor": 0}, "'partial_rotary_factor' must be in (0, 1]"),
        ({"model_type": ["llama"]}, "model_type ['llama'] is not supported"),
        ({"quantization": "q4"}, "'quantization' must be an object"),
        ({"quantization": {"group_size": 64, "bits": 4}}, "none is stored quantized"),
        ({"quantization": {"group_size": 7, "bits": 4}}, "'group_size' must be one of 32, 64"),
        ({"quantization": {"group_size": 64, "bits": 3}}, "none is stored quantized"),
        ({"quantization": {"group_size": 64, "bits": 4, "mode": "q"}}, "'mode' must be one of"),
        ({"quantization": {"bits": 4, "lm_head": 8}}, "override 'lm_head' must be an object"),
        ({"eos_token_id": "two"}, "'eos_token_id' must be a token id (0 to 96)"),
        ({"eos_token_id": [2, 97]}, "'eos_token_id' must be a token id"),
    ],
)
def test_config_claims_are_checked(folder, capsys, changes, words):
    rewrite_config(folder, **changes)
    with pytest.raises(ValueError) as error:
        load(folder)
    one_line(error, words)
    line = cli_error(capsys, ["--model", str(folder), "--prompt", "w1", "-m", "2"])
    assert words in line


def test_generation_config_eos_is_checked(folder):
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, None]}))
    with pytest.raises(ValueError) as error:
        load(folder)
    one_line(error, "generation_config.json field 'eos_token_id'")


@pytest.fixture
def quantized_weights():
    config = tiny_config()
    model = build_model(config, random_weights(config))
    nn.quantize(model, 32, 4)
    return config, dict(tree_flatten(model.parameters()))


@pytest.mark.parametrize(
    "quantization, words",
    [
        ({"group_size": 64, "bits": 4}, "not stored as 4-bit group 64"),
        ({"group_size": 32, "bits": 8}, "not stored as 8-bit group 32"),
        ({"group_size": 32, "bits": 4, "lm_head": {"group_size": 64, "bits": 4}}, "lm_head"),
        (None, "no 'quantization' block"),
    ],
)
def test_quantization_must_match_how_the_weights_are_stored(
    tmp_path, quantized_weights, quantization, words
):
    config, weights = quantized_weights
    if quantization is not None:
        config = config | {"quantization": quantization}
    with pytest.raises(ValueError) as error:
        load(write_folder(tmp_path / "q", config, weights))
    one_line(error, words)


def test_convert_refuses_a_quantization_string(folder, tmp_path, capsys):
    rewrite_config(folder, quantization="q4")
    line = cli_error(
        capsys, ["--hf-path", str(folder), "--mlx-path", str(tmp_path / "out")], convert_main
    )
    assert "'quantization' must be an object" in line
    assert not (tmp_path / "out").exists()


# -- chat templates ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "template, words",
    [
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
        ("{% if messages %}{{ messages[0]['content'] }}", "chat template failed"),
    ],
)
def test_a_failing_chat_template(folder, capsys, template, words):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    _, tokenizer = load(folder)
    with pytest.raises(ValueError) as error:
        apply_chat_template(tokenizer, "w1")
    one_line(error, "chat template failed", words)
    line = cli_error(capsys, ["--model", str(folder), "--prompt", "w1", "-m", "2"])
    assert words in line


def test_a_failing_chat_template_is_a_400_in_the_server(folder):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = "{{ raise_exception('roles must alternate') }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    with serve(*load(folder)) as running:
        body = {"model": "stories", "messages": [{"role": "user", "content": "w1"}]}
        response = httpx.post(f"{running.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "roles must alternate" in error["message"]


# -- the generate CLI's own flags ----------------------------------------------------------------


@pytest.mark.parametrize("seed", ["-1", str(2**70), "x"])
def test_cli_seed_outside_the_generator_range(capsys, seed):
    line = cli_error(capsys, ["--prompt", "w1", "--temp", "0.8", "--seed", seed])
    assert "argument --seed" in line
