"""GGUF files of llama.cpp's `gemma4` (Gemma 4 text): a tiny random transformers folder,
written as convert_hf_to_gguf.py's Gemma4Model writes it (the gguf package's tensor names,
per-layer head counts and MLP widths, the sliding pattern, both head sizes and RoPE bases,
`rope_freqs` for the proportional RoPE), reads back as the same model: the same parameters
and logits as our model of the folder. Kept quantized it converts into a 4-bit folder that
computes what the dequantized file does, here and in mlx-lm."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from mlx_speculate.convert import convert
from mlx_speculate.gguf import tokenizer as gguf_tokenizer
from mlx_speculate.gguf.reader import read_gguf
from mlx_speculate.loading import build_model, load, load_model

from .gemma4_models import SHARED, F, S
from .helpers import assert_float32_close, tiny_config
from .test_convert import relative_rms, save_tokenizer
from .test_gemma4 import save_gemma4
from .test_gguf_families import TOKENS, parameters

pytest.importorskip("torch")

Q = gguf.GGMLQuantizationType
VARIANTS = {
    # per-layer inputs, a quarter of each global head rotated (theta 1e6)
    "default": {},
    # layers 3 and 4 read earlier keys, with MLPs twice as wide; logits soft-capped
    "shared-kv": {**SHARED, "use_double_wide_mlp": True, "final_logit_softcapping": 5.0},
    # global layers take values from keys, one key/value head; half rotated, other bases
    "k-eq-v": {
        "num_hidden_layers": 4, "layer_types": [S, F, S, F], "attention_k_eq_v": True,
        "num_global_key_value_heads": 1, "hidden_size_per_layer_input": 0,
        "rope_parameters": {
            S: {"rope_type": "default", "rope_theta": 100.0},
            F: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 500.0},
        },
    },
}  # fmt: skip


def write_like_llama_cpp(
    path: Path, folder: Path, source: dict, quantize: bool = False, extra: dict | None = None
) -> None:
    """The folder as Gemma4Model writes it: F32, or with `quantize` its matrices whose rows
    split into blocks of 32 in Q4_0 (the embedding in Q8_0), norms and scales in F32.
    `source`: the config the folder was made from (as Google's config.json, it names
    `global_head_dim`, which transformers saves as `per_layer_config`); `extra`: more
    uint32 metadata."""
    config = {**json.loads((folder / "config.json").read_text()), **source}
    layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(path, "gemma4")
    _metadata(writer, config)
    for key, value in (extra or {}).items():
        writer.add_uint32(key, value)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, layers)
    for name, w in load_file(folder / "model.safetensors").items():
        if name.endswith("layer_scalar"):  # Gemma4Model.filter_tensors
            name += ".weight"
        name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        quantizable = w.ndim == 2 and w.shape[-1] % 32 == 0
        if quantize and quantizable and not name.endswith("norm.weight"):
            kind = Q.Q8_0 if name == "token_embd.weight" else Q.Q4_0
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    # generate_extra_tensors: 1 for each rotated global frequency, 1e30 for the others
    full = config["rope_parameters"]["full_attention"]
    rotated = int(config["global_head_dim"] * full["partial_rotary_factor"] / 2)
    freqs = [1.0] * rotated + [1e30] * (config["global_head_dim"] // 2 - rotated)
    writer.add_tensor("rope_freqs.weight", np.array(freqs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _metadata(writer: gguf.GGUFWriter, config: dict) -> None:
    # TextModel, then Gemma3Model, then Gemma4Model.set_gguf_parameters
    layers = config["num_hidden_layers"]
    rope = config["rope_parameters"]
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])
    shared = config.get("num_kv_shared_layers", 0)
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(config.get("hidden_size_per_layer_input") or 0)
    swa = [t == "sliding_attention" for t in config["layer_types"]]
    writer.add_sliding_window_pattern(swa)
    writer.add_key_length(config["global_head_dim"])
    writer.add_value_length(config["global_head_dim"])
    writer.add_key_length_swa(config["head_dim"])
    writer.add_value_length_swa(config["head_dim"])
    if config.get("use_double_wide_mlp"):
        ffn = config["intermediate_size"]
        widths = [ffn * (2 if i >= layers - shared else 1) for i in range(layers)]
        writer.add_feed_forward_length(widths)
    full_heads, heads = config.get("num_global_key_value_heads"), config["num_key_value_heads"]
    if full_heads is not None:
        writer.add_head_count_kv([heads if s else full_heads for s in swa])
    else:
        writer.add_head_count_kv(heads)
    writer.add_rope_dimension_count(config["global_head_dim"])
    partial = rope["sliding_attention"].get("partial_rotary_factor", 1.0)
    writer.add_rope_dimension_count_swa(int(config["head_dim"] * partial))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_file_reads_as_its_hf_folder(tmp_path: Path, name: str) -> None:
    folder = tmp_path / "hf"
    source = tiny_config("gemma4_text", **VARIANTS[name])
    save_gemma4(folder, source)
    write_like_llama_cpp(tmp_path / "m.gguf", folder, source)
    checkpoint = read_gguf(tmp_path / "m.gguf")
    assert checkpoint.config["model_type"] == "gemma4_text"
    hf = json.loads((folder / "config.json").read_text())
    for key in ("layer_types", "num_kv_shared_layers", "use_double_wide_mlp", "attention_k_eq_v"):
        assert checkpoint.config[key] == hf.get(key, source.get(key)), key
    full = checkpoint.config["rope_parameters"]["full_attention"]
    assert full["partial_rotary_factor"] == hf["rope_parameters"][F]["partial_rotary_factor"]

    ours, reference = build_model(checkpoint.config, checkpoint.weights), load_model(folder)[0]
    expected, got = parameters(reference), parameters(ours)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)
    assert_float32_close(ours(TOKENS).logits, reference(TOKENS).logits)


def test_quantized_file_converts_to_a_4bit_folder_mlx_lm_loads(tmp_path: Path, monkeypatch):
    import mlx_lm

    folder = tmp_path / "hf"
    config = tiny_config("gemma4_text", **VARIANTS["shared-kv"])
    save_gemma4(folder, config)
    src = tmp_path / "m.gguf"
    write_like_llama_cpp(src, folder, config, quantize=True)
    stand_in = SimpleNamespace(save=lambda out: save_tokenizer(out, config["vocab_size"]))
    monkeypatch.setattr(gguf_tokenizer, "read_gguf_tokenizer", lambda path: stand_in)
    dst = convert(src, tmp_path / "q", quantize=True, dtype="float32")

    written = json.loads((dst / "config.json").read_text())
    assert (written["quantization"]["bits"], written["quantization"]["group_size"]) == (4, 32)
    checkpoint = read_gguf(src)
    dequantized = build_model(checkpoint.config, checkpoint.weights)(TOKENS).logits
    ours = load(dst)[0](TOKENS).logits
    assert relative_rms(ours, dequantized) < 1e-5
    theirs = mlx_lm.load(str(dst))[0](TOKENS)
    assert relative_rms(theirs, ours) < 1e-5


def test_a_file_without_its_sliding_pattern_is_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    source = tiny_config("gemma4_text")
    save_gemma4(folder, source)
    write_like_llama_cpp(tmp_path / "m.gguf", folder, source)
    data = (tmp_path / "m.gguf").read_bytes()
    key = b"gemma4.attention.sliding_window_pattern"
    (tmp_path / "cut.gguf").write_bytes(data.replace(key, key.replace(b"pattern", b"xxxxxxx")))
    message = "GGUF metadata key 'gemma4.attention.sliding_window_pattern' is missing"
    with pytest.raises(ValueError, match=re.escape(message)):
        read_gguf(tmp_path / "cut.gguf")


def test_a_file_with_experts_is_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    source = tiny_config("gemma4_text")
    save_gemma4(folder, source)
    write_like_llama_cpp(tmp_path / "m.gguf", folder, source, extra={"gemma4.expert_count": 4})
    with pytest.raises(ValueError, match="Gemma 4 GGUF files with experts are not supported"):
        read_gguf(tmp_path / "m.gguf")
