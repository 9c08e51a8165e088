"""The whole recipe: data, features, training, official layout; each stage cached in `cache`.

    result = train_head("eagle1", "path/to/model", "out/", prompts="prompts.json")

`cache` (default: `<out>.cache` beside `out`) holds `data.jsonl` (shared by every head kind),
`features-<what>/` (the final states for EAGLE-1 and Medusa, the taps for EAGLE-3 and DFlash)
and `train-<kind>/checkpoint`; running the same call again resumes where the last one stopped,
and a call with other settings makes again the stages they change (keys.py). `out` must not
exist: it appears, whole, at the end. The settings themselves live in settings.py.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..device import roomy_cache
from ..heads.dflash import DFlashConfig, DFlashHead
from ..heads.dflash_format import save_dflash
from ..heads.eagle import Eagle1Head, Eagle3Head, EagleConfig, official_taps
from ..heads.eagle_format import save_official
from ..heads.medusa import MedusaHeads, save_medusa1
from ..loading import load
from ..models.base import CausalLM
from .data import data_key, make_data, read_prompts
from .features import Features, make_features
from .loop import check_checkpoint, train
from .memory import Peak, measured
from .objectives import dflash_loss, eagle1_loss, eagle3_loss, medusa_loss
from .payoff import Payoff, payoff
from .settings import DRAFT_VOCAB, KINDS, TRAINING, Recipe, TrainConfig, default_training

# MLX's buffer cache while training: a step's arrays are reused instead of faulted in again
# (the CPU allocator keeps 32 MB), but a bound, or each new batch shape's stays resident.
TRAIN_CACHE = 1 << 30
# The settings live in settings.py (no MLX there, for the CLI's flags); named here too.
__all__ = ["KINDS", "TRAINING", "Recipe", "Result", "TrainConfig", "default_training", "train_head"]


@dataclass(frozen=True)
class Result:
    out: Path
    seconds: dict[str, float]  # wall time per stage
    held_out_top1: float  # the best epoch's
    history: list[dict[str, Any]]
    tokens: int  # conversation tokens in the feature cache
    bytes_per_token: float  # the feature cache's disk cost
    peaks: dict[str, Peak]  # memory per stage
    payoff: Payoff  # the tokens a step its held-out accuracy promises, and whether that pays


def train_head(
    kind: str,
    model: str | Path | CausalLM,
    out: str | Path,
    *,
    prompts: str | Path | None = None,
    cache: str | Path | None = None,
    recipe: Recipe | None = None,
    progress: bool = True,
) -> Result:
    """Trains a `kind` head for `model` (a folder or hub id, or a loaded model) from the
    target's answers to `prompts` (or its own samples, `recipe.self_samples`) and writes it to
    `out` in the official layout. Each stage is keyed by what it is built from (keys.py):
    one made from other inputs is made again, a checkpoint of another head is refused."""
    recipe = recipe or Recipe(kind)
    if recipe.kind != kind:
        raise ValueError(f"the recipe is for {recipe.kind!r}, not {kind!r}")
    out = Path(out)
    if out.exists():
        raise ValueError(f"the output folder {out} exists; name a new one")
    if (prompts is None) == (recipe.self_samples == 0):
        raise ValueError("give prompts or self_samples (not both)")
    texts = read_prompts(prompts) if prompts is not None else []
    cache = Path(cache) if cache is not None else out.with_name(out.name + ".cache")
    if isinstance(model, CausalLM):
        target, tokenizer = model, model.origin.tokenizer
    else:
        target, tokenizer = load(model)
    check_target(kind, target, recipe)
    taps = _taps(kind, target, recipe.taps, recipe.draft_layers)
    settings = dict(
        prompts=texts,
        self_samples=recipe.self_samples,
        sample_prefix=recipe.sample_prefix,
        max_tokens=recipe.max_tokens,
        temperature=recipe.temperature,
        seed=recipe.train.seed,
        batch=recipe.data_batch,
    )
    folder = cache / f"train-{kind}"
    key = head_key(recipe, taps, data_key(target, tokenizer, **settings))
    check_checkpoint(folder, key)  # before hours of data and features, not after
    cache.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    peaks: dict[str, Peak] = {}

    @contextmanager
    def stage(name: str) -> Iterator[None]:
        start = time.perf_counter()
        with measured(peaks, name):
            yield
        seconds[name] = time.perf_counter() - start
        if progress:
            print(f"{name}: {seconds[name]:.1f} s, {peaks[name].describe()}", flush=True)

    with stage("data"):
        data = make_data(target, tokenizer, cache, progress=progress, **settings)
    with stage("features"):
        width = target.args.hidden_size * max(1, len(taps))
        what = "taps-" + "-".join(map(str, taps)) if taps else "final"
        features = make_features(
            target, data, cache / f"features-{what}", taps, width, recipe.top_k, progress
        )
    del data
    source = str(target.origin.folder or "")
    head, loss_fn, frozen = build(kind, target, features, recipe, taps)
    # Training reads the target's embedding and lm_head only (in `frozen`): a target loaded
    # here is released, its layers' weights with it.
    del target
    gc.collect()
    with stage("train"), roomy_cache(TRAIN_CACHE):
        state = train(head, loss_fn, frozen, features, folder, recipe.train, progress, key)
        if kind == "medusa":
            save_medusa1(head, out, source)
        elif kind == "dflash":
            save_dflash(head, out)
        else:
            save_official(head, out, recipe.layout)
    (out / "training.json").write_text(
        json.dumps(
            {"recipe": asdict(recipe), "seconds": seconds, "history": state.history},
            indent=2,
            default=str,
        )
    )
    n = features.tokens.shape[0]
    return Result(
        out,
        seconds,
        state.best,
        state.history,
        n,
        features.nbytes / max(1, n),
        peaks,
        payoff(state.best, recipe.drafts),
    )


def check_target(kind: str, target: CausalLM, recipe: Recipe) -> None:
    """ValueError, in a sentence, for a target this recipe cannot train a head for."""
    if target.recurrent:
        raise ValueError(
            f"training a {kind} head for a {target.args.model_type} target is not supported: "
            "its recurrent layers cannot run the left-padded, masked batches in which the data "
            "stage answers prompts (their state would take in the padding)"
        )
    context = target.args.max_position_embeddings
    if kind == "dflash" and recipe.block_size > context:
        raise ValueError(
            f"DFlash block size {recipe.block_size} is larger than the model's context of "
            f"{context} tokens"
        )
    vocab = target.args.vocab_size
    if kind == "eagle3" and recipe.draft_vocab is not None and recipe.draft_vocab > vocab:
        raise ValueError(
            f"draft vocabulary {recipe.draft_vocab} is larger than the target's vocabulary "
            f"of {vocab} tokens (it must be <= {vocab})"
        )


def head_key(recipe: Recipe, taps: tuple[int, ...], data: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint is and was trained from (keys.py): the data's key (its fields, so
    that a refusal names the flag that changed), the features' settings, the head's shape
    and the held-out split. Schedule settings (epochs, learning rate, batch tokens, ...) and
    the losses' (anchors, TTT steps) are not in it: a run may resume a checkpoint under new
    ones, as a second phase of training."""
    shape = {
        "eagle1": ("intermediate_size",),
        "eagle3": ("intermediate_size", "draft_vocab"),
        "medusa": ("medusa_heads", "medusa_layers"),
        "dflash": ("intermediate_size", "block_size", "draft_layers"),
    }[recipe.kind]
    return data | {
        "kind": recipe.kind,
        "top_k": recipe.top_k,
        "taps": list(taps),
        **{name: getattr(recipe, name) for name in shape},
        "seed": recipe.train.seed,
        "holdout": recipe.train.holdout,
    }


def _taps(
    kind: str, target: CausalLM, taps: tuple[int, ...] | None, draft_layers: int = 1
) -> tuple[int, ...]:
    """The target taps an EAGLE-3 head or a DFlash drafter reads (none for the others);
    ValueError when the target cannot feed it. EAGLE-3: by default the official 2, L//2 and
    L-3; under 7 layers these collapse (5 layers: layer 2 alone), and the states entering the
    last three layers go in instead (a small model's head predicts better from them).
    DFlash: `taps` names target layers whose outputs it reads (z-lab's target_layer_ids;
    default `dflash_layers`), the states entering the next layers."""
    layers = target.args.num_hidden_layers
    if kind == "dflash":
        ids = taps if taps is not None else dflash_layers(layers, draft_layers)
        if not ids or any(not 0 <= i < layers - 1 for i in ids):
            raise ValueError(
                f"DFlash reads outputs of layers 0 to {layers - 2} of a {layers}-layer target, "
                f"not {list(ids)}"
            )
        return tuple(i + 1 for i in ids)
    if kind != "eagle3":
        return ()
    if taps is None:
        if layers < 3:
            raise ValueError(
                f"EAGLE-3 taps layers 2, L//2 and L-3; the target has {layers} layers "
                "(train eagle1 or medusa, or name the taps)"
            )
        taps = official_taps(layers)
        if len(taps) < 3:
            taps = (layers - 3, layers - 2, layers - 1)
    if not taps or any(not 0 <= t < layers for t in taps):
        raise ValueError(f"EAGLE-3 taps {list(taps)} are not layers of a {layers}-layer target")
    return tuple(taps)


def dflash_layers(layers: int, draft_layers: int = 1) -> tuple[int, ...]:
    """The target layers a DFlash drafter reads by default: max(2, `draft_layers`) spread
    evenly from layer 1 to layer L - 2, the last whose output is not the final state (fewer
    where the target has fewer). Two at least: stories260K's one-layer drafter reading
    layers 1 and 3 learned faster than reading z-lab's one middle layer (docs/training.md).
    z-lab's own drafters read as many layers as they have, spread from 1 to L - 3."""
    if layers < 2:
        raise ValueError(
            f"a DFlash drafter reads a layer's output; a {layers}-layer target has none"
        )
    first, last = min(1, layers - 2), layers - 2
    count = min(max(2, draft_layers), last - first + 1)
    if count == 1:
        return (last,)
    return tuple(round(first + i * (last - first) / (count - 1)) for i in range(count))


def _layer(
    target: CausalLM, rope_theta: float | None, intermediate_size: int | None = None
) -> dict[str, Any]:
    """The draft layer's Llama config: the target's sizes (and, for EAGLE-1, its rope), its
    MLP `intermediate_size` wide where given."""
    a = target.args
    names = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "vocab_size",
        "max_position_embeddings",
    )
    layer = {name: getattr(a, name) for name in names} | {"num_hidden_layers": 1}
    if intermediate_size is not None:
        layer["intermediate_size"] = intermediate_size
    if rope_theta is not None:  # EAGLE-3: the official trainer's fixed base
        return layer | {"rope_theta": rope_theta}
    return layer | {"rope_theta": a.rope_theta, "rope_scaling": a.rope_scaling}


def _weight(layer: nn.Module) -> mx.array:
    """A (V, h) embedding or projection as float32, dequantized if need be."""
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        w = mx.dequantize(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits)
        return w.astype(mx.float32)
    return layer.weight.astype(mx.float32)


def draft_vocabulary(features: Features, size: int, vocab: int) -> np.ndarray:
    """The `size` most frequent answer tokens (ties and unseen fill: lowest ids), ascending."""
    counts = np.bincount(features.tokens[features.answer.astype(bool)], minlength=vocab)
    order = np.lexsort((np.arange(vocab), -counts))  # most frequent first, then lowest id
    return np.sort(order[:size])


def build(kind: str, target: CausalLM, features: Features, recipe: Recipe, taps: tuple[int, ...]):
    """(fresh head, its loss, the frozen arrays the loss reads); seeded, so a run and its
    resumption start alike."""
    mx.random.seed(recipe.train.seed)
    embed = _weight(target.model.embed_tokens)
    lm_head = embed if target.args.tie_word_embeddings else _weight(target.lm_head)
    vocab = target.args.vocab_size
    if kind == "medusa":
        # As Medusa starts: ResBlocks at zero (the identity), every projection a copy of the
        # target's lm_head, so each head first guesses "the next token".
        heads = MedusaHeads(
            target.args.hidden_size, vocab, recipe.medusa_heads, recipe.medusa_layers
        )
        for head in heads.heads:
            for block in head[:-1]:
                block.linear.weight = mx.zeros_like(block.linear.weight)
                block.linear.bias = mx.zeros_like(block.linear.bias)
            head[-1].weight = lm_head
        return heads, medusa_loss, ()
    if kind == "dflash":
        loss = partial(dflash_loss, anchors=recipe.anchors)
        return _dflash(target, features, recipe, taps), loss, (embed, lm_head)
    if kind == "eagle1":
        layer = _layer(target, None, recipe.intermediate_size)
        head = Eagle1Head(EagleConfig(version=1, layer=layer))
        return head, eagle1_loss, (embed, lm_head)
    draft = min(DRAFT_VOCAB, vocab) if recipe.draft_vocab is None else recipe.draft_vocab
    layer = _layer(target, 10000.0, recipe.intermediate_size)
    config = EagleConfig(
        version=3, layer=layer, taps=taps, draft_vocab_size=None if draft == vocab else draft
    )
    head = Eagle3Head(config)
    ids = draft_vocabulary(features, draft, vocab)
    head.lm_head.weight = lm_head[mx.array(ids)]  # start from the target's own rows
    t2d = np.full(vocab, -1, dtype=np.int32)
    t2d[ids] = np.arange(draft)
    if "d2t" in head:
        head.d2t = mx.array(ids - np.arange(draft), dtype=mx.int64)
        head.freeze(keys=["d2t"], strict=False)

    def loss(h, batch, embed, t2d, key):
        return eagle3_loss(h, batch, embed, t2d, key, steps=recipe.ttt_steps)

    return head, loss, (embed, mx.array(t2d))


def _dflash(
    target: CausalLM, features: Features, recipe: Recipe, taps: tuple[int, ...]
) -> DFlashHead:
    """A fresh DFlash drafter: `draft_layers` Qwen3 layers of the target's sizes and rope,
    reading the target layers before `taps`; its mask token is the one the answers use least
    (its embedding, the target's, is frozen, so a rare token disturbs the least)."""
    layer = _layer(target, None, recipe.intermediate_size) | {
        "num_hidden_layers": recipe.draft_layers
    }
    vocab = target.args.vocab_size
    counts = np.bincount(features.tokens, minlength=vocab)
    config = DFlashConfig(
        layer=layer,
        block_size=recipe.block_size,
        target_layer_ids=tuple(t - 1 for t in taps),
        mask_token_id=int(np.argmin(counts)),
        num_target_layers=target.args.num_hidden_layers,
    )
    return DFlashHead(config)
