"""EAGLE heads: the MLX module against a float64 reference, every checkpoint layout, misfit
heads, conversion beside a model, and the real SmolLM2 heads' two EAGLE-3 layouts."""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import save_file

from mlx_speculate.convert import convert
from mlx_speculate.convert import main as convert_main
from mlx_speculate.heads.eagle import NORM_FLAGS, EagleConfig, EagleHead
from mlx_speculate.heads.eagle_format import build_eagle, load_eagle_heads
from mlx_speculate.loading import load_model

from .helpers import (
    BESIDE,
    EAGLE_HEADS,
    MODELS,
    TINY,
    eagle_config,
    random_eagle_weights,
    random_weights,
    require,
    tiny_config,
    tiny_model,
)

REL, ABS = 1e-5, 1e-4
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = {
    "eagle1": (1, {}),
    "eagle1-fc-bias-two-layers": (1, {"fc_bias": True, "layer": {"num_hidden_layers": 2}}),
    "eagle1-qkv-bias": (1, {"layer": {"qkv_bias": True}}),  # EAGLE-Qwen2 heads
    "eagle1-all-biases": (1, {"layer": {"attention_bias": True}}),
    "eagle1-llama3-rope": (1, {"layer": {"rope_theta": 500000.0, "rope_scaling": LLAMA3}}),
    "eagle3": (3, {"draft_vocab": 40}),
    "eagle3-llama3-rope": (
        3, {"draft_vocab": 40, "layer": {"rope_theta": 500000.0, "rope_scaling": LLAMA3}}
    ),
    "eagle3-target-vocab": (3, {}),
    "eagle3-speculators-norms": (3, {"draft_vocab": 40, "flags": NORM_FLAGS}),
}  # fmt: skip


def case_head(name: str, seed: int = 0) -> tuple[EagleHead, dict]:
    version, kwargs = CASES[name]
    config = eagle_config(tiny_config(), version, **kwargs)
    weights = random_eagle_weights(config, seed)
    return build_eagle(config, weights), weights


def reference(config: EagleConfig, weights: dict, steps: list[tuple]) -> np.ndarray:
    """EAGLE's forward in float64 torch, transcribed from the official semantics, over every
    position at once (causal); rotary tables from transformers. `steps`: per position
    (embedding, hidden, from_target). Returns (L, h) outputs."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, rotate_half

    w = {k: torch.from_numpy(np.array(v, dtype=np.float64)) for k, v in weights.items()}
    args = config.args
    eps, dim = args.rms_norm_eps, args.head_dim
    heads, kv = args.num_attention_heads, args.num_key_value_heads

    def rms(x, name):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w[f"{name}.weight"]

    def linear(x, name):
        y = x @ w[f"{name}.weight"].T
        return y + w[f"{name}.bias"] if f"{name}.bias" in w else y

    layer_config = {k: v for k, v in config.layer.items() if k != "qkv_bias"}
    rope = LlamaRotaryEmbedding(LlamaConfig(**layer_config, head_dim=dim))
    length = len(steps)
    cos, sin = rope(torch.zeros(1, length, dtype=torch.float64), torch.arange(length)[None])

    def attention(x, name):
        q = linear(x, f"{name}.q_proj").view(length, heads, dim).transpose(0, 1)
        k = linear(x, f"{name}.k_proj").view(length, kv, dim).transpose(0, 1)
        v = linear(x, f"{name}.v_proj").view(length, kv, dim).transpose(0, 1)
        q, k = (t * cos[0] + rotate_half(t) * sin[0] for t in (q, k))
        k, v = (t.repeat_interleave(heads // kv, dim=0) for t in (k, v))
        scores = q @ k.transpose(1, 2) / dim**0.5
        scores = scores.masked_fill(torch.ones(length, length).triu(1).bool(), -torch.inf)
        out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(length, heads * dim)
        return linear(out, f"{name}.o_proj")

    def mlp(x, name):
        gate = linear(x, f"{name}.gate_proj")
        up = linear(x, f"{name}.up_proj")
        return linear(torch.nn.functional.silu(gate) * up, f"{name}.down_proj")

    embeds = torch.stack([torch.from_numpy(np.array(e, np.float64)) for e, _, _ in steps])
    hidden = [torch.from_numpy(np.array(h, np.float64)) for _, h, _ in steps]
    if config.version == 1:
        x = linear(torch.cat([embeds, torch.stack(hidden)], -1), "fc")
        for i in range(args.num_hidden_layers):
            name = f"layers.{i}"
            h = x if i == 0 else rms(x, f"{name}.input_layernorm")
            x = x + attention(h, f"{name}.self_attn")
            x = x + mlp(rms(x, f"{name}.post_attention_layernorm"), f"{name}.mlp")
        return x.numpy()
    fused = []
    for h, (_, _, from_target) in zip(hidden, steps, strict=True):
        if from_target:
            if "norm_before_fc" in config.flags:
                h = rms(h, "input_norm")
            if "fc_norm" in config.flags:
                h = torch.cat([rms(p, f"fc_norm.{i}") for i, p in enumerate(h.chunk(3))])
            h = linear(h, "fc")
        fused.append(h)
    hid = torch.stack(fused)
    normed = rms(hid, "midlayer.hidden_norm")
    residual = normed if "norm_before_residual" in config.flags else hid
    x = torch.cat([rms(embeds, "midlayer.input_layernorm"), normed], -1)
    h = residual + attention(x, "midlayer.self_attn")
    out = h + mlp(rms(h, "midlayer.post_attention_layernorm"), "midlayer.mlp")
    return out.numpy()


def assert_close(ours: mx.array, ref: np.ndarray) -> None:
    err = float(np.abs(np.array(ours, dtype=np.float64) - ref).max())
    scale = float(np.abs(ref).max())
    assert err < REL * scale and err < ABS, f"max abs error {err:.3g} (relative {err / scale:.3g})"


def random_steps(head: EagleHead, from_target: int, own: int, seed: int = 1) -> list[tuple]:
    """Positions fed from the target's features, then from the head's own states."""
    rng = np.random.default_rng(seed)
    h = head.args.hidden_size
    width = 2 * h if head.config.version == 1 else 3 * h  # EAGLE-1's fc input is built inside
    target = h if head.config.version == 1 else width
    steps = [(rng.normal(size=h), rng.normal(size=target), True) for _ in range(from_target)]
    return steps + [(rng.normal(size=h), rng.normal(size=h), False) for _ in range(own)]


def run_head(head: EagleHead, steps: list[tuple], split: int) -> mx.array:
    """The head over `steps` in two cached calls: [:split] from the target, then the rest."""
    cache = head.make_cache()
    outs = []
    for part, from_target in ((steps[:split], True), (steps[split:], False)):
        embeds = mx.array(np.stack([e for e, _, _ in part]), dtype=mx.float32)[None]
        hidden = mx.array(np.stack([h for _, h, _ in part]), dtype=mx.float32)[None]
        outs.append(head(embeds, hidden, cache, from_target=from_target)[0])
    return mx.concatenate(outs)


@pytest.mark.parametrize("name", list(CASES))
def test_head_matches_float64_reference(name):
    head, weights = case_head(name)
    steps = random_steps(head, from_target=7, own=3)
    ours = run_head(head, steps, split=7)
    expected = reference(head.config, weights, steps)
    assert_close(ours, expected)
    if head.config.version == 3:
        torch = pytest.importorskip("torch")
        w = {k: torch.from_numpy(np.array(v, np.float64)) for k, v in weights.items()}
        out = torch.from_numpy(expected)
        normed = out * torch.rsqrt((out * out).mean(-1, keepdim=True) + head.args.rms_norm_eps)
        logits = (normed * w["norm.weight"]) @ w["lm_head.weight"].T
        assert_close(head.draft_logits(ours), logits.numpy())


def test_draft_ids_map_to_target_ids():
    head, weights = case_head("eagle3")
    d2t = np.array(weights["d2t"])
    ids = mx.array([0, 5, 39], dtype=mx.int32)
    assert head.to_target(ids).tolist() == [i + int(d2t[i]) for i in (0, 5, 39)]
    same, _ = case_head("eagle3-target-vocab")
    assert "d2t" not in same and same.to_target(ids).tolist() == [0, 5, 39]


# Published layouts: synthetic files with the published configs' keys and values (sizes shrunk
# to the tiny target's), read back into the same head.

DEEP = {"num_hidden_layers": 8}  # EAGLE-3's default taps: layers 2, 4 and 5


def published_config(layout: str) -> dict:
    small = {k: TINY[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                  "num_key_value_heads", "vocab_size")}  # fmt: skip
    if layout == "eagle1-llama3":  # yuhuili/EAGLE-LLaMA3-Instruct-8B
        return {
            "architectures": ["LlamaForCausalLM"], "bos_token_id": 128000,
            "eos_token_id": 128001, "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 8192, "model_type": "llama", "num_hidden_layers": 1,
            "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
            "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "float16",
            "transformers_version": "4.28.1", "use_cache": True, **small,
        }  # fmt: skip
    if layout == "eagle1-qwen2":  # yuhuili/EAGLE-Qwen2-7B-Instruct
        return {
            "architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643,
            "eos_token_id": 151645, "hidden_act": "silu", "max_position_embeddings": 32768,
            "model_type": "qwen2", "num_hidden_layers": 1, "qkv_bias": True, "bias": True,
            "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
            "use_sliding_window": False, **small,
        }  # fmt: skip
    if layout in ("eagle3-llama31", "eagle3-specforge"):  # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B
        return {
            "architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 128000,
            "eos_token_id": 128001, "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 2048, "model_type": "llama", "num_hidden_layers": 1,
            "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
            "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True,
            "draft_vocab_size": 40, "rope_theta": 500000.0, "rope_scaling": LLAMA3, **small,
        }  # fmt: skip
    assert layout == "eagle3-speculators"  # vllm-project/speculators' converter output
    layer = {"model_type": "llama", "num_hidden_layers": 1, "rms_norm_eps": 1e-05,
             "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
             "max_position_embeddings": 8192, "head_dim": 16, "attention_bias": False,
             "mlp_bias": False, **small}  # fmt: skip
    return {
        "architectures": ["Eagle3Speculator"], "draft_vocab_size": 40,
        "eagle_aux_hidden_state_layer_ids": [2, 4, 5], "fc_norm": False,
        "norm_before_fc": False, "norm_before_residual": False, "norm_output": False,
        "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "t"}},
        "transformer_layer_config": layer,
    }  # fmt: skip


def write_published(folder, layout: str, seed: int = 0):
    """The checkpoint in `layout`'s files and key names, and the head it must read back as."""
    raw = published_config(layout)
    config, _, _ = read_eagle_config(raw)
    weights = {k: np.array(v) for k, v in random_eagle_weights(config, seed).items()}
    if raw.get("torch_dtype") == "float16":  # as published: the head reads back rounded
        weights = {
            k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in weights.items()
        }
    exact = {
        k: mx.array(v.astype(np.float32) if v.dtype == np.float16 else v)
        for k, v in weights.items()
    }
    if layout.startswith("eagle3"):
        weights["t2d"] = np.zeros(TINY["vocab_size"], dtype=bool)
    weights["embed_tokens.weight"] = np.zeros((TINY["vocab_size"], TINY["hidden_size"]), "f4")
    if layout == "eagle3-speculators":
        weights = {k.replace("midlayer.", "layers.0."): v for k, v in weights.items()}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(raw))
    if layout in ("eagle1-llama3", "eagle3-llama31"):  # official releases: torch pickles
        torch = pytest.importorskip("torch")
        torch.save(
            {k: torch.from_numpy(v) for k, v in weights.items()}, folder / "pytorch_model.bin"
        )
    else:
        save_file(weights, str(folder / "model.safetensors"))
    return folder, build_eagle(config, exact)


def read_eagle_config(raw: dict) -> tuple[EagleConfig, None, None]:
    """The EagleConfig a published config (and its tensors' biases) describes."""
    version = 3 if "draft_vocab_size" in raw else 1
    layer = raw.get("transformer_layer_config") or {
        k: v for k, v in raw.items() if k not in ("architectures", "bias", "draft_vocab_size")
    }
    layer = {**layer, "qkv_bias": bool(raw.get("qkv_bias"))}
    taps = raw.get("eagle_aux_hidden_state_layer_ids")
    config = EagleConfig(
        version=version,
        layer=layer,
        draft_vocab_size=raw.get("draft_vocab_size"),
        taps=None if taps is None else tuple(taps),
        fc_bias=bool(raw.get("bias")),
    )
    return config, None, None


LAYOUTS = [
    "eagle1-llama3",
    "eagle1-qwen2",
    "eagle3-llama31",
    "eagle3-specforge",
    "eagle3-speculators",
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_published_layouts_read_back_exactly(tmp_path, layout):
    folder, expected = write_published(tmp_path / "heads", layout)
    target = tiny_model("llama", **(DEEP if layout.startswith("eagle3") else {}))
    head = load_eagle_heads(folder, target)
    assert head.config.version == expected.config.version
    steps = random_steps(head, from_target=5, own=2)
    assert mx.array_equal(run_head(head, steps, 5), run_head(expected, steps, 5))
    if head.config.version == 3:
        assert head.check_fits(target) == (2, 4, 5)


def test_a_model_folder_name_finds_its_heads_and_hub_ids_are_fetched(tmp_path, monkeypatch):
    folder, expected = write_published(tmp_path / "model" / "eagle", "eagle1-qwen2")
    (tmp_path / "model" / "config.json").write_text("{}")
    steps = random_steps(expected, 4, 1)
    assert mx.array_equal(run_head(load_eagle_heads(tmp_path / "model"), steps, 4),
                          run_head(expected, steps, 4))  # fmt: skip
    fetched = []

    def snapshot_download(repo_id, allow_patterns=None, **kwargs):
        fetched.append((repo_id, allow_patterns))
        return str(folder)

    monkeypatch.setitem(sys.modules, "huggingface_hub", type(sys)("huggingface_hub"))
    sys.modules["huggingface_hub"].snapshot_download = snapshot_download
    head = load_eagle_heads("yuhuili/EAGLE-Qwen2-7B-Instruct")
    assert fetched[0][0] == "yuhuili/EAGLE-Qwen2-7B-Instruct"
    assert "config.json" in fetched[0][1] and "pytorch_model.bin" in fetched[0][1]
    assert mx.array_equal(run_head(head, steps, 4), run_head(expected, steps, 4))


def test_heads_compute_in_the_targets_dtype(tmp_path):
    folder, _ = write_published(tmp_path / "heads", "eagle1-llama3")
    head = load_eagle_heads(folder, tiny_model("llama"))  # float32 target
    assert head.fc.weight.dtype == mx.float32
    bf16 = tiny_model("llama")
    bf16.set_dtype(mx.bfloat16)
    assert load_eagle_heads(folder, bf16).fc.weight.dtype == mx.bfloat16


@pytest.mark.parametrize(
    ("change", "target", "message"),
    [
        ({"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1}, {},
         "hidden size 32, the target's is 64"),
        ({"vocab_size": 120}, {}, "vocabulary of 120, the target's is 97"),
        ({}, {"num_hidden_layers": 4}, r"tap layers \[2, 4, 5\]; the target has 4"),
    ],
)  # fmt: skip
def test_misfit_heads_are_refused(tmp_path, change, target, message):
    config = eagle_config(tiny_config(**change), 3, draft_vocab=40, taps=(2, 4, 5))
    head = build_eagle(config, random_eagle_weights(config))
    with pytest.raises(ValueError, match=message):
        head.check_fits(tiny_model("llama", **(DEEP | target)))


def test_d2t_past_the_vocabulary_is_refused():
    config = eagle_config(tiny_config(), 3, draft_vocab=40)
    weights = random_eagle_weights(config)
    weights["d2t"] = mx.full((40,), 90, dtype=mx.int64)  # 39 + 90 >= 97
    with pytest.raises(ValueError, match="past the target's vocabulary"):
        build_eagle(config, weights).check_fits(tiny_model("llama", **DEEP))


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        (lambda f: (f / "config.json").unlink(), FileNotFoundError, "no config.json"),
        (lambda f: (f / "model.safetensors").write_bytes(b"junk"), ValueError, "corrupt"),
        (lambda f: (f / "model.safetensors").unlink(), FileNotFoundError, "no EAGLE heads weights"),
        (lambda f: (f / "config.json").write_text(json.dumps(
            published_config("eagle3-speculators") | {"speculators_model_type": "mlp"})),
         ValueError, "speculators model type 'mlp' is not supported"),
    ],
)  # fmt: skip
def test_bad_checkpoints_give_one_line_errors(tmp_path, edit, error, message):
    folder, _ = write_published(tmp_path / "heads", "eagle3-speculators")
    edit(folder)
    with pytest.raises(error, match=message) as raised:
        load_eagle_heads(folder)
    assert "\n" not in str(raised.value)


def test_real_eagle3_layouts_give_identical_draft_logits():
    eagle = require(EAGLE_HEADS, BESIDE)
    native = load_eagle_heads(eagle / "smollm2-eagle3")
    converted = load_eagle_heads(eagle / "smollm2-eagle3-speculators")
    assert native.config.taps is None and converted.config.taps == (2, 15, 27)
    steps = random_steps(native, from_target=6, own=2)
    out = run_head(native, steps, 6)
    assert mx.array_equal(out, run_head(converted, steps, 6))
    assert mx.array_equal(native.draft_logits(out), converted.draft_logits(out))
    assert mx.array_equal(native.d2t, converted.d2t)


# Conversion beside a model.


def write_hf_model(folder, config: dict, seed: int = 0):
    folder.mkdir(parents=True)
    weights = {k: np.array(v) for k, v in random_weights(config, seed).items()}
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("layout", ["eagle1-qwen2", "eagle3-speculators"])
def test_convert_writes_float_heads_exactly(tmp_path, layout):
    config = tiny_config("llama", **(DEEP if layout.startswith("eagle3") else {}))
    src = write_hf_model(tmp_path / "hf", config)
    heads, expected = write_published(tmp_path / "heads", layout)
    dst = convert(src, tmp_path / "mlx", eagle_path=heads)
    saved = json.loads((dst / "eagle" / "config.json").read_text())
    assert saved["eagle_version"] == expected.config.version and "quantization" not in saved
    model, _ = load_model(dst)
    head = load_eagle_heads(dst, model)
    steps = random_steps(head, 5, 2)
    assert mx.array_equal(run_head(head, steps, 5), run_head(expected, steps, 5))
    if layout.startswith("eagle3"):
        assert saved["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]


def test_convert_quantizes_heads_like_the_model(tmp_path):
    src = write_hf_model(tmp_path / "hf", tiny_config("llama", **DEEP))
    heads, expected = write_published(tmp_path / "heads", "eagle3-specforge")
    code = convert_main(
        ["--hf-path", str(src), "--mlx-path", str(tmp_path / "q"), "-q", "--q-group-size", "32",
         "--eagle-path", str(heads)]
    )  # fmt: skip
    assert code == 0
    saved = json.loads((tmp_path / "q" / "eagle" / "config.json").read_text())
    assert saved["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    model, _ = load_model(tmp_path / "q")
    head = load_eagle_heads(tmp_path / "q", model)
    assert "scales" in head.lm_head and "scales" in head.midlayer.self_attn.q_proj
    steps = random_steps(head, 5, 2)
    ours, exact = run_head(head, steps, 5), run_head(expected, steps, 5)
    error = mx.abs(ours - exact)
    assert 0 < mx.max(error).item()  # really quantized
    # 4-bit weights move the output by about a tenth of its spread, not more.
    spread = mx.mean(mx.abs(exact - mx.mean(exact, axis=-1, keepdims=True))).item()
    assert mx.mean(error).item() < 0.2 * spread


def test_convert_refuses_misfit_heads_and_leaves_nothing(tmp_path):
    src = write_hf_model(tmp_path / "hf", tiny_config("llama"))  # 2 layers: no layer 5 to tap
    heads, _ = write_published(tmp_path / "heads", "eagle3-speculators")
    code = convert_main(["--hf-path", str(src), "--mlx-path", str(tmp_path / "out"),
                         "--eagle-path", str(heads)])  # fmt: skip
    assert code == 2
    assert {p.name for p in tmp_path.iterdir()} == {"hf", "heads"}  # no leftovers


def test_cli_eagle_beside_a_converted_model_prints_the_plain_text(tmp_path, capsys):
    """convert --eagle-path, then `generate --eagle` (and with a chain) prints plain greedy's
    text; misfit heads are a one-line error."""
    from mlx_speculate.generate import main as generate_main

    folder = MODELS / "stories260K-llama"
    config = json.loads((folder / "config.json").read_text())
    heads_config = eagle_config(config, 1)
    heads = tmp_path / "heads"
    from mlx_speculate.heads.store import save_heads

    save_heads(build_eagle(heads_config, random_eagle_weights(heads_config, 4)), heads,
               heads_config.to_json())  # fmt: skip
    dst = tmp_path / "mlx"
    assert convert_main(["--hf-path", str(folder), "--mlx-path", str(dst),
                         "--eagle-path", str(heads)]) == 0  # fmt: skip
    args = ["--model", str(dst), "--prompt", "Once upon a time", "--ignore-chat-template",
            "-m", "40"]  # fmt: skip
    capsys.readouterr()
    assert generate_main(args) == 0
    plain = capsys.readouterr().out
    for extra in (["--tree-total", "16", "--tree-depth", "4", "--tree-top-k", "4"],
                  ["--tree-total", "6", "--tree-depth", "4", "--tree-top-k", "1"]):  # fmt: skip
        assert (
            generate_main([*args, "--eagle", *extra, "--num-draft-tokens", "5", "--verbose"]) == 0
        )
        captured = capsys.readouterr()
        assert captured.out == plain
        assert "tokens per target forward" in captured.err
    with pytest.raises(SystemExit) as exited:
        generate_main([*args, "--tree-top-k", "4"])
    assert exited.value.code == 2 and "applies to --eagle only" in capsys.readouterr().err
    misfit = tmp_path / "misfit"
    small = eagle_config(tiny_config(), 1)
    save_heads(build_eagle(small, random_eagle_weights(small)), misfit, small.to_json())
    assert generate_main([*args, "--eagle", str(misfit)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1
    assert "vocabulary of 97, the target's is 512" in err
