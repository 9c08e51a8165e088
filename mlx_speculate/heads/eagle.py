"""EAGLE draft heads (SafeAILab/EAGLE `cnets1.Model` for EAGLE-1/2, `cnets.Model` for EAGLE-3).

EAGLE-1: `fc` maps cat(embed(x_{t+1}), f_t) (2h -> h), where f_t is the target's final-norm
state at position t, through `num_hidden_layers` Llama decoder layers (the first without an
input norm) into the target's own lm_head: the draft predicts x_{t+2}. Later tree levels feed
the head's own output back in place of f_t.

EAGLE-3: `fc` maps the concatenated target states entering a low, a middle and a high layer
(3h -> h); one `midlayer` attends over cat(input_layernorm(embed), hidden_norm(hidden)) (its
q/k/v take 2h) with the un-normed hidden as residual; `norm` and the head's own `lm_head` give
logits over a reduced draft vocabulary, and `d2t` maps draft ids to target ids (target id =
draft id + d2t[draft id]). Later levels feed the midlayer's output back without `fc`.

The head takes the target's token embedding (official releases may carry a frozen copy, which
is dropped on reading). Parameter names are the official ones (`heads/eagle_format.py` reads
the speculators layout into them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cache import KVCache
from ..models import llama, qwen2
from ..models.base import CausalLM
from ..models.context import ForwardContext, build_context
from ..models.rope import RotaryEmbedding
from .linear import batch_weights

# Speculators' normalisation options for EAGLE-3 (all off in SafeAILab's heads).
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


@dataclass(frozen=True)
class EagleConfig:
    """Everything that shapes a head, in the MLX heads folder's `config.json` form."""

    version: int  # 1 (EAGLE-1/2) or 3
    layer: dict[str, Any]  # HF Llama config of the draft layer(s): sizes, rope, eps, biases
    draft_vocab_size: int | None = None  # EAGLE-3's own vocabulary (None: the target's)
    taps: tuple[int, ...] | None = None  # EAGLE-3's target layers (None: 2, L//2, L-3)
    fc_bias: bool = False
    flags: tuple[str, ...] = ()  # the NORM_FLAGS that are on

    def __post_init__(self) -> None:
        if self.version not in (1, 3):
            raise ValueError(f"EAGLE version {self.version} is not supported (supported: 1, 3)")
        unknown = set(self.flags) - set(NORM_FLAGS)
        if unknown:
            raise ValueError(f"unknown EAGLE-3 options {sorted(unknown)}")

    @property
    def args(self) -> llama.ModelArgs:
        # Official configs say `qkv_bias` for biases on q/k/v only (Qwen2's layout).
        family = (
            qwen2 if self.layer.get("qkv_bias") and not self.layer.get("attention_bias") else llama
        )
        try:
            return family.ModelArgs.from_dict({**self.layer, "model_type": family.__name__})
        except TypeError as e:  # a required size is absent
            raise ValueError(f"EAGLE head config is incomplete: {e}") from e

    def to_json(self) -> dict[str, Any]:
        return {
            **self.layer,
            "eagle_version": self.version,
            "draft_vocab_size": self.draft_vocab_size,
            "eagle_aux_hidden_state_layer_ids": None if self.taps is None else list(self.taps),
            "fc_bias": self.fc_bias,
            **{flag: flag in self.flags for flag in NORM_FLAGS},
        }

    @classmethod
    def from_json(cls, config: dict[str, Any]) -> EagleConfig:
        taps = config.get("eagle_aux_hidden_state_layer_ids")
        own = {"eagle_version", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "fc_bias"}
        return cls(
            version=config["eagle_version"],
            layer={k: v for k, v in config.items() if k not in own | set(NORM_FLAGS)},
            draft_vocab_size=config.get("draft_vocab_size"),
            taps=None if taps is None else tuple(taps),
            fc_bias=bool(config.get("fc_bias", False)),
            flags=tuple(f for f in NORM_FLAGS if config.get(f)),
        )


class Eagle1Layer(nn.Module):
    """A Llama decoder layer; EAGLE-1's first one has no input norm (fc's output goes in)."""

    def __init__(self, args: llama.ModelArgs, rope: RotaryEmbedding, first: bool):
        super().__init__()
        self.self_attn = llama.Attention(args, rope)
        self.mlp = llama.MLP(args)
        if not first:
            self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self._first = first

    def __call__(self, x: mx.array, ctx: ForwardContext, layer: int) -> mx.array:
        h = x + self.self_attn(x if self._first else self.input_layernorm(x), ctx, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Layer(nn.Module):
    """EAGLE-3's midlayer: attention over [input_layernorm(embed); hidden_norm(hidden)]."""

    def __init__(self, args: llama.ModelArgs, rope: RotaryEmbedding, norm_before_residual: bool):
        super().__init__()
        attn = llama.Attention(args, rope)
        width = 2 * args.hidden_size
        attn.q_proj = nn.Linear(width, attn.n_heads * attn.head_dim, bias=args.qkv_bias)
        attn.k_proj = nn.Linear(width, attn.n_kv_heads * attn.head_dim, bias=args.qkv_bias)
        attn.v_proj = nn.Linear(width, attn.n_kv_heads * attn.head_dim, bias=args.qkv_bias)
        self.self_attn = attn
        self.mlp = llama.MLP(args)
        eps = args.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)
        self._norm_before_residual = norm_before_residual

    def __call__(self, embeds: mx.array, hidden: mx.array, ctx: ForwardContext) -> mx.array:
        x, residual = self.mix(embeds, hidden)
        return self.finish(residual + self.self_attn(x, ctx, 0))

    def mix(self, embeds: mx.array, hidden: mx.array) -> tuple[mx.array, mx.array]:
        """The attention's (B, L, 2h) input and the (B, L, h) residual."""
        normed = self.hidden_norm(hidden)
        residual = normed if self._norm_before_residual else hidden
        return mx.concatenate([self.input_layernorm(embeds), normed], axis=-1), residual

    def finish(self, h: mx.array) -> mx.array:
        """The MLP block after attention."""
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleHead(nn.Module):
    """What both EAGLE heads share: one level over positions with the head's own KV cache
    (`__call__`), the feedback a next level reads, logits and their ids on the target's
    vocabulary. `Eagle1Head` and `Eagle3Head` differ only behind these methods."""

    layer_prefix: str  # the draft layer's key prefix in official checkpoints

    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        args = config.args
        self.args = args
        self._rope = RotaryEmbedding(
            args.head_dim, args.rope_config(), args.max_position_embeddings
        )

    @property
    def rope(self) -> RotaryEmbedding:
        return self._rope

    @property
    def num_layers(self) -> int:
        raise NotImplementedError

    @property
    def traceable(self) -> bool:
        """Whether a level's graph can be independent of the host offset: its rope
        frequencies do not depend on the largest position."""
        return not self._rope.depends_on_length

    def make_cache(self) -> KVCache:
        return KVCache(self.num_layers)

    def __call__(
        self,
        embeds: mx.array,
        hidden: mx.array,
        cache: KVCache,
        *,
        from_target: bool,
        positions: mx.array | None = None,
        mask: mx.array | None = None,
        ctx: ForwardContext | None = None,
    ) -> mx.array:
        """(B, L, h) embeddings of x_{t+1} and (B, L, F) states of position t -> (B, L, h) the
        head's output (its next hidden). `from_target`: `hidden` is what `inputs` made of the
        target's features, else the head's own `feedback`. `ctx`: a context built beforehand
        (`ForwardContext.row`) in place of one from `positions` and `mask`."""
        if ctx is None:
            ctx = build_context(
                self._rope, cache, embeds.shape[1], positions, mask, None, (False,), embeds.dtype
            )
        x = self._level(embeds, hidden, ctx, from_target)
        cache.advance(embeds.shape[1])
        return x

    def _level(
        self, embeds: mx.array, hidden: mx.array, ctx: ForwardContext, from_target: bool
    ) -> mx.array:
        raise NotImplementedError

    def taps(self, num_layers: int) -> tuple[int, ...]:
        """The target layers whose entering states `inputs` reads, for a target this deep."""
        return ()

    def inputs(self, hidden: mx.array, taps: Sequence[mx.array]) -> mx.array:
        """(n, F) the rows a first level reads from the target's final states and taps."""
        raise NotImplementedError

    def feedback(self, out: mx.array) -> mx.array:
        """What the next level reads as its hidden."""
        return out

    def logits(self, out: mx.array, target: CausalLM) -> mx.array:
        """(..., h) outputs -> (..., V) logits over the head's vocabulary."""
        raise NotImplementedError

    def to_target(self, ids: mx.array) -> mx.array:
        """Ids of the head's vocabulary -> the target's."""
        return ids

    def check_fits(self, target: CausalLM) -> tuple[int, ...]:
        """Raises ValueError unless the head reads the target's states and speaks its
        vocabulary; returns the target layers it taps."""
        args = target.args
        if self.args.hidden_size != args.hidden_size:
            raise ValueError(
                f"EAGLE heads read hidden size {self.args.hidden_size}, the target's is "
                f"{args.hidden_size}"
            )
        if self.args.vocab_size != args.vocab_size:
            raise ValueError(
                f"EAGLE heads predict a vocabulary of {self.args.vocab_size}, the target's is "
                f"{args.vocab_size}"
            )
        return self._check_taps(args.num_hidden_layers, args.hidden_size, args.vocab_size)

    def _check_taps(self, layers: int, hidden: int, vocab: int) -> tuple[int, ...]:
        return ()


class Eagle1Head(EagleHead):
    """EAGLE-1/2 (`cnets1.Model`): fc over cat(embed, feature), decoder layers, the target's
    lm_head."""

    layer_prefix = "layers.0"

    def __init__(self, config: EagleConfig):
        super().__init__(config)
        args = self.args
        h = args.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
        self.layers = [
            Eagle1Layer(args, self._rope, first=i == 0) for i in range(args.num_hidden_layers)
        ]
        batch_weights(self)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _level(
        self, embeds: mx.array, hidden: mx.array, ctx: ForwardContext, from_target: bool
    ) -> mx.array:
        x = self.fc(mx.concatenate([embeds, hidden], axis=-1))
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, i)
        return x

    def inputs(self, hidden: mx.array, taps: Sequence[mx.array]) -> mx.array:
        return hidden

    def logits(self, out: mx.array, target: CausalLM) -> mx.array:
        return target.project(out)


class Eagle3Head(EagleHead):
    """EAGLE-3 (`cnets.Model`): fc over the concatenated taps, one midlayer, its own norm and
    lm_head over the draft vocabulary, `d2t` onto the target's."""

    layer_prefix = "midlayer"

    def __init__(self, config: EagleConfig):
        super().__init__(config)
        args = self.args
        if args.num_hidden_layers != 1:
            raise ValueError(
                f"EAGLE-3 heads have one midlayer; this one has {args.num_hidden_layers} layers"
            )
        h = args.hidden_size
        taps = 3 if config.taps is None else len(config.taps)
        flags = set(config.flags)
        if "norm_before_fc" in flags:
            self.input_norm = nn.RMSNorm(taps * h, eps=args.rms_norm_eps)
        if "fc_norm" in flags:
            self.fc_norm = [nn.RMSNorm(h, eps=args.rms_norm_eps) for _ in range(taps)]
        self.fc = nn.Linear(taps * h, h, bias=config.fc_bias)
        self.midlayer = Eagle3Layer(args, self._rope, "norm_before_residual" in flags)
        self.norm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        vocab = config.draft_vocab_size or args.vocab_size
        self.lm_head = nn.Linear(h, vocab, bias=False)
        if config.draft_vocab_size not in (None, args.vocab_size):
            self.d2t = mx.zeros((vocab,), dtype=mx.int64)
        batch_weights(self)

    @property
    def num_layers(self) -> int:
        return 1

    def _level(
        self, embeds: mx.array, hidden: mx.array, ctx: ForwardContext, from_target: bool
    ) -> mx.array:
        if from_target:
            hidden = self.fuse(hidden)
        return self.midlayer(embeds, hidden, ctx)

    def fuse(self, taps: mx.array) -> mx.array:
        """(..., n * h) concatenated target states -> (..., h)."""
        if "norm_before_fc" in self.config.flags:
            taps = self.input_norm(taps)
        if "fc_norm" in self.config.flags:
            parts = mx.split(taps, len(self.fc_norm), axis=-1)
            taps = mx.concatenate([n(p) for n, p in zip(self.fc_norm, parts, strict=True)], -1)
        return self.fc(taps)

    def taps(self, num_layers: int) -> tuple[int, ...]:
        return self.config.taps or official_taps(num_layers)

    def inputs(self, hidden: mx.array, taps: Sequence[mx.array]) -> mx.array:
        return mx.concatenate(list(taps), axis=-1)

    def feedback(self, out: mx.array) -> mx.array:
        return self.norm(out) if "norm_output" in self.config.flags else out

    def logits(self, out: mx.array, target: CausalLM) -> mx.array:
        return self.draft_logits(out)

    def draft_logits(self, out: mx.array) -> mx.array:
        """(..., h) -> (..., draft vocabulary) logits of its own lm_head."""
        return self.lm_head(self.norm(out))

    def to_target(self, ids: mx.array) -> mx.array:
        if "d2t" not in self:
            return ids
        return ids + self.d2t[ids].astype(ids.dtype)

    def _check_taps(self, layers: int, hidden: int, vocab: int) -> tuple[int, ...]:
        taps = self.taps(layers)
        if any(not 0 <= t < layers for t in taps):
            raise ValueError(f"EAGLE-3 heads tap layers {list(taps)}; the target has {layers}")
        fc = self.fc  # a quantized layer packs its input dimension
        width = fc.scales.shape[-1] * fc.group_size if "scales" in fc else fc.weight.shape[-1]
        if width != len(taps) * hidden:
            raise ValueError(
                f"EAGLE-3 heads read {width // hidden} target states, the config taps "
                f"{len(taps)} layers ({list(taps)})"
            )
        if "d2t" in self:
            ids = mx.arange(self.d2t.shape[0])
            top = mx.max(ids + self.d2t).item()
            if mx.min(ids + self.d2t).item() < 0 or top >= vocab:
                raise ValueError(
                    f"EAGLE-3 d2t maps draft ids to {top}, past the target's vocabulary"
                )
        return tuple(taps)


def official_taps(layers: int) -> tuple[int, ...]:
    """The official EAGLE-3 taps of a `layers`-deep target: the states entering layers 2,
    L//2 and L-3 (each once), in order."""
    return tuple(sorted({2, layers // 2, layers - 3}))


HEADS: dict[int, type[EagleHead]] = {1: Eagle1Head, 3: Eagle3Head}


def eagle_head(config: EagleConfig) -> EagleHead:
    """An untrained head of the config's version."""
    return HEADS[config.version](config)
