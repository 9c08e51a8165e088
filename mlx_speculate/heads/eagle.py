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

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cache import KVCache
from ..models import llama, qwen2
from ..models.base import ForwardContext, build_context
from ..models.rope import RotaryEmbedding

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
        normed = self.hidden_norm(hidden)
        residual = normed if self._norm_before_residual else hidden
        x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)  # (B, L, 2h)
        h = residual + self.self_attn(x, ctx, 0)
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleHead(nn.Module):
    """One EAGLE draft head; `__call__` runs it over positions with its own KV cache."""

    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        args = config.args
        self.args = args
        h = args.hidden_size
        self._rope = RotaryEmbedding(
            args.head_dim, args.rope_config(), args.max_position_embeddings
        )
        if config.version == 1:
            self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
            self.layers = [
                Eagle1Layer(args, self._rope, first=i == 0) for i in range(args.num_hidden_layers)
            ]
            return
        if args.num_hidden_layers != 1:
            raise ValueError(
                f"EAGLE-3 heads have one midlayer; this one has {args.num_hidden_layers} layers"
            )
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

    @property
    def num_layers(self) -> int:
        return len(self.layers) if self.config.version == 1 else 1

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
    ) -> mx.array:
        """(B, L, h) embeddings of x_{t+1} and (B, L, F) states of position t -> (B, L, h) the
        head's output (its next hidden). `from_target`: `hidden` holds the target's features
        (EAGLE-3: the concatenated taps, through `fc`), else the head's own earlier output."""
        ctx = build_context(
            self._rope, cache, embeds.shape[1], positions, mask, None, (False,), embeds.dtype
        )
        if self.config.version == 1:
            x = self.fc(mx.concatenate([embeds, hidden], axis=-1))
            for i, layer in enumerate(self.layers):
                x = layer(x, ctx, i)
        else:
            if from_target:
                hidden = self._fuse(hidden)
            x = self.midlayer(embeds, hidden, ctx)
        cache.advance(embeds.shape[1])
        return x

    def _fuse(self, taps: mx.array) -> mx.array:
        """(..., n * h) concatenated target states -> (..., h)."""
        if "norm_before_fc" in self.config.flags:
            taps = self.input_norm(taps)
        if "fc_norm" in self.config.flags:
            parts = mx.split(taps, len(self.fc_norm), axis=-1)
            taps = mx.concatenate([n(p) for n, p in zip(self.fc_norm, parts, strict=True)], -1)
        return self.fc(taps)

    def feedback(self, out: mx.array) -> mx.array:
        """What the next level reads as its hidden: the output, normed with `norm_output`."""
        return self.norm(out) if "norm_output" in self.config.flags else out

    def draft_logits(self, out: mx.array) -> mx.array:
        """EAGLE-3: (..., h) -> (..., draft vocabulary) logits of its own lm_head."""
        return self.lm_head(self.norm(out))

    def to_target(self, draft_ids: mx.array) -> mx.array:
        """EAGLE-3 draft ids -> target ids."""
        if "d2t" not in self:
            return draft_ids
        return draft_ids + self.d2t[draft_ids].astype(draft_ids.dtype)
