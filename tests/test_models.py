"""Models against transformers (float64, eager), cached decoding, trees and real checkpoints."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any
from unittest.mock import ANY

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_speculate.loading import build_model, load, load_model
from mlx_speculate.models import gemma3
from mlx_speculate.models.rope import rope_both_forms

from .helpers import (
    MODELS,
    TINY,
    greedy_reference,
    random_weights,
    tiny_config,
    tree_inputs,
    tree_path,
)

REL, ABS = 1e-5, 1e-4  # float32 against float64 lands near 1e-6 relative


@dataclass(frozen=True)
class Variant:
    model_type: str
    overrides: dict[str, Any] = field(default_factory=dict)
    rope: dict[str, Any] = field(default_factory=dict)  # rope settings besides theta
    theta: float = 10000.0
    length: int = 10  # prompt length
    prefill: int = 6  # cached decoding: prefill this many tokens, then one token per step


def longrope(n: int) -> dict[str, Any]:
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(n)],
        "long_factor": [1.0 + 1.5 * i for i in range(n)],
    }


MINISTRAL3_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 8,
    "llama_4_scaling_beta": 0.5,
}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}

VARIANTS = {
    "llama-mha": Variant("llama", {"num_key_value_heads": 4}),
    "llama-gqa": Variant("llama"),
    "llama-bias": Variant("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-tied": Variant("llama", {"tie_word_embeddings": True}),
    "llama-linear": Variant("llama", rope={"rope_type": "linear", "factor": 4.0}),
    # The prompt crosses max_position_embeddings, so the NTK base is recomputed per forward.
    "llama-dynamic": Variant(
        "llama",
        {"max_position_embeddings": 32},
        {"rope_type": "dynamic", "factor": 2.0},
        length=36,
        prefill=30,
    ),
    # head_dim 16, theta 5e5, original 64: wavelengths 6, 32 and >= 167 hit all three bands.
    "llama3": Variant(
        "llama", rope={**LLAMA3, "original_max_position_embeddings": 64}, theta=500000.0
    ),
    "qwen2": Variant("qwen2"),
    "qwen2-tied": Variant("qwen2", {"tie_word_embeddings": True}),
    "qwen2-window-off": Variant(
        "qwen2",
        {"use_sliding_window": False, "sliding_window": 4, "max_window_layers": 0},
    ),
    "qwen2-window": Variant(
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
        length=12,
        prefill=8,
    ),
    # Mistral: every layer slides over 6 tokens (tests.helpers.FAMILY_TINY), or none does.
    "mistral": Variant("mistral", length=12, prefill=8),
    "mistral-tied": Variant("mistral", {"tie_word_embeddings": True}, length=12, prefill=8),
    "mistral-no-window": Variant("mistral", {"sliding_window": None}),
    "mistral-head-dim": Variant("mistral", {"head_dim": 32}, theta=1e6, length=12, prefill=8),
    # Ministral: layer 1 of 3 global between sliding ones, or every layer sliding by default.
    "ministral": Variant(
        "ministral",
        {
            "num_hidden_layers": 3,
            "head_dim": 16,  # transformers' Ministral reads it as it is (None fails)
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
        length=12,
        prefill=8,
    ),
    "ministral-default-types": Variant(
        "ministral", {"head_dim": 16, "sliding_window": 6}, length=12, prefill=8
    ),
    # Ministral 3: queries scaled anew every 8 (4) positions, past the window of 6 (or none).
    "ministral3": Variant("ministral3", rope=MINISTRAL3_YARN, length=20, prefill=12),
    "ministral3-plain-rope": Variant(
        "ministral3",
        {"sliding_window": None},
        {
            "rope_type": "default",
            "original_max_position_embeddings": 4,
            "llama_4_scaling_beta": 0.3,
        },
        length=14,
        prefill=6,
    ),
    "phi3": Variant("phi3"),
    "phi3-window": Variant("phi3", {"sliding_window": 6}, length=12, prefill=8),
    "phi3-longrope-short": Variant(
        "phi3", {"original_max_position_embeddings": 64}, longrope(8), length=24, prefill=20
    ),
    "phi3-longrope-long": Variant(
        "phi3", {"original_max_position_embeddings": 16}, longrope(8), length=20, prefill=14
    ),
    "phi3-partial": Variant("phi3", rope={"partial_rotary_factor": 0.5}),
    "phi3-partial-longrope": Variant(
        "phi3",
        {"original_max_position_embeddings": 16},
        {**longrope(4), "partial_rotary_factor": 0.5},
        length=20,
        prefill=14,
    ),
    # head_dim 32 (explicit, not 64 / 4 heads) for Qwen3 and Gemma 3 (tests.helpers.FAMILY_TINY).
    "qwen3": Variant("qwen3"),
    "qwen3-tied": Variant("qwen3", {"tie_word_embeddings": True}),
    "qwen3-bias": Variant("qwen3", {"attention_bias": True}),
    "qwen3-window": Variant(
        "qwen3",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
        length=12,
        prefill=8,
    ),
    # Theta 1e4, head_dim 32, original 64: the ramp runs over dimensions 0..5, partly inside.
    "qwen3-yarn": Variant(
        "qwen3", rope={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    ),
    "qwen3-yarn-attention-factor": Variant(
        "qwen3",
        {"max_position_embeddings": 128},
        {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.2, "beta_fast": 16},
    ),
    # Gemma 3: layer 0 slides over 6 tokens with its own base (100), layer 1 is global; the
    # prompts run past the window.
    "gemma3": Variant("gemma3_text", length=12, prefill=8),
    "gemma3-tied": Variant("gemma3_text", {"tie_word_embeddings": True}, length=12, prefill=8),
    "gemma3-layer-types": Variant(
        "gemma3_text",
        {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 4},
        length=12,
        prefill=7,
    ),
    "gemma3-linear": Variant(
        "gemma3_text", rope={"rope_type": "linear", "factor": 8.0}, theta=1e6, length=12, prefill=8
    ),
    "gemma3-softcap": Variant("gemma3_text", {"final_logit_softcapping": 2.0}),
    # Gemma 2: layer 0 slides over 6 tokens, scores capped at 2, logits at 5 (tests.helpers).
    "gemma2": Variant("gemma2", length=12, prefill=8),
    "gemma2-untied": Variant("gemma2", {"tie_word_embeddings": False}, length=12, prefill=8),
    "gemma2-no-caps": Variant(
        "gemma2", {"attn_logit_softcapping": None, "final_logit_softcapping": None}, length=12
    ),
    "gemma2-layer-types": Variant(
        "gemma2",
        {"num_hidden_layers": 3, "layer_types": ["full_attention", *["sliding_attention"] * 2]},
        theta=100.0,
        length=12,
        prefill=7,
    ),
}


def variant_config(variant: Variant, form: str) -> dict[str, Any]:
    """The variant's config.json in the transformers 5.x form or the legacy form."""
    config = tiny_config(variant.model_type, **variant.overrides)
    del config["rope_theta"]
    config.pop("rope_parameters", None)  # the variant's own rope replaces a family's tiny one
    rope = dict(variant.rope)
    local = config.pop("rope_local_base_freq", None)  # Gemma 3's sliding layers
    if form == "rope_parameters":
        params = {"rope_type": "default", "rope_theta": variant.theta, **rope}
        config["rope_parameters"] = params
        if local is not None:  # nested per layer type
            sliding = {"rope_type": "default", "rope_theta": local}
            config["rope_parameters"] = {"full_attention": params, "sliding_attention": sliding}
        return config
    config["rope_theta"] = variant.theta
    if local is not None:
        config["rope_local_base_freq"] = local
    if "partial_rotary_factor" in rope:
        config["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    if rope:
        rope_type = rope.pop("rope_type")
        # transformers reads only `rope_type` in Gemma 3's rope_scaling (as its configs write).
        key = "rope_type" if local is not None else "type"
        config["rope_scaling"] = {key: rope_type, **rope}
    return config


def hf_model(config: dict[str, Any], weights: dict[str, mx.array]):
    """transformers' model for `config` in float64 with eager attention and `weights` loaded."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    # Phi-3's default pad/eos ids (32000) lie outside a tiny vocabulary.
    config = {"pad_token_id": None, "eos_token_id": None, **config}
    hf_config = AutoConfig.for_model(**config, attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(hf_config).double().eval()
    state = {k: torch.from_numpy(np.array(v, dtype=np.float64)) for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected
    assert missing == (["lm_head.weight"] if hf_config.tie_word_embeddings else [])
    return model


def hf_forward(model, tokens: np.ndarray, cache=None, hidden: bool = False):
    import torch

    with torch.no_grad():
        return model(
            torch.from_numpy(tokens),
            past_key_values=cache,
            use_cache=cache is not None,
            output_hidden_states=hidden,
        )


def assert_close(ours: mx.array, ref, rel: float = REL, atol: float = ABS) -> None:
    """Max |ours - ref| below `rel` of max |ref| and below `atol`."""
    ref = np.asarray(ref, dtype=np.float64)
    err = float(np.abs(np.array(ours, dtype=np.float64) - ref).max())
    scale = float(np.abs(ref).max())
    assert err < rel * scale and err < atol, f"max abs error {err:.3g} (relative {err / scale:.3g})"


def prompt(length: int, seed: int = 0, vocab: int = TINY["vocab_size"]) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (1, length))


@pytest.mark.parametrize("form", ["rope_parameters", "legacy"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_prompt_matches_transformers(name, form):
    """A full-prompt forward gives transformers' logits, final hidden and the hidden states
    entering the tapped layers (transformers' hidden_states[i])."""
    variant = VARIANTS[name]
    config = variant_config(variant, form)
    weights = random_weights(config)
    ref = hf_model(config, weights)
    tokens = prompt(variant.length)
    last = len(ref.model.layers) - 1
    expected = hf_forward(ref, tokens, hidden=True)

    out = build_model(config, weights)(mx.array(tokens), taps=(last, 1, 0))
    assert_close(out.logits, expected.logits)
    assert_close(out.hidden, expected.hidden_states[-1])  # HF's last entry is post-norm
    assert_close(out.taps[0], expected.hidden_states[last])
    assert_close(out.taps[1], expected.hidden_states[1])
    assert_close(out.taps[2], expected.hidden_states[0])  # the embeddings


@pytest.mark.parametrize("form", ["rope_parameters", "legacy"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_cached_decoding_matches_transformers(name, form):
    """Prefill then one token per step gives transformers' logits at every step (its cache too)."""
    from transformers import DynamicCache

    variant = VARIANTS[name]
    config = variant_config(variant, form)
    weights = random_weights(config)
    ref = hf_model(config, weights)
    model = build_model(config, weights)
    tokens = prompt(variant.length)
    ref_cache, cache = DynamicCache(config=ref.config), model.make_cache()
    steps = [(0, variant.prefill)] + [(t, t + 1) for t in range(variant.prefill, variant.length)]
    for start, end in steps:
        expected = hf_forward(ref, tokens[:, start:end], ref_cache).logits
        assert_close(model(mx.array(tokens[:, start:end]), cache).logits, expected)
    assert cache.offset == variant.length


@pytest.mark.parametrize(
    "model_type",
    ["llama", "mistral", "ministral3", "qwen2", "phi3", "qwen3", "gemma2", "gemma3_text"],
)
def test_missing_keys_take_transformers_defaults(model_type):
    """A config with only the required sizes behaves like transformers' defaults for it."""
    config = {"model_type": model_type, "vocab_size": 97, "hidden_size": 64}
    config |= {"num_hidden_layers": 2, "intermediate_size": 96, "num_attention_heads": 4}
    config |= {"num_key_value_heads": 2}  # Qwen2Config's default (32) exceeds the 4 heads
    # Without max_window_layers, transformers' default (28) keeps both layers full attention.
    config |= {"use_sliding_window": True, "sliding_window": 4} if model_type == "qwen2" else {}
    # Gemma 3: head_dim 256, theta 1e6 and local base 1e4, window 4096 on 5 of every 6 layers.
    # Mistral: window 4096 on every layer.
    weights = random_weights(config)
    tokens = prompt(12)
    expected = hf_forward(hf_model(config, weights), tokens).logits
    assert_close(build_model(config, weights)(mx.array(tokens)).logits, expected)


@pytest.mark.parametrize(
    "name", ["mistral", "mistral-head-dim", "ministral", "ministral3", "gemma2"]
)
def test_windows_matter(name):
    """The parity above has teeth: the same weights without the window move the logits of
    the tokens past it far beyond its tolerance (and leave those before it alone)."""
    config = variant_config(VARIANTS[name], "rope_parameters")
    weights = random_weights(config)
    tokens = mx.array(prompt(12))
    windowed = build_model(config, weights)(tokens).logits
    wide = build_model({**config, "sliding_window": None}, weights)(tokens).logits
    assert mx.array_equal(windowed[:, :6], wide[:, :6])
    assert mx.abs(windowed[:, 6:] - wide[:, 6:]).max().item() > 1e-2


def test_ministral3_query_scale_matters():
    """Without the query scale (beta 0) the logits from position 8 on (floor(8 / 8) = 1)
    move far beyond the parity's tolerance, and those before it stay."""
    config = variant_config(VARIANTS["ministral3"], "rope_parameters")
    weights = random_weights(config)
    tokens = mx.array(prompt(20))
    scaled = build_model(config, weights)(tokens).logits
    rope = {**config["rope_parameters"], "llama_4_scaling_beta": 0.0}
    plain = build_model({**config, "rope_parameters": rope}, weights)(tokens).logits
    assert mx.array_equal(scaled[:, :8], plain[:, :8])
    assert mx.abs(scaled[:, 8:] - plain[:, 8:]).max().item() > 1e-2


def test_ministral_layer_types_matter():
    """Ministral's global layer (the parity above) is global: every layer sliding, as Mistral
    would run the same config, moves the logits past the window."""
    config = variant_config(VARIANTS["ministral"], "rope_parameters")
    weights = random_weights(config)
    tokens = mx.array(prompt(12))
    ours = build_model(config, weights)(tokens).logits
    mistral = build_model({**config, "model_type": "mistral"}, weights)(tokens).logits
    assert mx.abs(ours[:, 6:] - mistral[:, 6:]).max().item() > 1e-2


@pytest.mark.parametrize("cap", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_gemma2_softcaps_matter(cap):
    """The parity above has teeth: without either cap the logits move far beyond its
    tolerance."""
    config = variant_config(VARIANTS["gemma2"], "rope_parameters")
    weights = random_weights(config)
    tokens = mx.array(prompt(12))
    capped = build_model(config, weights)(tokens).logits
    free = build_model({**config, cap: None}, weights)(tokens).logits
    assert mx.abs(capped - free).max().item() > 1e-2


@pytest.mark.parametrize("rows", [1, 40])  # below and above attention.MIN_SCORES on the CPU
def test_attention_softcap_on_both_paths(rows):
    """Scaled scores are capped (cap * tanh(s / cap)) before the mask, on either path."""
    from mlx_speculate.models.attention import scaled_dot_product_attention

    mx.random.seed(0)
    q = 3 * mx.random.normal((1, 8, rows, 16))
    k, v = mx.random.normal((1, 2, 300, 16)), mx.random.normal((1, 2, 300, 16))
    allowed = mx.random.uniform(shape=(rows, 300)) > 0.3
    mask = mx.where(allowed, 0.0, mx.finfo(mx.float32).min)
    ours = scaled_dot_product_attention(q, k, v, 0.25, mask, softcap=1.5)
    scores = (q @ mx.repeat(k, 4, axis=1).swapaxes(-1, -2)) * 0.25
    expected = mx.softmax(1.5 * mx.tanh(scores / 1.5) + mask, axis=-1) @ mx.repeat(v, 4, axis=1)
    assert mx.allclose(ours, expected, atol=1e-5).item()
    uncapped = scaled_dot_product_attention(q, k, v, 0.25, mask)
    assert mx.abs(uncapped - expected).max().item() > 1e-2


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"hidden_activation": "gelu"}, "Gemma 2 hidden_activation 'gelu' is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"layer_types": ["full_attention"]}, "layer_types names 1 layers, the model has 2"),
    ],
)
def test_gemma2_configs_it_cannot_run_are_one_line_errors(overrides, needle):
    with pytest.raises(ValueError, match=needle) as error:
        build_model(tiny_config("gemma2", **overrides), random_weights(tiny_config("gemma2")))
    assert "\n" not in str(error.value)


def test_ministral3_without_query_scaling_keys_is_one_line_error():
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="rope_parameters need llama_4_scaling_beta and orig"):
        build_model(tiny_config("ministral3", rope_parameters=rope), {})


# How transformers >= 4.52, and older transformers or mlx-vlm, name a `gemma3` folder's language
# model and its lm_head.
GEMMA3_LAYOUTS = {
    "model.language_model": "lm_head",
    "language_model.model": "language_model.lm_head",
}


@pytest.mark.parametrize("prefix", list(GEMMA3_LAYOUTS))
def test_gemma3_folder_loads_its_language_model(tmp_path, prefix):
    """A `gemma3` folder (text_config, prefixed names, a vision tower, per-module quantization
    keyed by its own paths) loads as the gemma3_text model it holds."""
    text = tiny_config("gemma3_text")
    model = build_model(text, random_weights(text))
    nn.quantize(
        model,
        32,
        4,
        class_predicate=lambda path, module: (
            path != "model.layers.0.mlp.down_proj"
            and hasattr(module, "to_quantized")
            and ({"group_size": 32, "bits": 8} if path == "model.embed_tokens" else True)
        ),
    )

    def theirs(name: str) -> str:
        return name.replace("model", prefix, 1).replace("lm_head", GEMMA3_LAYOUTS[prefix], 1)

    weights = {theirs(k): v for k, v in tree_flatten(model.parameters())}
    weights["vision_tower.vision_model.post_layernorm.weight"] = mx.ones((8,))
    quantization = {"group_size": 32, "bits": 4, theirs("model.layers.0.mlp.down_proj"): False}
    quantization[theirs("model.embed_tokens")] = {"group_size": 32, "bits": 8}
    config = {"model_type": "gemma3", "text_config": text, "vision_config": {"hidden_size": 8}}
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    (tmp_path / "config.json").write_text(json.dumps(config | {"quantization": quantization}))

    loaded = load_model(tmp_path)[0]
    assert loaded.model.embed_tokens.bits == 8
    assert isinstance(loaded.model.layers[0].mlp.down_proj, nn.Linear)
    tokens = mx.array(prompt(12))
    assert mx.array_equal(loaded(tokens).logits, model(tokens).logits)


# A tiny Pixtral vision tower for `mistral3` folders (not run, only skipped at load).
PIXTRAL = {
    "model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "head_dim": 16, "image_size": 28, "patch_size": 14,
}  # fmt: skip


@pytest.mark.parametrize("text_type", ["mistral", "ministral3"])
def test_mistral3_folder_loads_its_language_model(tmp_path, text_type):
    """A `mistral3` folder transformers saved (Mistral3ForConditionalGeneration: a vision
    tower, the text model under model.language_model.) loads as its text model with
    transformers' logits, and converts to a folder mlx-lm's mistral3 reads alike (no window:
    mlx-lm's would need a full layer)."""
    import mlx_lm
    from transformers import AutoConfig, Mistral3ForConditionalGeneration

    from mlx_speculate.convert import convert

    from .families import randomize
    from .test_convert import save_tokenizer

    text = tiny_config(text_type, sliding_window=None, num_hidden_layers=3)
    config = AutoConfig.for_model(
        "mistral3", text_config=text, vision_config=PIXTRAL, tie_word_embeddings=False
    )
    config.text_config._attn_implementation = "eager"
    ref = Mistral3ForConditionalGeneration(config).float().eval()
    randomize(ref, 0)
    ref.save_pretrained(tmp_path / "hf")
    save_tokenizer(tmp_path / "hf", text["vocab_size"])
    tokens = prompt(20)
    expected = hf_forward(ref.double(), tokens).logits
    ours = load_model(tmp_path / "hf")[0]
    assert ours.args.model_type == "mistral3"
    assert_close(ours(mx.array(tokens)).logits, expected)
    dst = convert(tmp_path / "hf", tmp_path / "mlx", quantize=True, q_group_size=32)
    a = load(dst)[0](mx.array(tokens)).logits
    b = mlx_lm.load(str(dst))[0](mx.array(tokens))
    assert mx.abs(a - b).max().item() < 1e-4 * max(mx.abs(b).max().item(), 1.0)


def test_mistral3_with_another_text_model_is_one_line_error():
    config = {"model_type": "mistral3", "text_config": tiny_config("qwen2")}
    with pytest.raises(ValueError, match="mistral3 text_config model_type 'qwen2' is not supp"):
        build_model(config, {})


@pytest.mark.parametrize("name", ["gemma3", "gemma3-linear"])
def test_gemma3_rope_forms_agree(name):
    """Gemma 3's nested rope_parameters and the legacy keys convert writes beside them (what
    mlx-lm reads) give the same global and local RoPE."""
    nested = variant_config(VARIANTS[name], "rope_parameters")
    legacy = rope_both_forms(nested)
    assert legacy["rope_parameters"] == nested["rope_parameters"]
    del legacy["rope_parameters"]
    assert legacy == variant_config(VARIANTS[name], "legacy") | {"rope_scaling": ANY}
    ours, theirs = gemma3.ModelArgs.from_dict(nested), gemma3.ModelArgs.from_dict(legacy)
    assert ours.rope_config() == theirs.rope_config()
    assert ours.local_rope_config() == theirs.local_rope_config()


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"layer_types": ["full_attention"]}, "layer_types names 1 layers, the model has 2"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "dynamic", "factor": 2.0}}},
            "sliding_attention rope_type 'dynamic' is not supported",
        ),
    ],
)
def test_gemma3_configs_it_cannot_run_are_one_line_errors(overrides, needle):
    config = tiny_config("gemma3_text", **overrides)
    with pytest.raises(ValueError, match=needle) as error:
        build_model(config, random_weights(tiny_config("gemma3_text")))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("name", ["qwen3-yarn", "gemma3-linear"])
def test_transformers_folder_converts_to_the_same_logits(tmp_path, name):
    """A folder transformers saved (Gemma 3's rope nested per layer type) converts to an MLX
    folder that gives transformers' logits."""
    from mlx_speculate.convert import convert

    config = variant_config(VARIANTS[name], "rope_parameters")
    weights = random_weights(config)
    ref = hf_model(config, weights)
    ref.float().save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx")
    tokens = prompt(12)
    ours = load_model(tmp_path / "mlx")[0](mx.array(tokens)).logits
    assert_close(ours, hf_forward(ref.double(), tokens).logits)


def test_rope_theta_inside_rope_parameters_is_used(tmp_path):
    """Only `rope_parameters.rope_theta` (no top-level key, mlx-lm 0.32 reads 1e4) sets the base."""
    config = tiny_config()
    del config["rope_theta"]
    config["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "default"}
    weights = random_weights(config)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    (tmp_path / "config.json").write_text(json.dumps(config))
    tokens = prompt(32)
    expected = hf_forward(hf_model(config, weights), tokens).logits.numpy()

    ours = load_model(tmp_path)[0](mx.array(tokens)).logits
    assert_close(ours, expected)
    config["rope_parameters"]["rope_theta"] = 10000.0
    wrong = np.array(build_model(config, weights)(mx.array(tokens)).logits)
    assert np.abs(wrong - expected).max() > 1e-2 * np.abs(expected).max()


# Tree verification: one forward over a tree equals sequential forwards along each path.

PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]  # depth 3, branching 2: leaves 4, 6, 7


@pytest.mark.parametrize(
    "model_type, overrides",
    [
        ("llama", {}),
        ("qwen2", {}),
        ("mistral", {"sliding_window": 8}),
        (
            "ministral",
            {"sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"]},
        ),
        ("ministral3", {"sliding_window": 8}),
        ("gemma2", {}),
        ("phi3", {}),
        ("phi3", {"sliding_window": 8}),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
        ("gemma3_text", {}),
    ],
    # Windows 8 (Gemma 2 and 3: 6) < prefix 10 + tree depth.
    ids=[
        "llama",
        "qwen2",
        "mistral-window",
        "ministral-layer-types",
        "ministral3-window",
        "gemma2",
        "phi3",
        "phi3-window",
        "qwen3-window",
        "gemma3",
    ],
)
def test_tree_forward_matches_paths(model_type, overrides):
    """Every tree node's logits equal a cached forward along its root-to-node path."""
    model = build_model(config := tiny_config(model_type, **overrides), random_weights(config))
    prefix = mx.array(prompt(10, seed=1))
    nodes = mx.array(prompt(len(PARENTS), seed=2))
    cache = model.make_cache()
    model(prefix, cache)
    positions, mask = tree_inputs(PARENTS, cache.offset)
    tree = model(nodes, cache, positions=positions, mask=mask).logits[0]
    for leaf in (4, 6, 7):
        path = tree_path(PARENTS, leaf)
        cache = model.make_cache()
        model(prefix, cache)
        sequential = model(nodes[:, path], cache).logits[0]
        assert_close(tree[mx.array(path)], sequential)


@pytest.mark.parametrize(
    "model_type",
    ["llama", "mistral", "ministral3", "qwen2", "phi3", "qwen3", "gemma2", "gemma3_text"],
)
@pytest.mark.parametrize("shape", ["(B, L)", "(L,)"])
def test_explicit_consecutive_positions_equal_default(model_type, shape):
    """Positions equal to the consecutive default give the same logits as positions=None."""
    model = build_model(config := tiny_config(model_type), random_weights(config))
    tokens = mx.array(prompt(12))
    caches = [model.make_cache(), model.make_cache()]
    for cache in caches:
        model(tokens[:, :5], cache)
    positions = mx.arange(5, 12) if shape == "(L,)" else mx.arange(5, 12)[None]
    default = model(tokens[:, 5:], caches[0]).logits
    explicit = model(tokens[:, 5:], caches[1], positions=positions).logits
    assert mx.array_equal(default, explicit)


# Real checkpoints from tests/data/models.

FOLDERS = ["stories260K-llama", "stories260K-qwen2", "stories260K-phi3", "llama2xs281K-llama"]
PROMPTS = ["Once upon a time", "Lily and Tom went to the park. They saw a big dog", "The sun"]


@pytest.mark.parametrize("folder", FOLDERS)
def test_checkpoint_matches_transformers(folder):
    """Each real checkpoint gives transformers' float64 logits on a few prompts."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model, tokenizer = load(MODELS / folder)
    ref = AutoModelForCausalLM.from_pretrained(
        MODELS / folder, dtype=torch.float64, attn_implementation="eager"
    ).eval()
    for text in PROMPTS:
        tokens = np.array([tokenizer.encode(text)])
        assert tokens[0, 0] == 1 and tokens.shape[1] > 3
        assert_close(model(mx.array(tokens)).logits, hf_forward(ref, tokens).logits)


def greedy_text_ids() -> list[int]:
    _, tokenizer = load(MODELS / "stories260K-llama")
    text = (MODELS / "stories260K-llama" / "greedy-from-bos.txt").read_text()
    return tokenizer.encode(text, add_special_tokens=False)


def test_stories_layouts_agree():
    """The Llama, Qwen2 and Phi-3 layouts of stories260K give the same logits."""
    tokens = mx.array([[1] + greedy_text_ids()[:63]])
    logits = [
        load_model(MODELS / f"stories260K-{a}")[0](tokens).logits
        for a in ("llama", "qwen2", "phi3")
    ]
    for other in logits[1:]:
        assert mx.abs(other - logits[0]).max().item() <= 2e-5


def test_stories_greedy_from_bos():
    """Greedy decoding of stories260K from BOS reproduces the published 256-token story."""
    model, tokenizer = load(MODELS / "stories260K-llama")
    ids = greedy_reference(model, [1], 256)
    expected = (MODELS / "stories260K-llama" / "greedy-from-bos.txt").read_text()
    assert tokenizer.decode(ids) + "\n" == expected  # the file ends with a newline
