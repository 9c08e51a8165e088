"""The multi-token-prediction (MTP) head that Qwen3-Next and Qwen3.5 checkpoints carry beside the
model (`mtp.*`), and reading it from a model folder.

One step (vLLM's `Qwen3NextMultiTokenPredictor`, `Qwen3_5MultiTokenPredictor`): at position t,
the embedding of token t+1 and the target's final-norm state at t, each RMS-normed, are
concatenated and projected (`fc`, 2h -> h), run through one full-attention decoder layer of the
family (gated attention with q/k norms, its dense MLP or mixture of experts) with its own KV
cache, and normed again (`norm`): the target's lm_head on that output predicts token t+2, and the
output is the state the next step reads at t+1 in place of the target's. The embedding and
lm_head are the target's own.

Checkpoint names: `mtp.fc.weight`, `mtp.pre_fc_norm_embedding.weight`,
`mtp.pre_fc_norm_hidden.weight`, `mtp.layers.0.*`, `mtp.norm.weight`. A transformers folder
keeps them among the model's tensors, its norms as (1 + weight) and its experts per expert or
fused, as the model's own layers (models/qwen3_next.py `mlx_layout`). A folder `convert` wrote
holds them in `mtp.safetensors` beside the model, in this module's form, quantized with the
model when it is: mlx-lm reads `model*.safetensors` and would refuse tensors it does not hold.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..cache import KVCache
from ..checkpoint import load_into, read_weights, write_safetensors
from ..loading import load_config, load_weights
from ..models import qwen3_next
from ..models.base import CausalLM
from ..models.context import ForwardContext, build_context
from ..models.rope import RotaryEmbedding
from ..models.wrapper import text_config

MTP_FILE = "mtp.safetensors"  # the head beside a converted model
PREFIXES = ("mtp.", "model.mtp.")  # where checkpoints keep the head (the first is the usual)
# Config keys that count the head's layers (Qwen3-Next's, Qwen3.5's).
LAYER_COUNTS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def has_mtp(model: CausalLM) -> bool:
    """Whether `model` belongs to a family whose checkpoints carry an MTP head."""
    return isinstance(model, qwen3_next.Model)


class MtpHead(nn.Module):
    """The head over a target of `args` (its sizes, rope and MLP kind): `fc`, the two pre-fc
    norms, `layers` (one decoder layer, full attention) and `norm`, in checkpoint names."""

    def __init__(self, args: qwen3_next.ModelArgs):
        super().__init__()
        self.args = args
        h, eps = args.hidden_size, args.rms_norm_eps
        self._rope = RotaryEmbedding(
            args.head_dim, args.rope_config(), args.max_position_embeddings
        )
        # The layer is built as layer 0 of the family (its MLP kind), with full attention.
        full = replace(args, layer_types=["full_attention"] * args.num_hidden_layers)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=eps)
        self.layers = [qwen3_next.DecoderLayer(full, 0, self._rope)]
        self.norm = nn.RMSNorm(h, eps=eps)

    @property
    def rope(self) -> RotaryEmbedding:
        return self._rope

    @property
    def traceable(self) -> bool:
        """Whether a step's graph can be independent of the host offset (models/base.py)."""
        return not self._rope.depends_on_length

    def make_cache(self) -> KVCache:
        args = self.args
        like = mx.zeros((1, args.num_key_value_heads, 0, args.head_dim), self.dtype)
        return KVCache(1, like=like)

    @property
    def dtype(self) -> mx.Dtype:
        """The dtype of its activations: its norms' (quantized layers keep float norms)."""
        return self.norm.weight.dtype

    def __call__(
        self,
        embeds: mx.array,
        hidden: mx.array,
        cache: KVCache,
        ctx: ForwardContext | None = None,
    ) -> mx.array:
        """(B, L, h) embeddings of tokens t+1 and (B, L, h) states of positions t (the target's
        final-norm output, or this head's own output a step before) -> (B, L, h) its output at
        t: lm_head's input for token t+2. Writes the cache from its offset (or a view's start)
        and advances it by L; `ctx`: a context built beforehand (`ForwardContext.row`)."""
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1
        )  # (B, L, 2h)
        x = self.fc(x)
        if ctx is None:
            ctx = build_context(self._rope, cache, x.shape[1], None, None, None, (False,), x.dtype)
        x = self.layers[0](x, ctx, 0)
        cache.advance(x.shape[1])
        return self.norm(x)


def mtp_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The head's tensors among a checkpoint's, in the head's names (`fc.weight`, ...), in this
    module's layout (transformers' norms and experts mapped as the model's own are)."""
    found = {}
    for name, value in weights.items():
        prefix = next((p for p in PREFIXES if name.startswith(p)), None)
        if prefix is not None:
            found["mtp." + name[len(prefix) :]] = value
    mapped = qwen3_next.mlx_layout(found, qwen3_next.transformers_layout(weights))
    return {k.removeprefix("mtp."): v for k, v in mapped.items()}


def check_config(config: dict[str, Any], where: str) -> None:
    """One-line ValueErrors for heads this module does not run: more than one layer, or
    embeddings of its own."""
    text = text_config(config)
    for key in LAYER_COUNTS:
        count = text.get(key)
        if count is not None and count != 1:
            raise ValueError(
                f"{where} says {key}={count}: MTP heads of one layer are supported, as "
                "Qwen3-Next and Qwen3.5 ship"
            )
    if text.get("mtp_use_dedicated_embeddings"):
        raise ValueError(
            f"{where} gives the MTP head embeddings of its own (mtp_use_dedicated_embeddings), "
            "which is not supported"
        )


def build_mtp(
    target: CausalLM,
    weights: dict[str, mx.array],
    config: dict[str, Any],
    where: str,
    dtype: mx.Dtype | None = None,
) -> MtpHead | None:
    """The head of a checkpoint's `weights` (None when they hold no `mtp.*`) for `target`,
    quantized where the weights are stored quantized (`config`'s `quantization`) and cast to
    `dtype`; ValueError in one line when it is not one this module runs or does not fit."""
    own = mtp_weights(weights)
    if not own:
        return None
    check_config(config, where)
    layers = {m[1] for k in own if (m := re.match(r"layers\.(\d+)\.", k))}
    if len(layers) != 1:
        raise ValueError(
            f"{where} holds an MTP head of {len(layers)} layers: heads of one layer are "
            "supported, as Qwen3-Next and Qwen3.5 ship"
        )
    quantization = config.get("quantization")
    if isinstance(quantization, dict):  # per-module overrides name checkpoint paths
        quantization = {
            next((k[len(p) :] for p in PREFIXES if k.startswith(p)), k): v
            for k, v in quantization.items()
        }
    head = MtpHead(target.args)
    return load_into(
        head, own, quantization=quantization, dtype=dtype, what=f"the MTP head of {where}"
    )


def head_file(folder: Path) -> dict[str, mx.array]:
    """The tensors of the head's own file in a model folder (none when it has no such file)."""
    path = folder / MTP_FILE
    return read_weights([path]) if path.is_file() else {}


def save_mtp(folder: Path, head: MtpHead) -> None:
    """Writes `head` into `folder`'s head file, in checkpoint names."""
    weights = {f"mtp.{k}": v for k, v in tree_flatten(head.parameters())}
    write_safetensors(folder / MTP_FILE, weights)


def load_mtp(folder: str | Path, target: CausalLM) -> MtpHead:
    """The MTP head in the model folder `folder` for `target` (in its compute dtype); a
    one-line ValueError naming what is missing when the folder holds none."""
    folder = Path(folder).expanduser()
    config = load_config(folder)
    weights = load_weights(folder) | head_file(folder)
    head = build_mtp(target, weights, config, str(folder), target.compute_dtype)
    if head is None:
        raise ValueError(
            f"{folder} holds no MTP weights (mtp.*; mlx-community conversions drop them): "
            "convert the original checkpoint with python -m mlx_speculate.convert, which keeps "
            "them, or name a folder that has them (--mtp DIR)"
        )
    return head
