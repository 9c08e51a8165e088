"""Qwen3-MoE: transformers' logits on folders it saved (per-expert tensors stacked at load),
routing per row, tree verification, every method lossless, 4-bit conversion mlx-lm loads."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mlx_speculate.loading import build_model, load_model

from .families import (
    check_cached_parity,
    check_convert_loads_in_mlx_lm,
    check_greedy_methods,
    check_prompt_parity,
    check_sampled_marginal,
    check_tree,
    related_draft,
    save_hf,
)
from .helpers import random_weights, tiny_config, tiny_model

pytest.importorskip("torch")

VARIANTS = {
    "plain": {},
    "norm-topk": {"norm_topk_prob": True},
    # Layer 0 dense by `mlp_only_layers`, layer 1 dense by `decoder_sparse_step` 2 (so is 0).
    "dense-layers": {"mlp_only_layers": [0], "num_hidden_layers": 3, "decoder_sparse_step": 2},
    "tied": {"tie_word_embeddings": True, "num_experts_per_tok": 1},
    # Every layer slides over 5 tokens; the prompts run past the window.
    "window": {"use_sliding_window": True, "sliding_window": 5},
    "yarn": {
        "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },  # fmt: skip
}
TARGET_SEED = 1  # its greedy continuations keep a clear top-2 margin (asserted)
DEEP = {"num_hidden_layers": 3}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_transformers(tmp_path, name):
    """Prompt forward (logits, hidden, taps) and cached one-token steps, on the folder
    transformers' save_pretrained wrote (one tensor per expert, `num_local_experts`)."""
    config = tiny_config("qwen3_moe", **VARIANTS[name])
    ref = save_hf(tmp_path, config)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "num_local_experts" in saved and "num_experts" not in saved
    check_prompt_parity(tmp_path, ref, 12)
    check_cached_parity(tmp_path, ref, 12, 7)


def test_missing_keys_take_transformers_defaults(tmp_path):
    """Only the sizes given: head_dim is hidden / heads (Qwen3MoeConfig has no 128 default),
    and the MoE fields take transformers' defaults (128 experts, 8 a token)."""
    config = {"model_type": "qwen3_moe", "vocab_size": 97, "hidden_size": 64}
    config |= {"num_hidden_layers": 2, "intermediate_size": 96, "num_attention_heads": 4}
    config |= {"num_key_value_heads": 2, "moe_intermediate_size": 16}
    ref = save_hf(tmp_path, config)
    model = load_model(tmp_path)[0]
    assert model.args.head_dim == 16 and model.args.num_experts == 128
    check_prompt_parity(tmp_path, ref, 10)


def test_each_row_routes_on_its_own():
    """A forward over many rows gives each row what a one-row forward gives it: the rows of
    a verified draft pick their experts independently."""
    model = tiny_model("qwen3_moe", seed=TARGET_SEED)
    tokens = mx.array([[1, 5, 9, 33, 7, 2, 60, 11, 40, 3]])
    whole = model(tokens, model.make_cache()).logits[0]
    cache = model.make_cache()
    rows = [model(tokens[:, i : i + 1], cache).logits[0, 0] for i in range(tokens.shape[1])]
    assert mx.allclose(whole, mx.stack(rows), rtol=1e-4, atol=1e-5).item()
    gates = model.layers[0].mlp.gate(model.model.embed_tokens(tokens))
    assert len({tuple(sorted(r)) for r in mx.argsort(gates, axis=-1)[0, :, -2:].tolist()}) > 1


def test_missing_expert_is_one_line_error():
    config = tiny_config("qwen3_moe")
    weights = random_weights(config)
    stacked = weights.pop("model.layers.1.mlp.switch_mlp.up_proj.weight")
    for e in range(3):  # the config says 4
        weights[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] = stacked[e]
    with pytest.raises(ValueError, match="no model.layers.1.mlp.experts.3.up_proj.weight"):
        build_model(config, weights)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"num_experts_per_tok": 5}, "'num_experts_per_tok' must be in 1..num_experts"),
        ({"decoder_sparse_step": 0}, "'decoder_sparse_step' must be >= 1"),
    ],
)
def test_configs_it_cannot_run_are_one_line_errors(overrides, needle):
    with pytest.raises(ValueError, match=needle) as error:
        build_model(tiny_config("qwen3_moe", **overrides), random_weights(tiny_config("qwen3_moe")))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("overrides", [{}, {"use_sliding_window": True, "sliding_window": 6}])
def test_tree_forward_equals_path_forwards(overrides):
    check_tree(tiny_model("qwen3_moe", seed=3, **overrides))


def test_every_method_is_lossless():
    target = tiny_model("qwen3_moe", seed=TARGET_SEED, **DEEP)
    check_greedy_methods(target, related_draft("qwen3_moe", TARGET_SEED, 7, **DEEP))


def test_sampling_follows_the_target():
    target = tiny_model("qwen3_moe", seed=TARGET_SEED, vocab_size=16)
    check_sampled_marginal(target, related_draft("qwen3_moe", TARGET_SEED, 7, vocab_size=16))


def test_convert_4bit_loads_here_and_in_mlx_lm(tmp_path):
    config = tiny_config("qwen3_moe", vocab_size=128)
    save_hf(tmp_path / "hf", config, seed=2)
    dst = check_convert_loads_in_mlx_lm(tmp_path / "hf", tmp_path / "mlx", 128)
    weights = mx.load(str(dst / "model.safetensors"))
    assert weights["model.layers.0.mlp.switch_mlp.gate_proj.weight"].shape[0] == 4  # stacked
    assert weights["model.layers.0.mlp.switch_mlp.gate_proj.weight"].dtype == mx.uint32


def test_loading_stacks_experts_without_a_second_copy(tmp_path):
    """Loading a per-expert checkpoint peaks near one copy of the weights, not two: each
    per-expert tensor is read once, into its stack, and then dropped."""
    config = tiny_config("qwen3_moe", num_experts=64, moe_intermediate_size=256, vocab_size=32)
    save_hf(tmp_path, config)
    size = sum(v.nbytes for v in mx.load(str(tmp_path / "model.safetensors")).values())
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    model = load_model(tmp_path)[0]
    peak = mx.get_peak_memory() - before
    assert model.layers[0].mlp.switch_mlp.down_proj.weight.shape == (64, 64, 256)
    assert peak < 1.3 * size, (peak, size)  # a second copy would be 2x
