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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from ..cache import KVCache
from .attention import scaled_dot_product_attention
from .context import ForwardContext, build_context
from .rope import LENGTH_DEPENDENT, RotaryEmbedding, native, rope_parameters
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

    @property
    def qkv_bias(self) -> bool:
        """Whether the q, k and v projections have biases (HF `attention_bias`; Qwen2's
        differ from its output projection's)."""
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        """Whether the attention's output projection has a bias."""
        return self.attention_bias

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


def attend(
    ctx: ForwardContext,
    layer: int,
    rope: RotaryEmbedding,
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    sinks: mx.array | None = None,
    softcap: float | None = None,
) -> mx.array:
    """RoPE at the context's positions, cache write, SDPA. Takes (B, H, L, D) heads; `rope` is
    the layer's own (Gemma 3's local layers have another base); `sinks`, gpt-oss's per-head
    sink logits, `softcap`, Gemma 2's score capping (attention.py)."""
    queries, keys = rotate(ctx, rope, queries, keys)
    keys, values = store(ctx, layer, keys, values)
    return attention(ctx, layer, queries, keys, values, scale, sinks, softcap)


def rotate(ctx: ForwardContext, rope: RotaryEmbedding, *heads: mx.array) -> tuple[mx.array, ...]:
    """(B, H, L, D) `heads` rotated by `rope` at the context's positions."""
    if native():
        freqs = rope.freqs(ctx.seq_len)
        return tuple(rope(x, ctx.start, ctx.positions, freqs) for x in heads)
    tables = ctx.rotation(rope, heads[0].shape[2], heads[0].dtype)
    return tuple(rope.rotate(x, tables) for x in heads)


def store(
    ctx: ForwardContext, layer: int, keys: mx.array, values: mx.array
) -> tuple[mx.array, mx.array]:
    """Writes `layer`'s new (B, H_kv, L, D) keys and values into the cache; returns what its
    attention reads (`KVCache.store`; the new ones alone without a cache)."""
    if ctx.cache is not None:
        keys, values = ctx.cache.store(layer, keys, values, ctx.start, ctx.end, ctx.span)
    return keys, values


def attention(
    ctx: ForwardContext,
    layer: int,
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    sinks: mx.array | None = None,
    softcap: float | None = None,
) -> mx.array:
    """SDPA of rotated (B, H, L, D) queries over what `store` returned, under `layer`'s mask
    (the window's on sliding layers); (B, L, H * D). Over a quantized cache's packed keys and
    values, its codec's attention (models/quantized_kv.py)."""
    B, _, L, _ = queries.shape
    mask = ctx.layer_mask(layer)
    codec = None if ctx.cache is None else ctx.cache.codec
    if codec is not None:
        out = codec.attention(queries, keys, values, scale, mask, sinks, softcap)
    else:
        out = scaled_dot_product_attention(queries, keys, values, scale, mask, sinks, softcap)
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
    the final norm: every family is built by this one path (a family with inputs for every
    layer besides the residual stream, Gemma 4, adds them in `layer_inputs`)."""

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

    @property
    def sliding(self) -> tuple[bool, ...]:
        """Whether each layer this process runs attends within the sliding window."""
        return self._sliding

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
        h = self.embed(tokens)
        ctx = build_context(
            self._rope,
            cache,
            tokens.shape[1],
            positions,
            mask,
            self.args.sliding_window,
            self._sliding,
            h.dtype,
        )
        extra = self.layer_inputs(tokens, h)
        if extra is not None:
            ctx = replace(ctx, layer_inputs=extra)
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

    def embed(self, tokens: mx.array) -> mx.array:
        """(B, L) tokens -> (B, L, hidden) input embeddings, times the family's scale (what a
        drafter that embeds tokens the target's way reads too)."""
        h = self.embed_tokens(tokens)
        if self._embed_scale is not None:
            h = h * mx.array(self._embed_scale, h.dtype)  # rounded to the compute dtype, as HF
        return h

    def layer_inputs(self, tokens: mx.array, embedded: mx.array) -> mx.array | None:
        """What every layer reads besides the residual stream, (B, L, layers, D), given the
        (B, L) tokens and their (scaled) embeddings: the context's `layer_inputs`; None here."""
        return None


def implementation_line(model: CausalLM) -> str:
    """What `--verbose` and the server's log say of the path a model took."""
    if model.implementation == "native":
        return f"model: {model.args.model_type}, native (every method)"
    return (
        f"model: {model.args.model_type}, through {model.implementation}'s module "
        "(chains from the target's logits: plain, draft model, prompt lookup)"
    )


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
    # Layers with recurrent state (hybrids): a HybridCache rolls back chains, never trees.
    recurrent: ClassVar[bool] = False
    # What runs its forward: "native", a family of this package (every method); "mlx-lm",
    # mlx-lm's own module (mlx_lm_model.py: chains from the target's logits only).
    implementation: ClassVar[str] = "native"

    def __init__(
        self,
        args: BaseModelArgs,
        block: BlockFactory,
        norm: NormFactory = nn.RMSNorm,
        embed_scale: float | None = None,
        stack: type[DecoderStack] = DecoderStack,
    ):
        super().__init__()
        self.args = args
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.model = stack(args, block, norm, embed_scale)

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
        dtype = self.compute_dtype
        likes = [mx.zeros((1, heads, 0, size), dtype) for heads, size in self.kv_shapes()]
        return KVCache(len(likes), like=likes, **self.kv_window())

    def kv_window(self) -> dict[str, Any]:
        """The sliding window and which cache layers (`kv_shapes`' order) attend within it:
        the `KVCache` keeps those as rings."""
        return {"window": self.args.sliding_window, "sliding": self.model.sliding}

    def kv_shapes(self) -> list[tuple[int, int]]:
        """(key/value heads, head size) of each cache layer: one per layer this process runs,
        as its attention holds them (tensor parallel leaves each rank its share of the heads);
        a family whose layers share caches lists only those that write one (Gemma 4)."""
        return [(layer.self_attn.n_kv_heads, layer.self_attn.head_dim) for layer in self.layers]

    @property
    def verifies_trees(self) -> bool:
        """Whether a verify forward may hold a draft tree (not where layers keep recurrent
        state, nor through mlx-lm's modules, which mask causally)."""
        return not self.recurrent and self.implementation == "native"

    @property
    def traceable(self) -> bool:
        """Whether a forward's graph can be independent of the host offset, so that a step
        compiles once per shape: not where rope frequencies depend on the largest position."""
        return self.args.rope_config()["rope_type"] not in LENGTH_DEPENDENT

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

    def mlx_lm_layout(
        self, config: dict[str, Any], weights: dict[str, mx.array]
    ) -> tuple[dict[str, Any], dict[str, mx.array]]:
        """The config and weights a converted folder holds, given this model's config and
        parameters: what mlx-lm's model of the type reads (families whose mlx-lm names or
        config keys differ from theirs map them here)."""
        return config, weights
