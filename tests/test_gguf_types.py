"""Every GGUF tensor type: read_gguf against the `gguf` package's own dequantization.

Hand-built files of random blocks (random bytes are valid blocks; blocks whose scales decode to
inf, NaN or values beyond 1e4, which no model holds, are drawn again). Dequantized, every type
equals the gguf package's values exactly. Kept (-q), the types MLX's affine quantization holds
come back bit for bit and the others within one quantization step of their group.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from mlx_speculate.gguf.reader import read_gguf
from mlx_speculate.gguf.tensors import (
    FLOAT_TYPES,
    KEPT_BITS,
    REQUANTIZED_BITS,
    SUPPORTED_TYPES,
    pack,
)

from .test_gguf import llama_cpp_permute

Q = gguf.GGMLQuantizationType
# K-quant blocks span 256 values: every row here is a multiple of 256 long.
HIDDEN, FFN, HEADS, KV_HEADS, VOCAB, LAYERS = 256, 512, 4, 2, 64, 2
HEAD_DIM = HIDDEN // HEADS


def random_blocks(kind: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, bytes per row) of random blocks of `kind` whose values are finite, |v| <= 1e4."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    n = rows * cols // block
    kept = np.empty((0, size), np.uint8)
    while len(kept) < n:
        draw = rng.integers(0, 256, (n, size), dtype=np.uint8)
        with np.errstate(all="ignore"):
            values = gguf.quants.dequantize(draw, kind)
            fit = (np.isfinite(values) & (np.abs(values) <= 1e4)).all(-1)
        kept = np.concatenate([kept, draw[fit]])
    return kept[:n].reshape(rows, -1)


def llama_tensors(kind: Q, rng: np.random.Generator) -> dict[str, tuple[np.ndarray, Q]]:
    """A tiny Llama's GGUF tensors: matrices in `kind`, norms F32."""
    shapes = {"token_embd": (VOCAB, HIDDEN), "output": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_q": (HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_output": (HIDDEN, HEADS * HEAD_DIM),
            f"blk.{i}.ffn_gate": (FFN, HIDDEN),
            f"blk.{i}.ffn_up": (FFN, HIDDEN),
            f"blk.{i}.ffn_down": (HIDDEN, FFN),
        }
    tensors = {f"{n}.weight": (random_blocks(kind, *s, rng), kind) for n, s in shapes.items()}
    norms = ["output_norm"] + [
        f"blk.{i}.{n}" for i in range(LAYERS) for n in ("attn_norm", "ffn_norm")
    ]
    for n in norms:
        tensors[f"{n}.weight"] = (rng.standard_normal(HIDDEN, dtype=np.float32), Q.F32)
    return tensors


def write_llama(path: Path, tensors: dict[str, tuple[np.ndarray, Q]]) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hf_rows(name: str, w: np.ndarray) -> np.ndarray:
    """The GGUF's row order for an HF tensor (read_gguf undoes llama.cpp's Q/K permutation)."""
    if name.endswith("q_proj.weight"):
        return llama_cpp_permute(w, HEADS)
    if name.endswith("k_proj.weight"):
        return llama_cpp_permute(w, KV_HEADS)
    return w


GGUF_NAMES = {
    "model.embed_tokens": "token_embd", "lm_head": "output", "model.norm": "output_norm",
}  # fmt: skip
LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def gguf_name(module: str) -> str:
    if module in GGUF_NAMES:
        return f"{GGUF_NAMES[module]}.weight"
    _, _, i, rest = module.split(".", 3)
    return f"blk.{i}.{LAYER[rest]}.weight"


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_is_mlx_layout(bits: int) -> None:
    q = np.random.default_rng(bits).integers(0, 2**bits, (3, 128), dtype=np.uint8)
    ones, zeros = mx.ones((3, 4)), mx.zeros((3, 4))
    w = mx.dequantize(mx.array(pack(q, bits)), ones, zeros, group_size=32, bits=bits)
    assert np.array_equal(np.array(w), q)


def test_every_type_the_gguf_package_dequantizes_is_supported() -> None:
    for kind in Q:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        try:
            gguf.quants.dequantize(np.zeros((1, size * (256 // block or 1)), np.uint8), kind)
        except NotImplementedError:
            assert kind not in SUPPORTED_TYPES, kind.name
        else:
            assert kind in SUPPORTED_TYPES, kind.name


@pytest.mark.parametrize("kind", SUPPORTED_TYPES, ids=lambda k: k.name)
def test_type_matches_gguf_dequantization(tmp_path: Path, kind: Q) -> None:
    tensors = llama_tensors(kind, np.random.default_rng(int(kind)))
    write_llama(tmp_path / "m.gguf", tensors)
    reference = {n: gguf.quants.dequantize(d, k) for n, (d, k) in tensors.items()}
    dequantized = read_gguf(tmp_path / "m.gguf")
    assert dequantized.quantization is None
    for name, w in dequantized.weights.items():
        ours = hf_rows(name, np.array(w))
        assert ours.dtype == np.float32
        assert np.array_equal(ours, reference[gguf_name(name.removesuffix(".weight"))]), name

    kept = read_gguf(tmp_path / "m.gguf", keep_quantization=True)
    assert kept.config == dequantized.config
    if kind in FLOAT_TYPES:
        assert kept.quantization is None and kept.weights.keys() == dequantized.weights.keys()
        assert kept.types == {kind.name: "float", "F32": "float"}
        return
    bits = {**KEPT_BITS, **REQUANTIZED_BITS}[kind]
    assert kept.quantization == {"group_size": 32, "bits": bits, "mode": "affine"}
    exact = kind in KEPT_BITS
    assert kept.types == {
        kind.name: "kept" if exact else f"requantized ({bits}-bit)",
        "F32": "float",
    }
    for name in dequantized.weights:
        module = name.removesuffix(".weight")
        ref = reference[gguf_name(module)]
        if ref.ndim == 1:  # norms stay float
            assert np.array_equal(np.array(kept.weights[name]), ref)
            continue
        packed, scales, biases = (
            kept.weights[f"{module}.{p}"] for p in ("weight", "scales", "biases")
        )
        assert packed.dtype == mx.uint32 and packed.shape == (
            ref.shape[0],
            ref.shape[1] * bits // 32,
        )
        ours = mx.dequantize(
            packed, scales.astype(mx.float32), biases.astype(mx.float32), group_size=32, bits=bits
        )
        ours = hf_rows(name, np.array(ours))
        if exact:
            assert np.array_equal(ours, ref), name
            continue
        # MLX's affine quantizer snaps its range to hold 0: within one step of the group.
        step = hf_rows(name, np.abs(np.array(scales.astype(mx.float32))))
        err = np.abs(ours - ref).reshape(*step.shape, 32).max(-1)
        assert (err <= step * (1 + 1e-5) + 1e-30).all(), name
        assert not np.array_equal(ours, ref), name  # really quantized again


def test_k_quant_scales_are_float32_and_legacy_scales_float16(tmp_path: Path) -> None:
    # d * sc of Q4_K is exact in float32, not in float16; Q8_0's d is a float16 in the file.
    for kind, dtype in ((Q.Q4_K, mx.float32), (Q.Q8_0, mx.float16)):
        rng = np.random.default_rng(0)
        tensors = {n: (d, k) for n, (d, k) in llama_tensors(Q.F32, rng).items()}
        tensors["token_embd.weight"] = (random_blocks(kind, VOCAB, HIDDEN, rng), kind)
        write_llama(tmp_path / f"{kind.name}.gguf", tensors)
        kept = read_gguf(tmp_path / f"{kind.name}.gguf", keep_quantization=True)
        assert kept.weights["model.embed_tokens.scales"].dtype == dtype


def test_mixed_file_is_quantized_per_module(tmp_path: Path) -> None:
    # As in a Q4_K_M file: Q4_K mostly, Q6_K for some down projections, Q8_0 and Q5_0 elsewhere.
    rng = np.random.default_rng(1)
    tensors = llama_tensors(Q.Q4_K, rng)
    for name, kind in (
        ("blk.0.ffn_down.weight", Q.Q6_K),
        ("blk.1.attn_v.weight", Q.Q8_0),
        ("token_embd.weight", Q.Q5_0),
    ):
        rows = tensors[name][0].shape[0]
        cols = FFN if "ffn_down" in name else HIDDEN
        tensors[name] = (random_blocks(kind, rows, cols, rng), kind)
    write_llama(tmp_path / "m.gguf", tensors)
    kept = read_gguf(tmp_path / "m.gguf", keep_quantization=True)
    assert kept.quantization == {
        "group_size": 32, "bits": 4, "mode": "affine",
        "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 6, "mode": "affine"},
        "model.layers.1.self_attn.v_proj": {"group_size": 32, "bits": 8, "mode": "affine"},
        "model.embed_tokens": {"group_size": 32, "bits": 5, "mode": "affine"},
    }  # fmt: skip
    assert kept.types == {
        "Q5_0": "kept", "F32": "float", "Q4_K": "kept", "Q8_0": "kept",
        "Q6_K": "requantized (6-bit)",
    }  # fmt: skip
