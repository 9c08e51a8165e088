"""Loading: local folders, hub ids, sharded and quantized weights, EOS ids, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import huggingface_hub
import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlx_speculate import loading
from mlx_speculate.loading import build_model, load, load_model
from mlx_speculate.models.base import Origin

from .helpers import random_weights, tiny_config

TOKENS = mx.array([[1, 5, 9, 33, 2, 70, 96, 4]])
WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(94)]


def write_tokenizer(path: Path) -> None:
    """A 97-word WordLevel tokenizer with `</s>` (id 2) as its EOS token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def write_folder(
    path: Path, config: dict[str, Any], weights: dict[str, mx.array], tokenizer: bool = True
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    if tokenizer:
        write_tokenizer(path)
    return path


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A complete tiny llama folder."""
    config = tiny_config()
    return write_folder(tmp_path / "tiny", config, random_weights(config))


def reference_logits() -> mx.array:
    config = tiny_config()
    return build_model(config, random_weights(config))(TOKENS).logits


def no_download(*args, **kwargs):
    raise AssertionError("snapshot_download must not be called for a local folder")


def test_local_folder(folder, monkeypatch):
    """A local folder loads without touching the hub; logits equal the in-memory model."""
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_download)
    model, tokenizer = load(folder)
    assert mx.array_equal(model(TOKENS).logits, reference_logits())
    assert tokenizer.encode("w0 w1", add_special_tokens=False) == [3, 4]


def test_load_records_the_models_origin(folder):
    """`load` records the folder and the tokenizer on the model once (drafter specs read them);
    a model built from weights has neither."""
    model, tokenizer = load(folder)
    assert model.origin == Origin(folder, tokenizer)
    assert load_model(folder)[0].origin == Origin(folder, None)
    config = tiny_config()
    assert build_model(config, random_weights(config)).origin == Origin()


def test_local_folder_named_like_a_hub_id(folder, tmp_path, monkeypatch):
    """A relative `org/name` that exists locally is read from disk, not downloaded."""
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_download)
    (tmp_path / "org").mkdir()
    folder.rename(tmp_path / "org" / "name")
    monkeypatch.chdir(tmp_path)
    model, _ = load("org/name")
    assert mx.array_equal(model(TOKENS).logits, reference_logits())


def test_hub_id_is_downloaded(folder, monkeypatch):
    """A missing `org/name` goes through snapshot_download and loads what it returns."""
    calls = []

    def fake_download(repo_id, **kwargs):
        calls.append(repo_id)
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    model, _ = load("some-org/some.model-1")
    assert calls == ["some-org/some.model-1"]
    assert mx.array_equal(model(TOKENS).logits, reference_logits())


def test_hub_failure_is_a_clear_error(monkeypatch):
    """A hub id that cannot be fetched raises FileNotFoundError naming the id and the cause."""

    def offline(repo_id, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match=r"'some-org/missing'.*ConnectionError: no network"):
        load("some-org/missing")


def assert_one_line(error: pytest.ExceptionInfo, *needles: str) -> None:
    message = str(error.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message


def test_missing_folder(tmp_path):
    """A path that is neither a folder nor a hub id is a FileNotFoundError naming it."""
    with pytest.raises(FileNotFoundError) as error:
        load(tmp_path / "absent")
    assert_one_line(error, str(tmp_path / "absent"))


def test_folder_without_config(folder):
    """A folder without config.json is a FileNotFoundError naming the folder."""
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError) as error:
        load(folder)
    assert_one_line(error, "config.json", str(folder))


def test_invalid_config_json(folder):
    """A config.json that is not JSON is a ValueError naming the file."""
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError) as error:
        load(folder)
    assert_one_line(error, str(folder / "config.json"))


def test_config_without_a_required_size(folder):
    """A config.json lacking hidden_size is a ValueError naming the field."""
    config = tiny_config()
    del config["hidden_size"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        load(folder)
    assert_one_line(error, "hidden_size")


def test_unknown_model_type(folder):
    """A model_type neither this package nor mlx-lm knows is a ValueError naming it and the
    supported types; one that mlx-lm knows but cannot build from the config (gpt2 from a
    llama config) is one line from the mlx-lm path (models/mlx_lm_model.py)."""
    (folder / "config.json").write_text(json.dumps(tiny_config("no_such_family")))
    with pytest.raises(ValueError) as error:
        load(folder)
    assert_one_line(error, "'no_such_family' is not supported", "llama", "qwen2", "phi3")
    (folder / "config.json").write_text(json.dumps(tiny_config("gpt2")))
    with pytest.raises(ValueError) as error:
        load(folder)
    assert_one_line(error, "mlx-lm cannot load the gpt2 model")


def test_missing_weights(folder):
    """A folder without model*.safetensors is a FileNotFoundError naming the folder."""
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError) as error:
        load(folder)
    assert_one_line(error, "safetensors", str(folder))


def test_corrupt_safetensors(folder):
    """Garbage in model.safetensors is a ValueError naming the file."""
    (folder / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ValueError) as error:
        load(folder)
    assert_one_line(error, str(folder / "model.safetensors"))


def test_weights_of_another_shape(folder):
    """Weights from a larger intermediate_size are a ValueError naming the parameter and shapes."""
    weights = random_weights(tiny_config(intermediate_size=128))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(ValueError) as error:
        load(folder)
    assert_one_line(error, "model.layers.0.mlp.gate_proj.weight", "(96, 64)", "(128, 64)")


@pytest.mark.parametrize("change", ["missing", "extra"])
def test_missing_or_extra_weights(folder, change):
    """A missing or an unknown tensor is a one-line ValueError naming it."""
    weights = random_weights(tiny_config())
    name = "lm_head.weight" if change == "missing" else "model.extra.weight"
    if change == "missing":
        del weights[name]
    else:
        weights[name] = mx.zeros((3,))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(ValueError) as error:
        load(folder)
    assert_one_line(error, name)


def test_sharded_safetensors(tmp_path):
    """Weights split over two shards with an index load equal to a single file."""
    config = tiny_config()
    weights = random_weights(config)
    folder = write_folder(tmp_path / "sharded", config, {}, tokenizer=False)
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2]}
    shards["model-00002-of-00002.safetensors"] = names[1::2]
    weight_map = {}
    for file, shard in shards.items():
        mx.save_safetensors(str(folder / file), {n: weights[n] for n in shard})
        weight_map |= dict.fromkeys(shard, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    model, _ = load_model(folder)
    assert mx.array_equal(model(TOKENS).logits, reference_logits())


def test_quantized_folder(tmp_path):
    """An mlx-lm quantized folder (with per-module overrides) loads equal to the in-memory model."""
    config = tiny_config()
    quantization = {
        "group_size": 32,
        "bits": 4,
        "lm_head": {"group_size": 32, "bits": 8},
        "model.layers.0.mlp.down_proj": False,
    }
    model = build_model(config, random_weights(config))

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if not hasattr(module, "to_quantized") or path == "model.layers.0.mlp.down_proj":
            return False
        return {"group_size": 32, "bits": 8} if path == "lm_head" else True

    nn.quantize(model, 32, 4, class_predicate=predicate)
    assert model.lm_head.bits == 8 and model.model.layers[1].mlp.down_proj.bits == 4
    assert isinstance(model.model.layers[0].mlp.down_proj, nn.Linear)
    weights = dict(tree_flatten(model.parameters()))
    folder = write_folder(tmp_path / "q", config | {"quantization": quantization}, weights)

    loaded, _ = load(folder)
    assert isinstance(loaded.model.layers[0].mlp.down_proj, nn.Linear)
    assert loaded.lm_head.bits == 8 and loaded.model.embed_tokens.bits == 4
    assert mx.array_equal(loaded(TOKENS).logits, model(TOKENS).logits)


def test_eos_ids_from_config_generation_config_and_tokenizer(folder):
    """EOS ids are the union of config.json, generation_config.json and the tokenizer's."""
    config = tiny_config() | {"eos_token_id": 5}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    _, tokenizer = load(folder)
    assert tokenizer.eos_token_ids == {2, 5, 7}


# -- the compute dtype follows the device -------------------------------------------------------


@pytest.fixture
def bfloat16_quantized(tmp_path: Path) -> Path:
    """An mlx-community style folder: 4-bit weights with bfloat16 scales, bfloat16 norms."""
    config = tiny_config()
    model = build_model(config, random_weights(config))
    nn.quantize(model, 32, 4)
    weights = {
        k: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in tree_flatten(model.parameters())
    }
    quantization = {"group_size": 32, "bits": 4}
    return write_folder(tmp_path / "q", config | {"quantization": quantization}, weights)


def floating_dtypes(model: nn.Module) -> set[mx.Dtype]:
    return {v.dtype for _, v in tree_flatten(model.parameters()) if v.dtype != mx.uint32}


def test_cpu_loads_bfloat16_scales_as_float32(bfloat16_quantized):
    """On the CPU backend every floating tensor, quantization scales and biases included, is
    float32 by default (MLX's CPU bfloat16/float16 kernels are ~45x slower); dtype= overrides."""
    assert mx.default_device() == mx.cpu
    model, _ = load(bfloat16_quantized)
    assert floating_dtypes(model) == {mx.float32}
    assert model.compute_dtype == mx.float32
    assert model(TOKENS).logits.dtype == mx.float32
    explicit, _ = load(bfloat16_quantized, dtype=mx.float32)
    assert mx.array_equal(model(TOKENS).logits, explicit(TOKENS).logits)
    kept, _ = load(bfloat16_quantized, dtype=mx.bfloat16)
    assert floating_dtypes(kept) == {mx.bfloat16} and kept.compute_dtype == mx.bfloat16


def test_gpu_keeps_the_checkpoint_dtype(bfloat16_quantized, monkeypatch):
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    model, _ = load(bfloat16_quantized)
    assert floating_dtypes(model) == {mx.bfloat16}


# -- bad folders and paths ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value", [("hidden_size", "64"), ("rms_norm_eps", "1e-5"), ("vocab_size", 97.0)]
)
def test_config_value_of_the_wrong_type(folder, field, value):
    (folder / "config.json").write_text(json.dumps(tiny_config(**{field: value})))
    with pytest.raises(ValueError) as error:
        load(folder)
    assert_one_line(error, f"'{field}'", repr(value))


@pytest.mark.parametrize("content", ['{"model": {"type": "Nonsense"}}', "{not json", ""])
def test_corrupt_tokenizer_json(folder, content):
    (folder / "tokenizer.json").write_text(content)
    with pytest.raises(ValueError) as error:
        load(folder)
    assert_one_line(error, str(folder))


def test_folder_without_tokenizer_files_fails_before_the_weights(folder, monkeypatch):
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (folder / file).unlink()

    def weights_read(*args):
        raise AssertionError("the weights were read before the tokenizer was checked")

    monkeypatch.setattr(loading, "load_weights", weights_read)
    with pytest.raises(FileNotFoundError) as error:
        load(folder)
    assert_one_line(error, f"no tokenizer in {folder}", "tokenizer.json")
    assert "sentencepiece" not in str(error.value).lower()


def test_tokenizer_with_more_ids_than_the_embedding(tmp_path):
    """A tokenizer of 97 ids beside a 64-row embedding would index past it: refused at load."""
    config = tiny_config(vocab_size=64)
    folder = write_folder(tmp_path / "small", config, random_weights(config))
    with pytest.raises(ValueError) as error:
        load(folder)
    assert_one_line(error, "97 token ids", "vocabulary has 64")


@pytest.mark.parametrize("name", ["./nope", "../nope", "~/nope-mlx-speculate", "models/nope"])
def test_mistyped_paths_are_not_hub_ids(tmp_path, monkeypatch, name):
    """`models/nope` is a path when `models/` exists here; `.`, `..` and `~` start only paths."""
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_download)
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as error:
        load(name)
    assert_one_line(error, f"model path {name!r} does not exist")


def test_gguf_file_suggests_convert(tmp_path):
    gguf = tmp_path / "model.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError) as error:
        load(gguf)
    assert_one_line(
        error, "is a GGUF file", f"mlx_speculate.convert --hf-path {gguf} --mlx-path", " -q"
    )
