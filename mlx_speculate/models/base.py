"""What every model family shares: config parsing, the attention core and the forward contract.

One forward serves prefill, one-token decode, chain verification and tree verification:

    model(tokens, cache, *, positions=None, mask=None, taps=()) -> ModelOutput

`positions` are rotary positions per token (default: consecutive from `cache.offset`); they are
kept apart from cache slots, which are always `offset .. offset + L`. `mask` is an additive
(L, offset + L) mask over cached + new keys, or a bool (L, M) visibility among the last M >= L
slots, the new tokens last (a draft tree's earlier levels before them; older slots are the
committed prefix, seen by all), default causal. Attention spans the cache's whole capacity
(a compiled step's view: its leading `attended` slots) under a mask built on the device from
the slot start, so shapes depend on (L, capacity) alone.
`taps` names decoder layers whose *entering* hidden state (the residual stream before the
layer, transformers' `hidden_states[i]`) the output carries, for drafters that read the
target's features (EAGLE-3 taps layers 2, L//2 and L-3); `hidden`, the final-norm output,
is always there.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cache import KVCache
from .rope import RotaryEmbedding, native, rope_parameters
from .stage import WHOLE, Stage


@dataclass(frozen=True)
class ModelOutput:
    logits: mx.array  # (B, L, V)
    hidden: mx.array  # (B, L, hidden): the final-norm output, i.e. the input of lm_head
    taps: tuple[mx.array, ...] = ()  # (B, L, hidden) entering each requested layer, in order


@dataclass
class BaseModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_parameters: dict[str, Any] | None = None
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    original_max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    use_sliding_window: bool = False
    max_window_layers: int | None = None
    layer_types: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> BaseModelArgs:
        """The fields `config` sets; ValueError naming a field whose value has the wrong type
        (`"hidden_size": "64"`), before it can reach an array shape."""
        names = inspect.signature(cls).parameters
        values = {k: v for k, v in config.items() if k in names and k != "extra"}
        hints = typing.get_type_hints(cls)
        for name, value in values.items():
            allowed = _allowed_types(hints[name])
            if allowed and not (
                isinstance(value, allowed) and (bool in allowed or not isinstance(value, bool))
            ):
                kinds = " or ".join(t.__name__ for t in allowed if t is not type(None))
                raise ValueError(f"config field {name!r} must be {kinds}, got {value!r}")
        return cls(**values)

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    def rope_config(self) -> dict[str, Any]:
        config = {
            "rope_theta": self.rope_theta,
            "rope_parameters": self.rope_parameters,
            "rope_scaling": self.rope_scaling,
            "partial_rotary_factor": self.partial_rotary_factor,
        }
        if self.original_max_position_embeddings is not None:
            config["original_max_position_embeddings"] = self.original_max_position_embeddings
        return rope_parameters(config)

    def sliding_layers(self) -> tuple[bool, ...]:
        """Which layers attend within `sliding_window` (HF semantics per family)."""
        return (False,) * self.num_hidden_layers


def _allowed_types(hint: Any) -> tuple[type, ...]:
    """Runtime types a field annotated `hint` accepts (an int where a float is due); () for
    annotations it does not check."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    allowed: list[type] = []
    for option in options:
        option = typing.get_origin(option) or option  # dict[str, Any] -> dict
        if option is Any:
            return ()
        allowed += [float, int] if option is float else [option]
    return tuple(allowed)


@dataclass(frozen=True)
class ForwardContext:
    """Per-forward state every layer reads: built once, passed down as an argument.

    Fixed shapes: new keys go to cache slot `start` (an int32 array), attention reads the
    whole cache capacity under `mask`, so the graph depends on (rows, capacity) only. `end`
    is the host's start + rows (None inside a compiled step, where the host reserved room).
    """

    cache: KVCache | None
    start: mx.array  # () int32: the first new slot
    end: int | None
    positions: mx.array | None
    seq_len: int  # largest rotary position + 1: what dynamic / longrope frequencies depend on
    mask: mx.array | str | None  # additive (..., L, capacity), or "causal" without a cache
    window_mask: mx.array | None  # set when a sliding-window layer must mask old keys
    sliding: tuple[bool, ...]
    span: int | None = None  # leading cache slots attention reads (None: all of them)
    # RoPE tables per rotary embedding (by id), built by the first layer that needs them
    rotations: dict[int, tuple[mx.array, ...]] = field(default_factory=dict, compare=False)

    def rotation(self, rope: RotaryEmbedding, length: int, dtype: mx.Dtype) -> tuple:
        """`rope`'s tables for this forward (RotaryEmbedding.tables), shared by its layers."""
        if id(rope) not in self.rotations:
            freqs = rope.freqs(self.seq_len)
            tables = rope.tables(self.start, self.positions, length, freqs, dtype)
            self.rotations[id(rope)] = tables
        return self.rotations[id(rope)]


def additive_mask(allowed: mx.array, dtype: mx.Dtype, prefix: int = 0) -> mx.array:
    """(..., N, M) bool -> (..., N, prefix + M) additive mask: 0 where allowed and on `prefix`
    leading keys (a committed prefix every query sees), else the dtype's most negative finite
    value, since -inf can turn into NaN inside fused attention kernels."""
    mask = mx.where(allowed, mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))
    if prefix == 0:
        return mask
    return mx.concatenate([mx.zeros((*mask.shape[:-1], prefix), dtype=dtype), mask], axis=-1)


def build_context(
    rope: RotaryEmbedding,
    cache: KVCache | None,
    length: int,
    positions: mx.array | None,
    mask: mx.array | None,
    window: int | None,
    sliding: tuple[bool, ...],
    dtype: mx.Dtype,
) -> ForwardContext:
    """The context of a forward of `length` new tokens. With a cache, keys are written at
    `start` (default: the cache's offset) and attention spans the whole capacity: `mask`
    says who sees whom: a bool (..., L, M) visibility among the last M slots (the new ones
    last; older slots are committed and seen by every new token), or the additive
    (..., L, offset + L) mask of the public contract (host offset only), or causal by
    default. A cache view (`KVCache.view`, inside a compiled step) carries its own array
    start: the host reserved room and no shape depends on the offset."""
    start = None if cache is None else cache.start
    offset = 0 if cache is None else cache.offset if start is None else None
    end = None if offset is None else offset + length
    if start is None:
        start = mx.array(offset or 0, dtype=mx.int32)
    seq_len = end if end is not None else rope.max_position_embeddings
    if rope.depends_on_length and (positions is not None or end is None):
        # A host sync, only for rope types whose frequencies depend on the largest position.
        last = positions.max() if positions is not None else start + length - 1
        seq_len = int(last.item()) + 1
    windowed = window is not None and any(sliding) and (end is None or end > window)
    if cache is None and not windowed and (mask is None or mask.dtype != mx.bool_):
        mask = None if mask is None else mask.astype(dtype)
        causal_mask = "causal" if mask is None and length > 1 else mask
        return ForwardContext(None, start, end, positions, seq_len, causal_mask, None, sliding)
    if cache is None:
        capacity = length
    elif end is not None:
        capacity = cache.capacity_for(end)
    else:  # a compiled step's view reads its leading `attended` slots (KVCache.span)
        capacity = cache.attended or cache.capacity
    slots = mx.arange(capacity, dtype=mx.int32)
    rel = slots - start  # (C,) index among the new tokens; < 0 for committed slots
    rows = mx.arange(length, dtype=mx.int32)
    causal = rel[None, :] <= rows[:, None]  # (L, C): committed slots and earlier new ones
    if mask is None or mask.dtype != mx.bool_:
        allowed = causal
        additive = None if mask is None else _to_capacity(mask.astype(dtype), capacity, offset)
    else:
        m = mask.shape[-1]  # the last m slots up to the new ones (m >= L)
        near = rel + (m - length)  # index among them; < 0 for the older, committed slots
        new = mx.take(mask, mx.clip(near, 0, m - 1), axis=-1)  # (..., L, C)
        allowed = (near < 0) | (new & (rel < length))
        additive = None
    window_mask = None
    if windowed:
        # Causal by cache slot, distance by rotary position (committed slots sit at their
        # positions, new ones at theirs): (B or 1, 1, L, C).
        q_pos = (start + rows if positions is None else positions).reshape(-1, length)
        k_pos = mx.where(rel < 0, slots, mx.take(q_pos, mx.clip(rel, 0, length - 1), axis=-1))
        near = q_pos[:, :, None] - k_pos[:, None, :] < window
        window_mask = additive_mask(allowed & near, dtype)[:, None]
        if additive is not None:
            window_mask = mx.minimum(window_mask, additive)
    if additive is None:
        additive = additive_mask(allowed, dtype)
    span = None if cache is None or end is not None else capacity
    return ForwardContext(
        cache, start, end, positions, seq_len, additive, window_mask, sliding, span
    )


def _to_capacity(mask: mx.array, capacity: int, offset: int | None) -> mx.array:
    """An additive (..., L, offset + L) mask padded to (..., L, capacity) with hidden slots."""
    if offset is None:
        raise ValueError("an additive mask over cached + new keys needs the cache's host offset")
    pad = capacity - mask.shape[-1]
    hidden = mx.full((*mask.shape[:-1], pad), mx.finfo(mask.dtype).min, dtype=mask.dtype)
    return mx.concatenate([mask, hidden], axis=-1)


def attend(
    ctx: ForwardContext,
    layer: int,
    rope: RotaryEmbedding,
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
) -> mx.array:
    """RoPE at the context's positions, cache write, SDPA. Takes (B, H, L, D) heads; `rope` is
    the layer's own (Gemma 3's local layers have another base)."""
    B, _, L, _ = queries.shape
    if native():
        freqs = rope.freqs(ctx.seq_len)
        queries = rope(queries, ctx.start, ctx.positions, freqs)
        keys = rope(keys, ctx.start, ctx.positions, freqs)
    else:
        tables = ctx.rotation(rope, L, queries.dtype)
        queries, keys = rope.rotate(queries, tables), rope.rotate(keys, tables)
    if ctx.cache is not None:
        keys, values = ctx.cache.write(layer, keys, values, ctx.start, ctx.end)
        if ctx.span is not None and ctx.span < keys.shape[2]:
            keys, values = keys[..., : ctx.span, :], values[..., : ctx.span, :]
    mask = ctx.window_mask if ctx.window_mask is not None and ctx.sliding[layer] else ctx.mask
    out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    return out.transpose(0, 2, 1, 3).reshape(B, L, -1)  # (B, L, H * D)


class TransformerBlock(nn.Module):
    """Pre-norm decoder block shared by Llama, Qwen2, Qwen3 and Phi-3 (HF parameter names)."""

    def __init__(self, args: BaseModelArgs, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, ctx: ForwardContext, layer: int) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), ctx, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


# (layer index, the stack's rope) -> decoder block; (size, eps) -> norm.
BlockFactory = Callable[[int, RotaryEmbedding], nn.Module]
NormFactory = Callable[..., nn.Module]


class DecoderStack(nn.Module):
    """Embeddings (times `embed_scale` where the family scales them), the family's blocks and
    the final norm: every family is built by this one path."""

    def __init__(
        self,
        args: BaseModelArgs,
        block: BlockFactory,
        norm: NormFactory = nn.RMSNorm,
        embed_scale: float | None = None,
    ):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self._rope = RotaryEmbedding(
            args.head_dim, args.rope_config(), args.max_position_embeddings
        )
        self.layers = [block(i, self._rope) for i in range(args.num_hidden_layers)]
        self.norm = norm(args.hidden_size, eps=args.rms_norm_eps)
        self._sliding = args.sliding_layers()
        self._embed_scale = embed_scale
        self.stage: Stage = WHOLE  # all layers; `keep` sets a pipeline block

    def keep(self, stage: Stage, block: slice) -> None:
        """Drops every layer but `block`, this process's (pipeline.py; from stage.start on)."""
        self.layers, self._sliding, self.stage = self.layers[block], self._sliding[block], stage

    def __call__(
        self,
        tokens: mx.array,
        cache: KVCache | None,
        positions: mx.array | None,
        mask: mx.array | None,
        taps: tuple[int, ...],
    ) -> tuple[mx.array, tuple[mx.array, ...]]:
        for i in taps:
            if not 0 <= i < (n := self.args.num_hidden_layers):
                raise ValueError(f"cannot tap layer {i} of a {n}-layer model")
        h = self.embed_tokens(tokens)
        if self._embed_scale is not None:
            h = h * mx.array(self._embed_scale, h.dtype)  # rounded to the compute dtype, as HF
        ctx = build_context(
            self._rope, cache, tokens.shape[1], positions, mask, self.args.sliding_window,
            self._sliding, h.dtype,
        )  # fmt: skip
        h, first = self.stage.enter(h, cache), self.stage.start
        captured = {}
        for j, layer in enumerate(self.layers):  # j: the layer's index in this process
            if first + j in taps:
                captured[first + j] = h
            h = layer(h, ctx, j)
        if cache is not None:
            cache.advance(tokens.shape[1])
        h, shared = self.stage.leave(h, captured, taps, cache)
        return self.norm(h), shared


@dataclass(frozen=True)
class Origin:
    """Where `load` found a model: what drafter specs read (heads live beside it in `folder`;
    `tokenizer` checks a draft's fit). Models built otherwise have neither."""

    folder: Path | None = None
    tokenizer: Any = None


class CausalLM(nn.Module):
    """`model` (a DecoderStack of the family's blocks) plus the vocabulary projection, tied or
    not. A family's `Model` passes its block factory (and norm, embedding scale) here."""

    model: DecoderStack
    origin: Origin = Origin()  # set once by `load`

    def __init__(
        self,
        args: BaseModelArgs,
        block: BlockFactory,
        norm: NormFactory = nn.RMSNorm,
        embed_scale: float | None = None,
    ):
        super().__init__()
        self.args = args
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.model = DecoderStack(args, block, norm, embed_scale)

    def __call__(
        self,
        tokens: mx.array,
        cache: KVCache | None = None,
        *,
        positions: mx.array | None = None,
        mask: mx.array | None = None,
        taps: tuple[int, ...] = (),
    ) -> ModelOutput:
        hidden, captured = self.model(tokens, cache, positions, mask, tuple(taps))
        return ModelOutput(self.project(hidden), hidden, captured)

    def project(self, hidden: mx.array) -> mx.array:
        """Final hidden states to logits (heads such as EAGLE reuse this)."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    @property
    def layers(self) -> list[nn.Module]:
        return self.model.layers

    @property
    def compute_dtype(self) -> mx.Dtype:
        """The dtype of its activations: what the embedding yields (a quantized one's scales)."""
        return self.model.embed_tokens(mx.array([0])).dtype

    def make_cache(self) -> KVCache:
        return KVCache(len(self.model.layers))

    def rename(self, name: str) -> str | None:
        """A checkpoint's parameter or module path in this model's names; None for what is not
        part of it (families with other checkpoint layouts map theirs here)."""
        if "rotary_emb.inv_freq" in name:
            return None
        if self.args.tie_word_embeddings and name.startswith("lm_head."):
            return None
        return name

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return {new: v for k, v in weights.items() if (new := self.rename(k)) is not None}
