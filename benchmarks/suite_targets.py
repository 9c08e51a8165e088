"""The suite's targets (benchmarks/gpu_suite.py): their shapes per mode, random checkpoints that
both mlx_speculate's and mlx-lm's loaders read, and a random EAGLE-3 head of a target's shape.

Every internal of the package the suite uses is imported here, in one place, so that a move
inside the package is fixed here alone; the suite itself calls the public API.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from bench_verify_cost import LLAMA31_8B, SMOLLM2_135M
from common import MODELS, QWEN25_05B, SHARED
from mlx.utils import tree_flatten

from mlx_speculate.drafters import EagleGrowth
from mlx_speculate.heads.eagle import EagleConfig, eagle_head, official_taps
from mlx_speculate.loading import model_class

STORIES = MODELS / "stories260K-llama"
STORIES_DRAFT = MODELS / "llama2xs281K-llama"
EAGLE_HEAD = SHARED / "models" / "stories260K-eagle3"
PROMPT = "Once upon a time, there was a little girl named Lily. She"
K = 4  # draft-model speculation's draft length (mlx-lm's default is 2; ours the same on both)
STEP_SHAPES = {f"chain{k}": EagleGrowth.chain(k) for k in range(1, 5)} | {"tree60": EagleGrowth()}
TRAINED_SHAPES = {
    "chain3": EagleGrowth.chain(3),
    "chain5": EagleGrowth.chain(5),
    "tree60": EagleGrowth(),
}
VERIFY_ROWS = [1, 2, 3, 4, 5, 8, 16, 32, 64]
GROUP = 64  # quantization group size, as mlx-lm's default

# Qwen2.5-0.5B's shapes on Llama-3.1-8B's vocabulary: the 8B target's draft.
LLAMA_DRAFT = {k: v for k, v in QWEN25_05B.items() if not k.endswith("token_id")} | {
    "vocab_size": LLAMA31_8B["vocab_size"]
}
# --quick's stand-ins: the same kinds, smaller. SmolLM2 with 3 of its 30 layers; a small 4-bit
# Llama and its smaller draft (on a CPU a 4-bit matmul costs in proportion to its rows, so a
# 60-node tree over a wide 4-bit model takes minutes there).
SMOLLM2_QUICK = SMOLLM2_135M | {"num_hidden_layers": 3}
LLAMA_QUICK = LLAMA31_8B | {
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 8192,
}
LLAMA_QUICK_DRAFT = LLAMA_DRAFT | {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 8192,
}


@dataclass(frozen=True)
class Target:
    name: str
    config: dict | None  # random weights in these shapes; None: the real stories260K
    bits: int | None = None
    draft: dict | None = None  # a random draft model's shapes
    draft_vocab: int | None = None  # the random EAGLE-3 head's vocabulary (None: the target's)
    note: str = ""


TARGETS = {
    "full": [
        Target("stories260K", None, note="real checkpoint, float32; draft llama2xs281K"),
        Target("smollm2", SMOLLM2_135M, draft_vocab=4096, note="SmolLM2-135M shapes"),
        Target(
            "llama8b",
            LLAMA31_8B,
            bits=4,
            draft=LLAMA_DRAFT,
            draft_vocab=32000,
            note="Llama-3.1-8B shapes, 4-bit; draft: Qwen2.5-0.5B shapes",
        ),
    ],
    "quick": [
        Target("stories260K", None, note="real checkpoint, float32; draft llama2xs281K"),
        Target("smollm2", SMOLLM2_QUICK, draft_vocab=4096, note="SmolLM2-135M, 3 of 30 layers"),
        Target(
            "llama8b",
            LLAMA_QUICK,
            bits=4,
            draft=LLAMA_QUICK_DRAFT,
            draft_vocab=2048,
            note="stand-in: hidden 256, 4 layers, vocab 8192, 4-bit; draft: hidden 128, 2 layers",
        ),
    ],
}
# Per mode: tokens per run by target, timed rounds, and the seconds the targets share: each
# target's timed rounds stop (after one) at its share's end, a target after the budget is skipped.
SETTINGS = {
    "full": ({"stories260K": 256, "smollm2": 128, "llama8b": 128}, 3, 420),
    "quick": ({"stories260K": 96, "smollm2": 24, "llama8b": 24}, 2, 480),
    "dry-run": ({"stories260K": 4}, 1, 60),
}
VERIFY_RUNS = {"full": 20, "quick": 5, "dry-run": 3}


def write_random_folder(
    folder: Path, config: dict, dtype: mx.Dtype, bits: int | None, seed: int
) -> Path:
    """A checkpoint both loaders read: N(0, 0.02) weights (norms at one) in `dtype`, linear
    and embedding weights quantized to `bits` when given (scales in `dtype`), and stories260K's
    tokenizer grown to the vocabulary with placeholder pieces and no EOS, so that any token
    detokenizes and a random model runs to `max_tokens`. One tensor is built at a time."""
    module = model_class(config)
    model = module.Model(module.ModelArgs.from_dict(config))  # lazy init: never evaluated
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    weights = {}
    for (name, p), key in zip(params, keys, strict=True):
        if name.endswith("norm.weight"):
            w = mx.ones(p.shape, dtype)
        else:
            w = (0.02 * mx.random.normal(p.shape, key=key)).astype(dtype)
        if bits and name.endswith(".weight") and p.ndim == 2 and p.shape[-1] % GROUP == 0:
            base = name.removesuffix(".weight")
            q, scales, biases = mx.quantize(w, group_size=GROUP, bits=bits)
            new = {name: q, f"{base}.scales": scales, f"{base}.biases": biases}
        else:
            new = {name: w}
        mx.eval(list(new.values()))
        weights |= new
    folder.mkdir(parents=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    del weights
    saved = config | ({"quantization": {"group_size": GROUP, "bits": bits}} if bits else {})
    (folder / "config.json").write_text(json.dumps(saved, indent=2))
    write_grown_tokenizer(folder, config["vocab_size"])
    return folder


def write_grown_tokenizer(folder: Path, vocab_size: int) -> None:
    """stories260K's tokenizer grown to `vocab_size` with placeholder pieces and no EOS (both
    loaders read it; any token detokenizes, and a random model runs to `max_tokens`)."""
    tokenizer = json.loads((STORIES / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab |= {f"\u2581w{i}": i for i in range(len(vocab), vocab_size)}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    settings = json.loads((STORIES / "tokenizer_config.json").read_text())
    settings["eos_token"] = None
    settings["added_tokens_decoder"].pop("2")
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))


def random_eagle_head(model, config: dict, draft_vocab: int | None):
    """An untrained EAGLE-3 head of the target's shapes (its taps explicit, so that shallow
    stand-ins get three), in the target's compute dtype."""
    keep = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "head_dim",
        "max_position_embeddings",
    )
    layer = {k: config[k] for k in keep if k in config} | {"num_hidden_layers": 1}
    layers = config["num_hidden_layers"]
    taps = official_taps(layers)
    taps = taps if len(taps) == 3 else (0, layers // 2, layers - 1)
    head = eagle_head(EagleConfig(version=3, layer=layer, draft_vocab_size=draft_vocab, taps=taps))
    head.set_dtype(model.compute_dtype)
    mx.eval(head.parameters())
    return head
