"""GGUF files of the mixture-of-experts and hybrid families (llama.cpp's `qwen3moe`, `gpt-oss`,
`qwen3next`, `qwen35`, `qwen35moe`): a tiny random transformers folder, written as
llama.cpp's convert_hf_to_gguf.py writes it (its tensor names from the gguf package's map, its
metadata keys, stacked experts, and its changes to the weights: -exp(A_log), squeezed convs,
1 + w norms, Qwen3-Next's split q|k|v|z, Qwen3.5's tiled value heads, gpt-oss's split and
transposed experts), reads back as the same model: the same parameters and logits as our
model of the folder. Kept quantized (Q4_0 stacks and DeltaNet projections, reordered
quantized) it converts into a 4-bit folder that computes what the dequantized file does,
here and in mlx-lm."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from safetensors.numpy import load_file

from mlx_speculate.convert import convert
from mlx_speculate.gguf import tokenizer as gguf_tokenizer
from mlx_speculate.gguf.reader import read_gguf
from mlx_speculate.loading import build_model, load, load_model

from .families import save_hf
from .helpers import assert_float32_close, tiny_config
from .test_convert import relative_rms, save_tokenizer, stored

pytest.importorskip("torch")

Q = gguf.GGMLQuantizationType
HYBRID = {
    "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
    "full_attention_interval": 2, "head_dim": 16, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16, "linear_num_key_heads": 2,
    # Four value heads on two key heads: Qwen3.5's files tile them. 32 a head: the out
    # projection's quantized groups move whole when they are put back.
    "linear_value_head_dim": 32, "linear_num_value_heads": 4,
    # llama.cpp writes rope.dimension_count as head_dim * 0.25 for these families.
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
}  # fmt: skip
EXPERTS = {
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}  # fmt: skip
FAMILIES = {
    # GGUF architecture: its transformers config (tiny); Qwen3 MoE checkpoints renormalize.
    "qwen3moe": tiny_config("qwen3_moe", norm_topk_prob=True, moe_intermediate_size=32),
    "gpt-oss": tiny_config("gpt_oss"),
    # llama.cpp's qwen3next has no dense layers
    "qwen3next": tiny_config("qwen3_next", **HYBRID, **EXPERTS, mlp_only_layers=[]),
    "qwen35": tiny_config("qwen3_5_text", **HYBRID),
    "qwen35moe": tiny_config("qwen3_5_moe_text", **HYBRID, **EXPERTS),
}
HYBRIDS = ("qwen3next", "qwen35", "qwen35moe")
# What the config read from the file must say as the transformers config does.
SAME_CONFIG = {
    "qwen3moe": ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size"),
    "gpt-oss": (
        "num_local_experts", "num_experts_per_tok", "intermediate_size", "sliding_window",
        "layer_types",
    ),
    "qwen3next": (
        "layer_types", "linear_num_value_heads", "linear_value_head_dim", "num_experts",
        "shared_expert_intermediate_size",
    ),
    "qwen35": ("layer_types", "linear_num_key_heads", "linear_key_head_dim"),
    "qwen35moe": ("layer_types", "num_experts", "moe_intermediate_size"),
}  # fmt: skip
# mlx-lm's YaRN always truncates its ramp, gpt-oss's does not (test_gpt_oss.py): the folder
# compared with mlx-lm has plain RoPE. The YaRN read from the file is checked above it.
MLX_LM_COMPARABLE = {"gpt-oss": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}}
TOKENS = mx.array([[1, 5, 9, 17, 33, 2, 65, 90, 7, 7, 9, 41, 4, 2, 80, 11]])


def hf_folder(folder: Path, arch: str, **overrides) -> Path:
    save_hf(folder, {**FAMILIES[arch], **overrides})
    return folder


def write_like_llama_cpp(path: Path, arch: str, folder: Path, quantize: bool = False) -> None:
    """The folder as convert_hf_to_gguf.py writes it: F32, or with `quantize` its matrices
    (whose rows split into blocks of 32) in Q4_0, the embedding and output in Q8_0, and what
    llama.cpp keeps float (1-D, norms, routers, convs) in F32."""
    config = json.loads((folder / "config.json").read_text())
    layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(path, arch)
    _metadata(writer, arch, config)
    model_arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(model_arch, layers)
    for name, w in _tensors(arch, config, load_file(folder / "model.safetensors")):
        if not name.startswith("blk."):
            name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        quantizable = w.ndim >= 2 and w.shape[-1] % 32 == 0 and name.endswith(".weight")
        keep_float = name.endswith("_norm.weight") or "ffn_gate_inp" in name or "conv1d" in name
        if quantize and quantizable and not keep_float:
            kind = Q.Q8_0 if name in ("token_embd.weight", "output.weight") else Q.Q4_0
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _metadata(writer: gguf.GGUFWriter, arch: str, config: dict) -> None:
    # TextModel.set_gguf_parameters, then each family's own.
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    rope = config["rope_parameters"]
    if rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if "num_local_experts" in config or "num_experts" in config:
        writer.add_expert_count(config.get("num_local_experts", config.get("num_experts")))
        writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    if "moe_intermediate_size" in config:  # Qwen2MoeModel
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in config:
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if arch == "gpt-oss":
        writer.add_sliding_window(config["sliding_window"])
        writer.add_expert_feed_forward_length(config["intermediate_size"])
    if arch in HYBRIDS:  # Qwen3NextModel
        writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
        writer.add_ssm_state_size(config["linear_key_head_dim"])
        writer.add_ssm_group_count(config["linear_num_key_heads"])
        writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
        value_dim = config["linear_value_head_dim"] * config["linear_num_value_heads"]
        writer.add_ssm_inner_size(value_dim)
        writer.add_full_attention_interval(config["full_attention_interval"])
        writer.add_rope_dimension_count(int(config["head_dim"] * 0.25))


def _tensors(arch: str, config: dict, state: dict[str, np.ndarray]):
    """(name, tensor) as the converter yields them: HF names for the gguf map, or GGUF names."""
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, w in state.items():
        per_expert = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight", name)
        if per_expert is not None:  # Qwen2MoeModel stacks them, one tensor per projection
            experts.setdefault((per_expert[1], per_expert[3]), {})[int(per_expert[2])] = w
        elif arch == "gpt-oss":
            yield from _gpt_oss(name, w)
        elif arch in HYBRIDS:
            yield from _hybrid(arch, config, name, w)
        else:
            yield name, w
    for (prefix, projection), stack in experts.items():
        yield f"{prefix}.{projection}.weight", np.stack([stack[e] for e in sorted(stack)])


def _gpt_oss(name: str, w: np.ndarray):
    # GptOssModel.modify_tensors (float experts): sinks get .weight; gate_up split by columns.
    if "sinks" in name:
        yield f"{name}.weight", w
    elif name.endswith("down_proj_bias"):
        yield name.replace("down_proj_bias", "down_proj.bias"), w
    elif name.endswith("down_proj"):
        yield f"{name}.weight", w.swapaxes(-1, -2)
    elif name.endswith("gate_up_proj_bias"):
        yield name.replace("gate_up_proj_bias", "gate_proj.bias"), w[..., ::2]
        yield name.replace("gate_up_proj_bias", "up_proj.bias"), w[..., 1::2]
    elif name.endswith("gate_up_proj"):
        w = w.swapaxes(-1, -2)
        yield name.replace("gate_up_proj", "gate_proj.weight"), w[:, ::2, :]
        yield name.replace("gate_up_proj", "up_proj.weight"), w[:, 1::2, :]
    else:
        yield name, w


def _tile(w: np.ndarray, axis: int, nk: int, per: int, size: int) -> np.ndarray:
    # _LinearAttentionVReorderBase._reorder_v_heads: value heads grouped by key head -> tiled.
    w = np.moveaxis(w, axis, 0)
    tiled = w.reshape(nk, per, size, *w.shape[1:]).swapaxes(0, 1).reshape(w.shape)
    return np.moveaxis(tiled, 0, axis)


def _hybrid(arch: str, config: dict, name: str, w: np.ndarray):
    nk, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
    nv, dv = config["linear_num_value_heads"], config["linear_value_head_dim"]
    per = nv // nk
    if arch != "qwen3next" and ".linear_attn." in name:  # Qwen3.5: value heads tiled
        qk = 2 * nk * dk
        if ".in_proj_qkv." in name:
            w = np.concatenate([w[:qk], _tile(w[qk:], 0, nk, per, dv)])
        elif ".in_proj_z." in name:
            w = _tile(w, 0, nk, per, dv)
        elif ".in_proj_a." in name or ".in_proj_b." in name or name.endswith(("A_log", "dt_bias")):
            w = _tile(w, 0, nk, per, 1)
        elif ".conv1d." in name:
            w = w.squeeze()
            w = np.concatenate([w[:qk], _tile(w[qk:], 0, nk, per, dv)])
        elif ".out_proj." in name:
            w = _tile(w, 1, nk, per, dv)
    # Qwen3NextModel.modify_tensors
    if name.endswith(".A_log"):
        w = -np.exp(w)
    elif name.endswith(".dt_bias"):
        name = name.replace(".dt_bias", ".dt_proj.bias")
    elif "conv1d" in name:
        w = w.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        w = w + 1
    if "in_proj_qkvz.weight" in name:  # per key head [q, k, v, z] -> [all q, all k, all v], z
        block = name.split(".")[2]
        grouped = w.T.reshape(w.shape[1], nk, -1)
        q, k, v, z = np.split(grouped, [dk, 2 * dk, 2 * dk + per * dv], axis=-1)
        flat = [t.reshape(w.shape[1], -1) for t in (q, k, v, z)]
        yield f"blk.{block}.attn_qkv.weight", np.concatenate(flat[:3], axis=-1).T
        yield f"blk.{block}.attn_gate.weight", flat[3].T
    else:
        yield name, w


def parameters(model) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_file_reads_as_its_hf_folder(tmp_path: Path, arch: str) -> None:
    folder = hf_folder(tmp_path / "hf", arch)
    write_like_llama_cpp(tmp_path / "m.gguf", arch, folder)
    checkpoint = read_gguf(tmp_path / "m.gguf")
    hf_config = json.loads((folder / "config.json").read_text())
    assert checkpoint.config["model_type"] == hf_config["model_type"]
    for key in SAME_CONFIG[arch]:
        ours = checkpoint.config.get(key, checkpoint.config.get("num_experts"))
        assert ours == hf_config[key], key

    ours, reference = build_model(checkpoint.config, checkpoint.weights), load_model(folder)[0]
    expected = parameters(reference)
    got = parameters(ours)
    assert got.keys() == expected.keys()
    for name, value in expected.items():  # -exp then log, and 1 + w, round in float32
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
    assert_float32_close(ours(TOKENS).logits, reference(TOKENS).logits)


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_quantized_file_converts_to_a_4bit_folder_mlx_lm_loads(
    tmp_path: Path, monkeypatch, arch: str
) -> None:
    import mlx_lm

    folder = hf_folder(tmp_path / "hf", arch, **MLX_LM_COMPARABLE.get(arch, {}))
    src = tmp_path / "m.gguf"
    write_like_llama_cpp(src, arch, folder, quantize=True)
    vocab = FAMILIES[arch]["vocab_size"]
    stand_in = SimpleNamespace(save=lambda out: save_tokenizer(out, vocab))
    monkeypatch.setattr(gguf_tokenizer, "read_gguf_tokenizer", lambda path: stand_in)
    dst = convert(src, tmp_path / "q", quantize=True, dtype="float32")

    config = json.loads((dst / "config.json").read_text())
    assert (config["quantization"]["bits"], config["quantization"]["group_size"]) == (4, 32)
    # Qwen3.5 folders hold mlx-lm's `language_model.` prefix: names are matched by their end.
    scales = {k.removeprefix("language_model."): v for k, v in stored(dst).items()}
    experts = "mlp.experts" if arch == "gpt-oss" else "mlp.switch_mlp"
    if arch != "qwen35":
        assert scales[f"model.layers.0.{experts}.gate_proj.scales"].ndim == 3  # (E, rows, groups)
    if arch in HYBRIDS:  # reordered or regrouped, still quantized
        projection = "in_proj_qkvz" if arch == "qwen3next" else "in_proj_qkv"
        assert f"model.layers.0.linear_attn.{projection}.scales" in scales
        assert "model.layers.0.linear_attn.out_proj.scales" in scales

    # The file's own quantization, not a second rounding: what the dequantized file computes.
    checkpoint = read_gguf(src)
    dequantized = build_model(checkpoint.config, checkpoint.weights)(TOKENS).logits
    ours = load(dst)[0](TOKENS).logits
    assert relative_rms(ours, dequantized) < 1e-5
    theirs = mlx_lm.load(str(dst))[0](TOKENS)
    assert relative_rms(theirs, ours) < 1e-5


def test_a_hybrid_file_without_its_ssm_sizes_is_one_line(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path / "hf", "qwen35")
    write_like_llama_cpp(tmp_path / "m.gguf", "qwen35", folder)
    data = (tmp_path / "m.gguf").read_bytes()
    key = b"qwen35.ssm.time_step_rank"
    (tmp_path / "cut.gguf").write_bytes(data.replace(key, b"qwen35.ssm.time_step_xxxx"))
    message = "GGUF metadata key 'qwen35.ssm.time_step_rank' is missing"
    with pytest.raises(ValueError, match=re.escape(message)):
        read_gguf(tmp_path / "cut.gguf")


def test_moved_quantized_features_stay_exact_or_become_float() -> None:
    """Whole groups of 32 columns move with their scales (still quantized, same values); an
    order that splits groups, or parts of two widths stacked, come back as float32."""
    from mlx_speculate.gguf.tensors import Quantized, concat_rows, take_columns, take_rows

    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 128), dtype=np.float32)
    parts = mx.quantize(mx.array(w), group_size=32, bits=4)
    q = Quantized(*(np.array(p) for p in parts), bits=4, exact=True)
    groups = np.concatenate(
        [np.arange(64, 96), np.arange(0, 32), np.arange(96, 128), np.arange(32, 64)]
    )
    moved = take_columns(q, groups)
    assert isinstance(moved, Quantized)
    assert np.array_equal(moved.dequantize(), q.dequantize()[:, groups])
    split = np.roll(np.arange(128), 16)
    assert np.array_equal(take_columns(q, split), q.dequantize()[:, split])
    rows = take_rows(q, np.array([3, 1]))
    assert isinstance(rows, Quantized) and np.array_equal(rows.dequantize(), q.dequantize()[[3, 1]])

    eight = Quantized(*(np.array(p) for p in mx.quantize(mx.array(w), 32, 8)), 8, exact=True)
    stacked = concat_rows([q, eight])
    assert isinstance(stacked, np.ndarray)
    assert np.array_equal(stacked, np.concatenate([q.dequantize(), eight.dequantize()]))
    assert isinstance(concat_rows([q, q]), Quantized)
