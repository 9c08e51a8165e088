"""GGUF architectures: each one's HF model written as llama.cpp writes it (its tensor names from
the gguf package's own map, its metadata keys, Gemma's 1 + w norms, Phi-3's longrope factor
tensors) reads back as the same HF weights and a config that transformers builds the same
model from: equal logits, sliding windows and per-layer rope bases included."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest

from mlx_speculate.gguf.reader import read_gguf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
ARCHS = {
    # GGUF architecture: (HF config class, HF model class, config overrides)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_hidden_layers": 2}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"num_hidden_layers": 2}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"num_hidden_layers": 2}),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        # Six layers: five local (window 5) and one global, as llama.cpp's pattern has them.
        {
            "num_hidden_layers": 6,
            "sliding_window": 5,
            "query_pre_attn_scalar": 16,
            "tie_word_embeddings": True,
        },
    ),  # fmt: skip
}
LONGROPE = {
    "rope_scaling": {
        "type": "longrope",
        "long_factor": [1.0 + 0.25 * i for i in range(8)],
        "short_factor": [1.0 + 0.05 * i for i in range(8)],
    },
    "original_max_position_embeddings": 64,
}
TOKENS = [[1, 5, 9, 17, 33, 2, 65, 100, 7, 7, 9, 127, 4, 2, 80, 11, 3, 60]]


def hf_model(arch: str, **overrides):
    config_class, model_class, extra = ARCHS[arch]
    config = getattr(transformers, config_class)(**{**SMALL, **extra, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():  # norms away from their all-ones (or all-zeros) start
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    return model


def write_like_llama_cpp(path: Path, arch: str, model) -> dict[str, np.ndarray]:
    """The model as convert_hf_to_gguf.py writes it (F32); returns the HF state it holds."""
    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    if arch == "gemma3":
        writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
        writer.add_sliding_window(config.sliding_window)
    else:
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "longrope":
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        for kind in ("long", "short"):
            factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    for name, w in state.items():
        stored = w + 1 if arch == "gemma3" and name.endswith("norm.weight") else w
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


@pytest.mark.parametrize("arch", list(ARCHS))
def test_architecture_reads_back_as_its_hf_model(tmp_path: Path, arch: str) -> None:
    model = hf_model(arch, **(LONGROPE if arch == "phi3" else {}))
    state = write_like_llama_cpp(tmp_path / "m.gguf", arch, model)
    checkpoint = read_gguf(tmp_path / "m.gguf")
    assert checkpoint.config["architectures"] == [ARCHS[arch][1]]
    assert checkpoint.weights.keys() == state.keys()
    for name, w in state.items():
        ours = np.array(checkpoint.weights[name])
        if arch == "gemma3" and name.endswith("norm.weight"):
            np.testing.assert_allclose(ours, w, rtol=0, atol=2e-7, err_msg=name)  # (1 + w) - 1
        else:
            assert np.array_equal(ours, w), name
    config_class, model_class, _ = ARCHS[arch]
    config = getattr(transformers, config_class).from_dict(checkpoint.config)
    rebuilt = getattr(transformers, model_class)(config).float().eval()
    rebuilt.load_state_dict(
        {k: torch.from_numpy(np.array(v)) for k, v in checkpoint.weights.items()}, strict=False
    )
    if config.tie_word_embeddings:
        rebuilt.tie_weights()
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        expected, ours = model(tokens).logits, rebuilt(tokens).logits
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_gemma3_config(tmp_path: Path) -> None:
    write_like_llama_cpp(tmp_path / "m.gguf", "gemma3", hf_model("gemma3"))
    config = read_gguf(tmp_path / "m.gguf").config
    assert config["model_type"] == "gemma3_text"
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert (config["sliding_window"], config["query_pre_attn_scalar"]) == (5, 16)
    assert config["rope_parameters"] == {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    assert config["tie_word_embeddings"] is True
    assert config["hidden_activation"] == "gelu_pytorch_tanh"


def test_phi3_longrope_factors_go_into_the_config(tmp_path: Path) -> None:
    write_like_llama_cpp(tmp_path / "m.gguf", "phi3", hf_model("phi3", **LONGROPE))
    config = read_gguf(tmp_path / "m.gguf").config
    scaling = LONGROPE["rope_scaling"]
    assert config["rope_scaling"] == {
        "rope_type": "longrope",
        "long_factor": scaling["long_factor"],
        "short_factor": scaling["short_factor"],
    }
    assert config["original_max_position_embeddings"] == 64


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = "GGUF architecture 'mamba' is not supported (supported: llama, qwen2, qwen3, phi3, "
    message += "gemma3, qwen3moe, gpt-oss, qwen3next, qwen35, qwen35moe, gemma4)"
    with pytest.raises(ValueError, match=re.escape(message)):
        read_gguf(tmp_path / "m.gguf")
