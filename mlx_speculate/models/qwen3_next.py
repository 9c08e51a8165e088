"""Qwen3-Next (HF `Qwen3NextForCausalLM`): Gated DeltaNet layers (models/gated_delta.py)
interleaved with gated full attention (every `full_attention_interval`-th layer, or as
`layer_types` says), dense SwiGLU or mixture-of-experts MLPs with a gated shared expert.

Attention: a query projection twice as wide (queries, then a per-head output gate), RMSNorm per
head on queries and keys, partial RoPE, output times sigmoid(gate). RMSNorms scale by
(1 + weight) in transformers; parameters here hold the effective weight, as mlx-lm's do, so a
transformers checkpoint (told apart by its (channels, 1, kernel) conv weights) gets 1 added
at load. Experts are stacked (`switch_mlp`, mlx-lm's names and `SwitchGLU`): one gathered
(quantized) matmul per projection, each row routed on its own.

The recurrent layers keep their state in a `HybridCache` (state_cache.py); they can follow a
chain of verified rows but not a tree, so a tree mask is refused in one line.
`mtp.*` (the multi-token-prediction head) is not part of the model: heads/mtp.py reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from ..state_cache import HybridCache, chains_only
from .activations import silu
from .base import BaseModelArgs, CausalLM, ModelOutput, attend
from .context import ForwardContext
from .experts import SwitchGLU
from .gated_delta import GatedDeltaNet, state_shape
from .rope import RotaryEmbedding

# transformers' names of the (1 + weight) norms, whose checkpoints get 1 added.
SHIFTED_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    "mtp.norm.weight",  # the MTP head's (heads/mtp.py), which the model itself drops
    ".pre_fc_norm_embedding.weight",
    ".pre_fc_norm_hidden.weight",
)
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass
class ModelArgs(BaseModelArgs):
    # transformers' Qwen3NextConfig defaults (sparse configs rely on them).
    hidden_size: int = 2048
    num_hidden_layers: int = 48
    intermediate_size: int = 5632
    num_attention_heads: int = 16
    vocab_size: int = 151_936
    num_key_value_heads: int | None = 2
    head_dim: int | None = 256
    max_position_embeddings: int = 32_768
    partial_rotary_factor: float = 0.25
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    full_attention_interval: int | None = None
    num_experts: int | None = 512
    num_experts_per_tok: int | None = 10
    moe_intermediate_size: int | None = 512
    shared_expert_intermediate_size: int | None = 512
    decoder_sparse_step: int | None = 1
    norm_topk_prob: bool | None = True
    mlp_only_layers: list[int] | None = None
    hidden_act: str = "silu"

    def __post_init__(self):
        super().__post_init__()
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (supported: silu)")
        if self.layer_types is None:
            every = self.full_attention_interval or 4
            self.layer_types = [
                "full_attention" if (i + 1) % every == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            ]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types names {len(self.layer_types)} layers, the model has "
                f"{self.num_hidden_layers}"
            )
        unknown = set(self.layer_types) - {"full_attention", "linear_attention"}
        if unknown:
            raise ValueError(
                f"layer type {sorted(unknown)[0]!r} is not supported "
                "(supported: full_attention, linear_attention)"
            )

    def linear(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"

    def sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts (transformers' rule)."""
        return (
            layer not in (self.mlp_only_layers or [])
            and (self.num_experts or 0) > 0
            and (layer + 1) % (self.decoder_sparse_step or 1) == 0
        )


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, rope: RotaryEmbedding):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        self._rope = rope
        dim, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(dim, 2 * self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, ctx: ForwardContext, layer: int) -> mx.array:
        B, L, _ = x.shape
        q, gate = mx.split(self.q_proj(x).reshape(B, L, self.n_heads, -1), 2, axis=-1)
        q = self.q_norm(q).transpose(0, 2, 1, 3)  # (B, H, L, D)
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        out = attend(ctx, layer, self._rope, q, k, v, self.scale)  # (B, L, H * D)
        return self.o_proj(out * mx.sigmoid(gate.reshape(B, L, -1)))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """Softmax router over `num_experts`, top-k (renormalized when `norm_topk_prob`), stacked
    experts, plus a shared expert scaled by sigmoid(shared_expert_gate)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(dim, args.moe_intermediate_size, args.num_experts)
        self.shared_expert = MLP(dim, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        probs = mx.softmax(self.gate(x).astype(mx.float32), axis=-1)  # (B, L, E)
        chosen = mx.argpartition(-probs, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        scores = mx.take_along_axis(probs, chosen, axis=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        y = self.switch_mlp(x, chosen)  # (B, L, k, dim)
        y = (y * scores.astype(y.dtype)[..., None]).sum(axis=-2)
        return y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DeltaNet(GatedDeltaNet):
    """Qwen3-Next's projections: q|k|v|z fused and b|a fused, grouped per key head."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        dim = args.hidden_size
        self.in_proj_qkvz = nn.Linear(dim, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(dim, 2 * self.num_v_heads, bias=False)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        B, L, _ = x.shape
        nk, dk, per = self.num_k_heads, self.head_k_dim, self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).reshape(B, L, nk, -1)  # per key head: q, k, v, z
        q, k, v, z = mx.split(qkvz, [dk, 2 * dk, 2 * dk + per * self.head_v_dim], axis=-1)
        b, a = mx.split(self.in_proj_ba(x).reshape(B, L, nk, -1), [per], axis=-1)
        mixed = mx.concatenate([t.reshape(B, L, -1) for t in (q, k, v)], axis=-1)
        z = z.reshape(B, L, self.num_v_heads, self.head_v_dim)
        return mixed, z, b.reshape(B, L, -1), a.reshape(B, L, -1)


class DecoderLayer(nn.Module):
    """Pre-norm block whose token mixer is `linear_attn` (Gated DeltaNet) or `self_attn`."""

    def __init__(self, args: ModelArgs, layer: int, rope: RotaryEmbedding, delta_net=DeltaNet):
        super().__init__()
        self.linear = args.linear(layer)
        if self.linear:
            self.linear_attn = delta_net(args)
        else:
            self.self_attn = Attention(args, rope)
        if args.sparse(layer):
            self.mlp = SparseMoeBlock(args)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, ctx: ForwardContext, layer: int) -> mx.array:
        mixer = self.linear_attn if self.linear else self.self_attn
        h = x + mixer(self.input_layernorm(x), ctx, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(CausalLM):
    recurrent: ClassVar[bool] = True
    delta_net: ClassVar[type[GatedDeltaNet]] = DeltaNet

    def __init__(self, args: ModelArgs):
        super().__init__(args, lambda i, rope: DecoderLayer(args, i, rope, self.delta_net))

    def __call__(
        self,
        tokens: mx.array,
        cache: HybridCache | None = None,
        *,
        positions: mx.array | None = None,
        mask: mx.array | None = None,
        taps: tuple[int, ...] = (),
    ) -> ModelOutput:
        if mask is not None:  # a tree's (or any non-causal) visibility
            raise ValueError(chains_only(self.args.model_type))
        return super().__call__(tokens, cache, positions=positions, taps=taps)

    def make_cache(self) -> HybridCache:
        linear = [layer.linear for layer in self.model.layers]
        args = self.args
        like = mx.zeros((1, args.num_key_value_heads, 0, args.head_dim), self.compute_dtype)
        return HybridCache(linear, state_shape(args), args.model_type, like=like)

    def mlx_lm_layout(
        self, config: dict[str, Any], weights: dict[str, mx.array]
    ) -> tuple[dict[str, Any], dict[str, mx.array]]:
        """mlx-lm's qwen3_next requires the expert and DeltaNet fields transformers leaves to
        defaults (its qwen3_5 defaults them otherwise), places attention by
        `full_attention_interval` alone (no `layer_types`: the interval is taken from them) and
        reads the rotary fraction at the top level: written out, the fraction in both forms, as
        this model computes it."""
        args = self.args
        linear = [args.linear(i) for i in range(args.num_hidden_layers)]
        every = linear.index(False) + 1 if False in linear else len(linear) + 1
        if linear != [(i + 1) % every != 0 for i in range(len(linear))]:
            raise ValueError(
                f"mlx-lm's {args.model_type} places attention every full_attention_interval-th "
                "layer; this model's layer_types follow no interval"
            )
        sparse = [args.sparse(i) for i in range(args.num_hidden_layers)]
        rotary = args.rope_config()["partial_rotary_factor"]
        rope = {**(config.get("rope_parameters") or {}), "partial_rotary_factor": rotary}
        fields = {
            name: getattr(args, name)
            for name in (
                "linear_num_value_heads",
                "linear_num_key_heads",
                "linear_key_head_dim",
                "linear_value_head_dim",
                "linear_conv_kernel_dim",
                "num_experts_per_tok",
                "shared_expert_intermediate_size",
                "moe_intermediate_size",
                "norm_topk_prob",
                "rms_norm_eps",
                "num_key_value_heads",
                "max_position_embeddings",
                "head_dim",
                "tie_word_embeddings",
            )
        }
        fields |= {
            "full_attention_interval": every,
            "num_experts": args.num_experts if any(sparse) else 0,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, s in enumerate(sparse) if not s],
            "partial_rotary_factor": rotary,
            "rope_parameters": rope,
        }
        return {**config, **fields}, weights

    def rename(self, name: str) -> str | None:
        if name.startswith("mtp."):
            return None
        return super().rename(name)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """transformers' layout to this model's (`mlx_layout`); an MLX folder's passes as it is."""
        weights = super().sanitize(weights)
        return mlx_layout(weights, transformers_layout(weights))


def transformers_layout(weights: dict[str, mx.array]) -> bool:
    """Whether a checkpoint is laid out as transformers saves it: (C, 1, K) conv weights."""
    return any(k.endswith("conv1d.weight") and v.shape[-1] != 1 for k, v in weights.items())


def mlx_layout(weights: dict[str, mx.array], transformers: bool) -> dict[str, mx.array]:
    """Per-expert or fused `gate_up_proj` experts stacked as `switch_mlp`; with `transformers`,
    (C, 1, K) conv weights as (C, K, 1) and 1 added to the (1 + weight) norms."""
    out: dict[str, mx.array] = {}
    experts: dict[str, dict[int, mx.array]] = {}
    for k, v in weights.items():
        if ".mlp.experts." in k:
            prefix, rest = k.split(".mlp.experts.")
            if rest == "gate_up_proj":  # (E, 2 I, H): gate rows, then up rows
                gate, up = mx.split(v, 2, axis=-2)
                out[f"{prefix}.mlp.switch_mlp.gate_proj.weight"] = gate
                out[f"{prefix}.mlp.switch_mlp.up_proj.weight"] = up
            elif rest == "down_proj":
                out[f"{prefix}.mlp.switch_mlp.down_proj.weight"] = v
            else:  # "{e}.{projection}.weight"
                e, projection, _ = rest.split(".")
                experts.setdefault(f"{prefix}.mlp.switch_mlp.{projection}.weight", {})
                experts[f"{prefix}.mlp.switch_mlp.{projection}.weight"][int(e)] = v
            continue
        if k.endswith("conv1d.weight") and v.shape[-1] != 1:
            v = v.moveaxis(2, 1)  # (C, 1, K) -> (C, K, 1)
        if transformers and k.endswith(SHIFTED_NORMS) and v.ndim == 1:
            v = v + 1.0
        out[k] = v
    for name, per_expert in experts.items():
        out[name] = mx.stack([per_expert[e] for e in sorted(per_expert)])
    return out
