"""Gemma 4 text (HF `Gemma4ForCausalLM`, model_type `gemma4_text`) and the language model of
`gemma4` folders (`Gemma4ForConditionalGeneration`: `text_config`, `language_model` prefixes).

Gemma 3's block (embeddings times sqrt(hidden), norms before and after attention and MLP, q/k
norms, a GELU-tanh MLP, sliding layers interleaved with global ones by `layer_types`) with:
RMSNorms scaling by their weight (not 1 + weight), values normed without a scale, attention
scale 1; global layers with their own head size and key/value heads (`global_head_dim`,
`num_global_key_value_heads` with `attention_k_eq_v`, or transformers 5's `per_layer_config`)
and a `proportional` RoPE; with `attention_k_eq_v` global layers take their values from the key
projection. The last `num_kv_shared_layers` layers write no cache: each reads the keys and
values of the last earlier layer of its type (and has a double-wide MLP with
`use_double_wide_mlp`). Per-layer inputs (`hidden_size_per_layer_input`): a second embedding
of every token plus a projection of its embedding, one slice per layer, gated into the residual
stream after the MLP. Optionally a mixture of experts beside the MLP in every layer
(`enable_moe_block`: a scaled, normed router whose renormalised top-k weights carry a scale per
expert). Every layer's output is scaled by its `layer_scalar`; logits may be soft-capped.

Experts are stored under mlx-lm's names (`experts.switch_glu.{gate,up,down}_proj`);
transformers saves them fused (`experts.gate_up_proj`, (E, 2 * I, hidden), gate rows first),
split at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .activations import gelu_approx
from .base import (
    BaseModelArgs,
    BlockFactory,
    CausalLM,
    DecoderStack,
    NormFactory,
    attention,
    rotate,
    store,
)
from .context import ForwardContext
from .experts import SwitchGLU, top_k
from .rope import LAYER_TYPES, RotaryEmbedding, rope_parameters
from .stage import Stage
from .wrapper import under_language_model, unwrap

# Checkpoint prefixes of the language model inside `gemma4` folders (transformers, then
# mlx-vlm / mlx-community) and the parts of those folders that are not text.
_PREFIXES = (("model.language_model.", "model."), ("language_model.", ""))
_NOT_TEXT = (
    "vision_tower",
    "audio_tower",
    "multi_modal_projector",
    "embed_vision",
    "embed_audio",
    "vision_embedder",
)
_NOT_TEXT += tuple(f"model.{p}" for p in _NOT_TEXT)
# transformers' Gemma4TextConfig rope per layer type.
_DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1_000_000.0,
    },
}
_LAYER_OVERRIDES = ("head_dim", "num_key_value_heads")
# Config keys a converted folder leaves out: `per_layer_config` (mlx-lm reads the global
# shapes from `global_head_dim`, and transformers derives the same from it) and the legacy
# rope keys `rope_both_forms` adds for other families (transformers would rebuild Gemma 4's
# nested rope from a `rope_scaling` without a theta, and fail).
_NOT_WRITTEN = ("per_layer_config", "rope_scaling", "rope_theta", "rope_local_base_freq")
# What KV-sharing layers' checkpoints may still hold, unused.
_SHARED_PARTS = tuple(f"self_attn.{p}." for p in ("k_proj", "v_proj", "k_norm", "v_norm"))


@dataclass
class ModelArgs(BaseModelArgs):
    # transformers' Gemma4TextConfig defaults (sparse `text_config`s rely on them).
    vocab_size: int = 262_144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int | None = 4
    head_dim: int | None = 256
    max_position_embeddings: int = 131_072
    tie_word_embeddings: bool = True
    sliding_window: int | None = 512
    final_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    use_bidirectional_attention: str | None = None
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int | None = 256
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    enable_moe_block: bool = False
    use_double_wide_mlp: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    per_layer_config: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        if config.get("model_type") == "gemma4":
            # transformers ties the wrapper's head by its own flag, not the text config's.
            tied = config.get("tie_word_embeddings", True)
            text = config.get("text_config") or {}
            config = {**text, "model_type": "gemma4", "tie_word_embeddings": tied}
        return super().from_dict(config)

    def __post_init__(self):
        super().__post_init__()
        n = self.num_hidden_layers
        if self.layer_types is None:
            self.layer_types = [
                "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)
            ]
        if len(self.layer_types) != n:
            raise ValueError(f"layer_types names {len(self.layer_types)} layers, the model has {n}")
        if unknown := set(self.layer_types) - LAYER_TYPES:
            raise ValueError(f"layer type {sorted(unknown)[0]!r} is not supported")
        self.layer_types = [*self.layer_types[:-1], "full_attention"]  # as transformers forces
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(
                f"Gemma 4 hidden_activation {self.hidden_activation!r} is not supported "
                "(supported: gelu_pytorch_tanh)"
            )
        if self.use_bidirectional_attention == "all":
            raise ValueError("Gemma 4 with use_bidirectional_attention 'all' is not a causal LM")
        if self.sliding_window is None or self.sliding_window < 1:
            raise ValueError(
                f"config field 'sliding_window' must be >= 1, got {self.sliding_window}"
            )
        if not 0 <= self.num_kv_shared_layers < n:
            raise ValueError(
                f"config field 'num_kv_shared_layers' must be in 0..{n - 1} (some layer must "
                f"write the keys the others read), got {self.num_kv_shared_layers}"
            )
        if self.hidden_size_per_layer_input and self.vocab_size_per_layer_input < self.vocab_size:
            raise ValueError(
                f"config field 'vocab_size_per_layer_input' ({self.vocab_size_per_layer_input}) "
                f"is below vocab_size ({self.vocab_size}): ids past it have no per-layer input"
            )
        if self.enable_moe_block:
            for name in ("num_experts", "top_k_experts", "moe_intermediate_size"):
                if not isinstance(getattr(self, name), int):
                    raise ValueError(f"config field {name!r} must be an int with enable_moe_block")
            if not 1 <= self.top_k_experts <= self.num_experts:
                raise ValueError(
                    f"config field 'top_k_experts' must be in 1..num_experts "
                    f"({self.num_experts}), got {self.top_k_experts}"
                )
        self._shapes = self._layer_shapes()
        for i, (heads, size) in enumerate(self._shapes):
            if not (_positive(heads) and _positive(size)) or self.num_attention_heads % heads:
                raise ValueError(
                    f"layer {i} would have {heads!r} key/value heads of size {size!r}: each must "
                    f"be a positive int, the heads dividing num_attention_heads "
                    f"({self.num_attention_heads})"
                )
        self._sources = self._kv_sources()
        for i, source in enumerate(self._sources):
            if source is not None and self._shapes[i] != self._shapes[source]:
                raise ValueError(
                    f"layer {i} reads layer {source}'s keys, of another shape "
                    f"({self._shapes[source]} heads x size, not {self._shapes[i]})"
                )

    def _layer_shapes(self) -> list[tuple[int, int]]:
        """(key/value heads, head size) per layer, as transformers resolves them: its saved
        `per_layer_config` overrides, else `global_head_dim` (and, with `attention_k_eq_v`,
        `num_global_key_value_heads`) on the full-attention layers."""
        if self.per_layer_config is None:
            full = (self.num_key_value_heads, self.global_head_dim)
            if self.attention_k_eq_v and self.num_global_key_value_heads is not None:
                full = (self.num_global_key_value_heads, self.global_head_dim)
            plain = (self.num_key_value_heads, self.head_dim)
            return [full if t == "full_attention" else plain for t in self.layer_types]
        shapes = [(self.num_key_value_heads, self.head_dim)] * self.num_hidden_layers
        for key, overrides in self.per_layer_config.items():
            if not str(key).isdigit() or int(key) >= self.num_hidden_layers:
                raise ValueError(f"per_layer_config names layer {key!r} of {len(shapes)}")
            if not isinstance(overrides, dict) or set(overrides) - set(_LAYER_OVERRIDES):
                raise ValueError(
                    f"per_layer_config of layer {key} sets {overrides!r}; Gemma 4 layers may set "
                    f"{' and '.join(_LAYER_OVERRIDES)}"
                )
            heads, size = shapes[int(key)]
            shapes[int(key)] = (
                overrides.get("num_key_value_heads", heads),
                overrides.get("head_dim", size),
            )
        return shapes

    def _kv_sources(self) -> list[int | None]:
        """For each layer, the layer whose keys and values it reads (transformers'
        kv_sharing_modes: the last layer of its type before the shared ones), None when it
        writes its own."""
        first = self.num_hidden_layers - self.num_kv_shared_layers
        last = {t: i for i, t in enumerate(self.layer_types[:first])}
        sources: list[int | None] = [None] * first
        for i in range(first, self.num_hidden_layers):
            if self.layer_types[i] not in last:
                raise ValueError(
                    f"layer {i} ({self.layer_types[i]}) shares keys with no earlier layer of "
                    "its type (num_kv_shared_layers too large for layer_types)"
                )
            sources.append(last[self.layer_types[i]])
        return sources

    def kv_shape(self, layer: int) -> tuple[int, int]:
        """(key/value heads, head size) of `layer`."""
        return self._shapes[layer]

    def kv_source(self, layer: int) -> int | None:
        """The layer whose keys and values `layer` reads; None when it writes its own."""
        return self._sources[layer]

    def layer_rope(self, layer_type: str) -> dict[str, Any]:
        """The rope settings of `layer_type`'s layers (transformers 5 nests them by type)."""
        nested = self.rope_parameters
        if nested is None:
            nested = _DEFAULT_ROPE
        if not LAYER_TYPES & nested.keys():
            raise ValueError("Gemma 4 rope_parameters must be nested by layer type")
        if layer_type not in nested:
            raise ValueError(f"rope_parameters has no entry for {layer_type}")
        return rope_parameters({"rope_parameters": nested[layer_type]})

    def rope_config(self) -> dict[str, Any]:
        """The global layers' rope (what decides whether a forward can be traced)."""
        return self.layer_rope("full_attention")

    def sliding_layers(self) -> tuple[bool, ...]:
        return tuple(t == "sliding_attention" for t in self.layer_types)


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class RMSNorm(nn.Module):
    """Scales by its weight, in float32 like transformers, then back to the input dtype."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        weight = self.weight.astype(mx.float32)
        return mx.fast.rms_norm(x.astype(mx.float32), weight, self.eps).astype(x.dtype)


def rms_normed(x: mx.array, eps: float) -> mx.array:
    """x over its root mean square, without a scale (transformers' `with_scale=False`)."""
    return mx.fast.rms_norm(x.astype(mx.float32), None, eps).astype(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, index: int, rope: RotaryEmbedding, stores: bool):
        super().__init__()
        self.index = index
        self.reads = args.kv_source(index)  # None: it writes its own keys
        self.stores = stores  # whether later layers read its keys
        self.n_heads = args.num_attention_heads
        self.n_kv_heads, self.head_dim = args.kv_shape(index)
        self.scale = 1.0
        self.eps = args.rms_norm_eps
        self._rope = rope
        self._k_eq_v = args.attention_k_eq_v and args.layer_types[index] == "full_attention"
        dim, bias, size = args.hidden_size, args.attention_bias, self.head_dim
        self.q_proj = nn.Linear(dim, self.n_heads * size, bias=bias)
        self.q_norm = RMSNorm(size, eps=self.eps)
        if self.reads is None:
            self.k_proj = nn.Linear(dim, self.n_kv_heads * size, bias=bias)
            if not self._k_eq_v:
                self.v_proj = nn.Linear(dim, self.n_kv_heads * size, bias=bias)
            self.k_norm = RMSNorm(size, eps=self.eps)
        self.o_proj = nn.Linear(self.n_heads * size, dim, bias=bias)

    def __call__(self, x: mx.array, ctx: ForwardContext, layer: int) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        (q,) = rotate(ctx, self._rope, q)
        if self.reads is not None:
            k, v = ctx.kv[layer - (self.index - self.reads)]  # its source's, this forward
            return self.o_proj(attention(ctx, layer, q, k, v, self.scale))
        k, v = store(ctx, layer, *self.keys_values(x, ctx))
        if self.stores:
            ctx.kv[layer] = (k, v)
        return self.o_proj(attention(ctx, layer, q, k, v, self.scale))

    def keys_values(self, x: mx.array, ctx: ForwardContext) -> tuple[mx.array, mx.array]:
        """The (B, H_kv, L, D) keys (normed, rotated at the context's positions) and values
        (normed) this writing layer makes of its normed input `x` (B, L, hidden): what a
        Gemma 4 assistant drafter reads of the target (drafters/assistant.py)."""
        B, L, _ = x.shape
        raw = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        v = raw if self._k_eq_v else self.v_proj(x).reshape(B, L, self.n_kv_heads, -1)
        k = self.k_norm(raw).transpose(0, 2, 1, 3)  # (B, H_kv, L, D)
        v = rms_normed(v, self.eps).transpose(0, 2, 1, 3)
        (k,) = rotate(ctx, self._rope, k)
        return k, v


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class GeGLU(nn.Module):
    """gelu_tanh(gate) * up, in SwitchGLU's argument order (up, gate)."""

    def __call__(self, up: mx.array, gate: mx.array) -> mx.array:
        return gelu_approx(gate) * up


class Router(nn.Module):
    """Normed, scaled input -> softmax over the experts -> top k, renormalised, each times its
    expert's scale."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.proj = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.scale = mx.ones((args.hidden_size,))
        self.per_expert_scale = mx.ones((args.num_experts,))
        self._root, self._eps = args.hidden_size**-0.5, args.rms_norm_eps
        self._k = args.top_k_experts

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        x = rms_normed(x, self._eps) * self.scale * self._root
        probs = mx.softmax(self.proj(x).astype(mx.float32), axis=-1)  # (B, L, E), as HF: fp32
        weights, indices = top_k(probs, self._k)  # (B, L, k)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        return indices, weights * self.per_expert_scale[indices]


class Experts(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.switch_glu = SwitchGLU(
            args.hidden_size, args.moe_intermediate_size, args.num_experts, GeGLU()
        )

    def __call__(self, x: mx.array, indices: mx.array, weights: mx.array) -> mx.array:
        y = self.switch_glu(x, indices)  # (B, L, k, hidden)
        return (y * weights.astype(y.dtype)[..., None]).sum(axis=-2)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, index: int, self_attn: Attention):
        super().__init__()
        self.index = index
        self.self_attn = self_attn
        double = args.use_double_wide_mlp and self_attn.reads is not None
        self.mlp = MLP(args.hidden_size, args.intermediate_size * (2 if double else 1))
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps)
        self.post_feedforward_layernorm = RMSNorm(dim, eps)
        self.layer_scalar = mx.ones((1,))
        self._moe = args.enable_moe_block
        if self._moe:
            self.router = Router(args)
            self.experts = Experts(args)
            self.post_feedforward_layernorm_1 = RMSNorm(dim, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(dim, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(dim, eps)
        self._per_layer = bool(args.hidden_size_per_layer_input)
        if self._per_layer:
            width = args.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(dim, width, bias=False)
            self.per_layer_projection = nn.Linear(width, dim, bias=False)
            self.post_per_layer_input_norm = RMSNorm(dim, eps)

    def __call__(self, x: mx.array, ctx: ForwardContext, layer: int) -> mx.array:
        r = self.self_attn(self.input_layernorm(x), ctx, layer)
        h = x + self.post_attention_layernorm(r)
        r = self.mlp(self.pre_feedforward_layernorm(h))
        if self._moe:  # the experts beside the MLP, routed on the same input
            indices, weights = self.router(h)
            e = self.experts(self.pre_feedforward_layernorm_2(h), indices, weights)
            r = self.post_feedforward_layernorm_1(r) + self.post_feedforward_layernorm_2(e)
        h = h + self.post_feedforward_layernorm(r)
        if self._per_layer:
            gate = gelu_approx(self.per_layer_input_gate(h))
            gate = gate * ctx.layer_inputs[:, :, self.index, :]
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return h * self.layer_scalar


class TextModel(DecoderStack):
    """The decoder stack plus the per-layer inputs: a second, scaled embedding of each token
    and a normed projection of its embedding, averaged (1 / sqrt 2), one slice per layer."""

    def __init__(
        self, args: ModelArgs, block: BlockFactory, norm: NormFactory, embed_scale: float | None
    ):
        super().__init__(args, block, norm, embed_scale)
        self._width = width = args.hidden_size_per_layer_input
        if width:
            n, dim = args.num_hidden_layers, args.hidden_size
            self.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input, n * width)
            self.per_layer_model_projection = nn.Linear(dim, n * width, bias=False)
            self.per_layer_projection_norm = RMSNorm(width, eps=args.rms_norm_eps)

    def layer_inputs(self, tokens: mx.array, embedded: mx.array) -> mx.array | None:
        if not self._width:
            return None
        B, L = tokens.shape
        shape = (B, L, self.args.num_hidden_layers, self._width)
        dtype = embedded.dtype
        ids = self.embed_tokens_per_layer(tokens) * mx.array(self._width**0.5, dtype)
        projected = self.per_layer_model_projection(embedded) * self.args.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        return (projected + ids.reshape(shape)) * 2.0**-0.5  # (B, L, layers, width)

    def keep(self, stage: Stage, block: slice) -> None:
        """A pipeline block must hold the layers whose keys its layers read."""
        kept = range(self.args.num_hidden_layers)[block]
        for i in kept:
            source = self.args.kv_source(i)
            if source is not None and source not in kept:
                raise ValueError(
                    f"cannot split this Gemma 4 here: layer {i} reads layer {source}'s keys, "
                    f"which another rank holds (KV sharing): use fewer ranks, so that one "
                    f"holds layers {source} to {i}, or run it on one machine"
                )
        super().keep(stage, block)


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        ropes: dict[tuple[str, int], RotaryEmbedding] = {}
        for i, layer_type in enumerate(args.layer_types):
            size = args.kv_shape(i)[1]
            if (layer_type, size) not in ropes:
                params = args.layer_rope(layer_type)
                rope = RotaryEmbedding(size, params, args.max_position_embeddings)
                if layer_type == "sliding_attention" and rope.depends_on_length:
                    raise ValueError(
                        f"sliding_attention rope_type {rope.rope_type!r} is not supported"
                    )
                ropes[layer_type, size] = rope
        sources = {s for i in range(args.num_hidden_layers) if (s := args.kv_source(i)) is not None}

        def block(i: int, _) -> TransformerBlock:
            rope = ropes[args.layer_types[i], args.kv_shape(i)[1]]
            return TransformerBlock(args, i, Attention(args, i, rope, stores=i in sources))

        super().__init__(
            args, block, norm=RMSNorm, embed_scale=args.hidden_size**0.5, stack=TextModel
        )

    def kv_shapes(self) -> list[tuple[int, int]]:
        """Only the layers that write keys have a cache layer (the first ones)."""
        return [
            (layer.self_attn.n_kv_heads, layer.self_attn.head_dim)
            for layer in self.layers
            if layer.self_attn.reads is None
        ]

    def kv_window(self) -> dict[str, Any]:
        """As `kv_shapes`, only the layers that write keys."""
        sliding = [
            s
            for s, layer in zip(self.model.sliding, self.layers, strict=True)
            if layer.self_attn.reads is None
        ]
        return {"window": self.args.sliding_window, "sliding": tuple(sliding)}

    def project(self, hidden: mx.array) -> mx.array:
        logits = super().project(hidden)
        cap = self.args.final_logit_softcapping
        return logits if cap is None else mx.tanh(logits / cap) * cap

    def rename(self, name: str) -> str | None:
        name = unwrap(name, _PREFIXES, _NOT_TEXT)
        if name is None:
            return None
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        if layer.isdigit() and rest.startswith(_SHARED_PARTS):
            if int(layer) < self.args.num_hidden_layers and self.args.kv_source(int(layer)):
                return None  # a KV-sharing layer's unused projections (transformers skips them)
        return super().rename(name)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """transformers' fused expert tensors split into mlx-lm's layout (`weights` is
        consumed; each new tensor is read at once, so that the fused one is freed first)."""
        for key in [k for k in weights if k.endswith(".experts.gate_up_proj")]:
            base = key.removesuffix(".gate_up_proj")
            gate_up, down = weights.pop(key), weights.pop(f"{base}.down_proj", None)
            if down is None:
                raise ValueError(f"the checkpoint has no {base}.down_proj")
            half = gate_up.shape[-2] // 2  # (E, 2 * I, hidden): gate rows, then up rows
            split = {"gate_proj": gate_up[:, :half], "up_proj": gate_up[:, half:]}
            split["down_proj"] = down
            del gate_up, down
            for name, value in split.items():
                weights[f"{base}.switch_glu.{name}.weight"] = mx.contiguous(value)
                mx.eval(weights[f"{base}.switch_glu.{name}.weight"])
            del split
        return super().sanitize(weights)

    def mlx_lm_layout(
        self, config: dict[str, Any], weights: dict[str, mx.array]
    ) -> tuple[dict[str, Any], dict[str, mx.array]]:
        """mlx-lm's gemma4_text computes the global layers' shapes from `global_head_dim` and
        `num_global_key_value_heads` (not `per_layer_config`), has biasless attention, and
        defaults other fields unlike transformers (a soft cap of 30, 20 shared layers, a
        double-wide MLP): they are written out. Its `gemma4` reads the top-level
        `vocab_size` (else 262144) and the language model's names under `language_model.`."""
        args = self.args
        if args.attention_bias:
            raise ValueError("mlx-lm's gemma4_text has no attention biases; this model has them")
        full = [args.kv_shape(i) for i, t in enumerate(args.layer_types) if t == "full_attention"]
        global_heads, global_size = full[0]
        plain = (args.num_key_value_heads, args.head_dim)
        expected = [
            (global_heads if args.attention_k_eq_v else plain[0], global_size)
            if t == "full_attention"
            else plain
            for t in args.layer_types
        ]
        if [args.kv_shape(i) for i in range(args.num_hidden_layers)] != expected:
            raise ValueError(
                "mlx-lm's gemma4_text gives every global layer one shape and the others "
                "num_key_value_heads x head_dim; this model's per_layer_config does not"
            )
        fields = {
            name: getattr(args, name)
            for name in (
                "layer_types",
                "sliding_window",
                "head_dim",
                "num_key_value_heads",
                "final_logit_softcapping",
                "num_kv_shared_layers",
                "use_double_wide_mlp",
                "hidden_size_per_layer_input",
                "vocab_size_per_layer_input",
                "attention_k_eq_v",
                "enable_moe_block",
                "num_experts",
                "top_k_experts",
                "moe_intermediate_size",
                "rms_norm_eps",
                "tie_word_embeddings",
                "max_position_embeddings",
            )
        }
        fields |= {
            "global_head_dim": global_size,
            "num_global_key_value_heads": global_heads if args.attention_k_eq_v else None,
            "rope_parameters": {t: args.layer_rope(t) for t in sorted(set(args.layer_types))},
        }
        if config.get("model_type") != "gemma4":
            config = {k: v for k, v in config.items() if k not in _NOT_WRITTEN}
            return {**config, **fields}, weights
        text = {k: v for k, v in (config.get("text_config") or {}).items() if k not in _NOT_WRITTEN}
        config = {k: v for k, v in config.items() if k not in _NOT_WRITTEN + ("rope_parameters",)}
        config |= {"vocab_size": args.vocab_size, "text_config": {**text, **fields}}
        return under_language_model(config, weights)
