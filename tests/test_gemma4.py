"""Gemma 4: transformers' logits on folders it saved (text and multimodal layouts, per-layer
inputs, KV sharing, values from keys, experts beside the MLP, proportional RoPE, global layers
of another shape), tree verification, every method lossless, 4-bit conversion mlx-lm loads."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_speculate.cache import RING_ROWS
from mlx_speculate.loading import build_model, load_model

from .families import (
    check_cached_parity,
    check_convert_loads_in_mlx_lm,
    check_greedy_methods,
    check_prompt_parity,
    check_sampled_marginal,
    check_tree,
    randomize,
    save_hf,
)
from .gemma4_models import (
    DEEP,
    MOE,
    SCALES,
    SHARED,
    TARGET_SEED,
    F,
    S,
    related_gemma4,
    tiny_gemma4,
)
from .helpers import random_weights, tiny_config
from .test_models import assert_close

pytest.importorskip("torch")

VARIANTS = {
    # transformers' default rope: proportional (a quarter rotated, theta 1e6) on global layers.
    "default": {},
    "shared-kv": {**SHARED, "use_double_wide_mlp": True},
    "k-eq-v": {
        "num_hidden_layers": 4, "layer_types": [S, F, S, F], "attention_k_eq_v": True,
        "num_global_key_value_heads": 1,
        "rope_parameters": {
            S: {"rope_type": "default", "rope_theta": 100.0},
            F: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 100.0,
                "factor": 2.0},
        },
    },
    "moe-softcap": {**MOE, "final_logit_softcapping": 5.0},
    "plain-biased": {
        "hidden_size_per_layer_input": 0, "attention_bias": True, "tie_word_embeddings": True,
    },
}  # fmt: skip
def save_gemma4(folder, config, seed: int = 0):
    """save_hf, with each layer's output scale (a buffer transformers leaves at 1) random
    too, so that the parity covers it."""
    import torch

    ref = save_hf(folder, config, seed, SCALES)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=generator, dtype=torch.float64))
    ref.float().save_pretrained(folder)
    return ref.double()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_transformers(tmp_path, name):
    """Prompt forward (logits, hidden, taps) and cached one-token steps past the window of 6,
    on the folder transformers' save_pretrained wrote (its `per_layer_config`)."""
    config = tiny_config("gemma4_text", **VARIANTS[name])
    ref = save_gemma4(tmp_path, config)
    assert "per_layer_config" in json.loads((tmp_path / "config.json").read_text())
    layers = ref.config.num_hidden_layers
    check_prompt_parity(tmp_path, ref, 14, taps=(0, layers // 2, layers - 1))
    check_cached_parity(tmp_path, ref, 14, 8)


def test_global_shapes_from_their_config_fields(tmp_path):
    """Configs as Google and mlx-community write them (`global_head_dim` and
    `num_global_key_value_heads`, no `per_layer_config`) give the global layers the same
    shapes: the same logits."""
    ref = save_gemma4(tmp_path, tiny_config("gemma4_text", **VARIANTS["k-eq-v"]))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config.pop("per_layer_config") == {
        "1": {"head_dim": 32, "num_key_value_heads": 1},
        "3": {"head_dim": 32, "num_key_value_heads": 1},
    }
    config |= {"global_head_dim": 32, "num_global_key_value_heads": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(tmp_path)[0]
    assert [a.self_attn.head_dim for a in model.layers] == [16, 32, 16, 32]
    assert [a.self_attn.n_kv_heads for a in model.layers] == [2, 1, 2, 1]
    check_prompt_parity(tmp_path, ref, 10)


def test_multimodal_folder_matches_transformers(tmp_path):
    """A `gemma4` folder (Gemma4ForConditionalGeneration, no vision or audio tower): its
    language model under `model.language_model.`, its config in `text_config`."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = {k: v for k, v in tiny_config("gemma4_text", **MOE).items() if k != "model_type"}
    text |= {"pad_token_id": 0, "eos_token_id": None, "bos_token_id": None}  # pad: for images
    config = Gemma4Config(
        text_config=text, vision_config=None, audio_config=None,
        attn_implementation="eager", experts_implementation="eager",  # float64 takes these
    )  # fmt: skip
    ref = Gemma4ForConditionalGeneration(config).float().eval()
    randomize(ref, 0, SCALES)
    ref.save_pretrained(tmp_path)
    model = load_model(tmp_path)[0]
    tokens = np.random.default_rng(0).integers(0, 97, (1, 12))
    with torch.no_grad():
        expected = ref.double()(torch.from_numpy(tokens)).logits
    assert_close(model(mx.array(tokens)).logits, expected)


def test_features_matter(tmp_path):
    """The parity above has teeth: without the per-layer inputs, the layer scales, the
    sharing (a reading layer given another's keys) or the window, the logits move far
    beyond its tolerance."""
    save_gemma4(tmp_path, tiny_config("gemma4_text", **SHARED))
    tokens = mx.array(np.random.default_rng(0).integers(0, 97, (1, 14)))
    logits = load_model(tmp_path)[0](tokens).logits

    def moved(change) -> float:
        model = load_model(tmp_path)[0]
        change(model)
        return mx.abs(model(tokens).logits - logits).max().item()

    def no_layer_inputs(model):
        for layer in model.layers:
            layer.per_layer_projection.weight = mx.zeros_like(layer.per_layer_projection.weight)

    def unit_scales(model):
        for layer in model.layers:
            layer.layer_scalar = mx.ones_like(layer.layer_scalar)

    def other_source(model):
        model.layers[0].self_attn.stores = True
        model.layers[3].self_attn.reads = 0  # sliding layer 0's keys, not layer 2's

    def no_window(model):
        model.model._sliding = (False,) * 5

    for change in (no_layer_inputs, unit_scales, other_source, no_window):
        assert moved(change) > 1e-2, change.__name__


def test_cache_holds_only_the_layers_that_write():
    """Shared layers have no cache layer; global layers' cache layers take their shape; the
    sliding ones are rings of the window and RING_ROWS slots."""
    model = tiny_gemma4(0, **DEEP)
    cache = model.make_cache()
    cache.reserve(4)
    ring = model.args.sliding_window + RING_ROWS
    assert [k.shape for k in cache.keys] == [(1, 2, ring, 16), (1, 1, 256, 32), (1, 2, ring, 16)]
    model(mx.array([[1, 2, 3]]), cache)
    assert cache.offset == 3 and len(cache.state) == 6


def test_pipeline_split_keeps_sharing_layers_with_their_source():
    """A pipeline block whose layers read keys another block holds is refused in one line;
    one that keeps them together is taken."""
    from mlx_speculate.models.stage import WHOLE

    model = tiny_gemma4(0, **SHARED)
    with pytest.raises(ValueError, match="layer 3 reads layer 2's keys") as error:
        model.model.keep(WHOLE, slice(3, 5))
    assert "\n" not in str(error.value)
    model.model.keep(WHOLE, slice(0, 5))


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"layer_types": [S]}, "layer_types names 1 layers, the model has 2"),
        ({"vocab_size_per_layer_input": 50}, "ids past it have no per-layer input"),
        ({"num_kv_shared_layers": 2}, "'num_kv_shared_layers' must be in 0..1"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
        ({"use_bidirectional_attention": "all"}, "is not a causal LM"),
        ({"enable_moe_block": True}, "'num_experts' must be an int with enable_moe_block"),
        ({**MOE, "top_k_experts": 5}, "'top_k_experts' must be in 1..num_experts"),
        (
            {"num_hidden_layers": 3, "layer_types": [S, F, F], "num_kv_shared_layers": 2},
            r"layer 1 \(full_attention\) shares keys with no earlier layer",
        ),
        ({"per_layer_config": {"1": {"intermediate_size": 8}}}, "Gemma 4 layers may set"),
        ({"per_layer_config": {"1": {"head_dim": "32"}}}, "layer 1 would have 2 key/value"),
        (
            {"attention_k_eq_v": True, "num_global_key_value_heads": 3},
            r"heads dividing num_attention_heads \(4\)",
        ),
        ({"rope_parameters": {"rope_type": "default"}}, "must be nested by layer type"),
    ],
)
def test_configs_it_cannot_run_are_one_line_errors(overrides, needle):
    config = tiny_config("gemma4_text", **overrides)
    with pytest.raises(ValueError, match=needle) as error:
        build_model(config, random_weights(tiny_config("gemma4_text")))
    assert "\n" not in str(error.value)


def test_tree_forward_equals_path_forwards():
    """Window 6 < prefix 9 + tree depth; sharing layers read the tree's keys too."""
    check_tree(tiny_gemma4(3, **DEEP))


def test_every_method_is_lossless():
    target = tiny_gemma4(TARGET_SEED, **DEEP)
    check_greedy_methods(target, related_gemma4(TARGET_SEED, 7, **DEEP))


def test_sampling_follows_the_target():
    small = {**DEEP, "vocab_size": 16, "vocab_size_per_layer_input": 16}
    target = tiny_gemma4(TARGET_SEED, **small)
    check_sampled_marginal(target, related_gemma4(TARGET_SEED, 7, **small))


@pytest.mark.parametrize("layout", ["gemma4_text", "gemma4"])
def test_convert_4bit_loads_here_and_in_mlx_lm(tmp_path, layout):
    """mlx-lm reads what we write: the global shapes as `global_head_dim` and
    `num_global_key_value_heads`, the fields it defaults otherwise (soft cap, shared layers,
    double-wide MLP), experts under its names; a `gemma4` folder's language model under
    `language_model.` with the top-level vocabulary size."""
    config = tiny_config("gemma4_text", **{**DEEP, "vocab_size": 128,
                                           "vocab_size_per_layer_input": 128})  # fmt: skip
    save_gemma4(tmp_path / "hf", config, seed=2)
    if layout == "gemma4":  # the same weights in the multimodal wrapper's layout
        from safetensors.numpy import load_file, save_file

        hf = tmp_path / "hf"
        saved = json.loads((hf / "config.json").read_text())
        text = {k: v for k, v in saved.items() if k not in ("architectures", "model_type")}
        wrapper = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
                   "text_config": {**text, "model_type": "gemma4_text"}}  # fmt: skip
        (hf / "config.json").write_text(json.dumps(wrapper))
        tensors = load_file(hf / "model.safetensors")
        renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
        save_file(renamed, hf / "model.safetensors", metadata={"format": "pt"})
    dst = check_convert_loads_in_mlx_lm(tmp_path / "hf", tmp_path / "mlx", 128)
    written = json.loads((dst / "config.json").read_text())
    text = written["text_config"] if layout == "gemma4" else written
    assert text["global_head_dim"] == 32 and text["num_global_key_value_heads"] == 1
    assert "per_layer_config" not in text
    weights = mx.load(str(dst / "model.safetensors"))
    prefix = "language_model.model" if layout == "gemma4" else "model"
    assert weights[f"{prefix}.layers.0.experts.switch_glu.gate_proj.weight"].dtype == mx.uint32
    assert f"{prefix}.layers.3.self_attn.k_proj.weight" not in weights
