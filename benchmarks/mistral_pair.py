"""A random float32 Mistral target of mid size and a small Mistral draft of the same vocabulary,
as folders that this package and mlx-lm both load: the pair bench_pair.py's `--make-mistral`
times draft-model speculation on.

The target (hidden 1024, 12 layers, 16 query and 4 key/value heads of 64, MLP 2816, vocabulary
32,000, untied head, no sliding window, so mlx-lm's `llama`, which it reads `mistral` as,
computes the same thing) is built so that its next token follows mostly from the last one: its
attention and MLP outputs are scaled down (as tests/test_mtp.py's `markov_weights`). The draft
(hidden 256, 2 layers, MLP 704) shares the target's map from last token to next: the target's
embedding and head are the draft's times one 256 x 1024 matrix with orthonormal rows, so with
the mixers silent both give the same logits up to a positive scale. The mixers make the rest
of the context count for a little, so drafts are partly right; acceptance is whatever it is,
the same for both packages, which run the same pair. Tokenizer: stories260K's grown to the
vocabulary with no EOS (suite_targets.py), so that every run lasts its token count.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from suite_targets import write_grown_tokenizer

from mlx_speculate.loading import model_class

VOCAB = 32000
BASE = {
    "model_type": "mistral",
    "architectures": ["MistralForCausalLM"],
    "vocab_size": VOCAB,
    "head_dim": 64,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
}
TARGET = BASE | {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
}
DRAFT = BASE | {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
}
MIXERS = ("o_proj.weight", "down_proj.weight")  # what a layer writes into the residual stream
MIX = 0.05  # their scale against the other layers' N(0, 0.02)
SEED = 0


def write_mistral_pair(
    root: Path, mix: float = MIX, target_config: dict = TARGET, draft_config: dict = DRAFT
) -> tuple[Path, Path]:
    """Writes (once) `root`/mistral-target and `root`/mistral-draft; returns their folders.
    `mix` scales what the layers write into the residual stream (smaller: the next token
    follows more from the last one alone, and drafts are accepted more often). The configs
    (TARGET and DRAFT by default) share a vocabulary, the draft no wider than the target."""
    target, draft = root / "mistral-target", root / "mistral-draft"
    if (target / "config.json").exists() and (draft / "config.json").exists():
        return target, draft
    rng = np.random.default_rng(SEED)
    small, wide = draft_config["hidden_size"], target_config["hidden_size"]
    vocab = target_config["vocab_size"]
    if draft_config["vocab_size"] != vocab or small > wide:
        raise ValueError("the draft needs the target's vocabulary and no wider a hidden size")
    embed = rng.standard_normal((vocab, small), dtype=np.float32)
    head = 0.02 * rng.standard_normal((vocab, small), dtype=np.float32)
    q, _ = np.linalg.qr(rng.standard_normal((wide, small)))  # orthonormal columns
    lift = q.T.astype(np.float32)  # (small, wide): orthonormal rows
    ends = {"model.embed_tokens.weight": embed, "lm_head.weight": head}
    lifted = {k: mx.array(v @ lift) for k, v in ends.items()}
    _write(target, target_config, lifted, mix, SEED + 1)
    _write(draft, draft_config, {k: mx.array(v) for k, v in ends.items()}, mix, SEED + 2)
    return target, draft


def _write(folder: Path, config: dict, fixed: dict, mix: float, seed: int) -> None:
    module = model_class(config)
    model = module.Model(module.ModelArgs.from_dict(config))  # lazy init: never evaluated
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    weights = {}
    for (name, p), key in zip(params, keys, strict=True):
        if name in fixed:
            w = fixed[name]
        elif name.endswith("norm.weight"):
            w = mx.ones(p.shape)
        else:
            w = 0.02 * mx.random.normal(p.shape, key=key) * (mix if name.endswith(MIXERS) else 1)
        weights[name] = w.astype(mx.float32)
        mx.eval(weights[name])
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    write_grown_tokenizer(tmp, config["vocab_size"])
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
