"""Fuzzing what users hand over: config.json fields (through `load`, as the CLIs do) and the
sampling arguments of `stream_generate`. Every input either runs or is refused with a one-line
ValueError/TypeError; never another exception, a hang or a crash. Bounded: few examples, tiny
models, short generations."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_speculate.generation import generate, stream_generate
from mlx_speculate.loading import load

from .helpers import random_weights, tiny_config, tiny_model
from .markov import StubTokenizer
from .test_loading import write_folder

FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,  # the same examples on every run: CI never meets a new one by chance
)

# Any JSON value a hand-edited config.json might hold.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 300)
    | st.sampled_from([2**31, 2**63, -(2**40)])
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6,
)
# Values near the ones that make sense, where the interesting mistakes are.
plausible = {
    "hidden_size": st.sampled_from([0, 1, 32, 64, 65, 128]),
    "num_hidden_layers": st.sampled_from([0, 1, 2, 3, 50]),
    "intermediate_size": st.sampled_from([0, 1, 96, 97]),
    "num_attention_heads": st.sampled_from([0, 1, 2, 3, 4, 8, 64]),
    "num_key_value_heads": st.sampled_from([0, 1, 2, 3, 4]),
    "head_dim": st.sampled_from([0, 1, 8, 16, 17]),
    "vocab_size": st.sampled_from([0, 1, 96, 97, 98]),
    "max_position_embeddings": st.sampled_from([0, 1, 4, 256]),
    "rms_norm_eps": st.sampled_from([0.0, -1.0, 1e-5, 1e30]),
    "rope_theta": st.sampled_from([0.0, -1.0, 1.0, 1e4]),
    "partial_rotary_factor": st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0]),
    "tie_word_embeddings": st.booleans(),
    "eos_token_id": st.sampled_from([2, [2, 3], -1, 97, "two", None, [None]]),
    "quantization": st.sampled_from(
        ["q4", 4, {}, {"group_size": 64, "bits": 4}, {"group_size": 7}, {"bits": 3},
         {"mode": "nvfp4"}, {"lm_head": {"bits": 8}}]
    ),
    "rope_scaling": st.sampled_from(
        [{"rope_type": "linear", "factor": 2.0}, {"rope_type": "linear", "factor": 0.0},
         {"rope_type": "dynamic"}, {"rope_type": "llama3", "factor": -1}, {"type": "nope"}]
    ),
    "sliding_window": st.sampled_from([0, 1, 4, -2]),
    "model_type": st.sampled_from(["llama", "qwen2", "phi3", "gpt2", 3]),
}
FIELDS = sorted(plausible)


@st.composite
def config_changes(draw) -> dict:
    names = draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True))
    return {name: draw(plausible[name] | json_values) for name in names}


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory) -> Path:
    config = tiny_config()
    return write_folder(tmp_path_factory.mktemp("fuzz") / "tiny", config, random_weights(config))


def one_line_refusal(error: Exception) -> None:
    message = str(error)
    assert message and "\n" not in message.strip(), repr(message)


@FUZZ
@given(changes=config_changes())
def test_config_fields_run_or_are_refused_in_one_line(base_folder, changes):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        shutil.copytree(base_folder, folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | changes))
        try:
            model, tokenizer = load(folder)
            generate(model, tokenizer, [1, 5, 9], max_tokens=3)
        except ValueError as e:  # what the CLIs print as one line, exit 2
            one_line_refusal(e)


sampling_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.sampled_from([2**64 - 1, 2**64, 2**70, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.lists(st.one_of(st.none(), st.text(max_size=2), st.integers(0, 3)), max_size=2),
)
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop")


@st.composite
def sampling_arguments(draw) -> dict:
    names = draw(st.lists(st.sampled_from(SAMPLING), min_size=1, max_size=4, unique=True))
    arguments = {name: draw(sampling_values) for name in names}
    max_tokens = arguments.setdefault("max_tokens", 8)
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        arguments["max_tokens"] = min(max_tokens, 8)  # bounded; below 1 still checked
    return arguments


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", max_position_embeddings=64)


@FUZZ
@given(arguments=sampling_arguments())
def test_sampling_arguments_run_or_are_refused_in_one_line(model, arguments):
    try:
        responses = list(stream_generate(model, StubTokenizer(), [1, 5, 9], **arguments))
    except (ValueError, TypeError) as e:
        one_line_refusal(e)
        return
    assert 1 <= len(responses) <= 8
    assert all(math.isfinite(r.generation_tps) for r in responses)
