"""gpt-oss (HF `GptOssForCausalLM`): biased q/k/v/o projections, a learned sink logit per
head in every attention softmax, sliding-window and full layers alternating (`layer_types`,
default sliding first), YaRN RoPE, and a mixture of experts in every layer: a biased linear
router, softmax over its top `num_experts_per_tok` logits, experts with biases and a clamped
SwiGLU, (up + 1) * gate * sigmoid(alpha * gate), gate clamped above and up on both sides at
`swiglu_limit`.

Experts are stored as mlx-lm names them (`mlp.experts.{gate,up,down}_proj.{weight,bias}`,
(E, out, in)); transformers saves them fused and transposed (`mlp.experts.gate_up_proj`,
(E, hidden, 2 * intermediate), gate and up interleaved column by column), split at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .base import BaseModelArgs, CausalLM, TransformerBlock, attend
from .context import ForwardContext
from .experts import SwitchGLU, top_k
from .llama import Attention as LlamaAttention
from .rope import RotaryEmbedding

# transformers' GptOssConfig default rope (theta: its `default_theta`, 150000).
_YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
_FUSED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


@dataclass
class ModelArgs(BaseModelArgs):
    # transformers' GptOssConfig defaults.
    num_hidden_layers: int = 36
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_attention_heads: int = 64
    vocab_size: int = 201_088
    num_key_value_heads: int | None = 8
    head_dim: int | None = 64
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131_072
    rope_theta: float = 150_000.0
    sliding_window: int | None = 128
    attention_bias: bool = True
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    hidden_act: str = "silu"

    def __post_init__(self):
        super().__post_init__()
        if self.rope_parameters is None and self.rope_scaling is None:
            self.rope_parameters = dict(_YARN)
        if self.layer_types is None:
            self.layer_types = [
                "sliding_attention" if (i + 1) % 2 else "full_attention"
                for i in range(self.num_hidden_layers)
            ]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types names {len(self.layer_types)} layers, the model has "
                f"{self.num_hidden_layers}"
            )
        if self.hidden_act != "silu":
            raise ValueError(
                f"gpt-oss hidden_act {self.hidden_act!r} is not supported (supported: silu)"
            )
        if self.sliding_window is not None and self.sliding_window < 1:  # None: no window
            raise ValueError(
                f"config field 'sliding_window' must be >= 1, got {self.sliding_window}"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(
                f"config field 'num_experts_per_tok' must be in 1..num_local_experts "
                f"({self.num_local_experts}), got {self.num_experts_per_tok}"
            )

    def sliding_layers(self) -> tuple[bool, ...]:
        if self.sliding_window is None:
            return (False,) * self.num_hidden_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)


class Attention(LlamaAttention):
    def __init__(self, args: ModelArgs, rope: RotaryEmbedding):
        super().__init__(args, rope)
        self.sinks = mx.zeros((args.num_attention_heads,))

    def __call__(self, x: mx.array, ctx: ForwardContext, layer: int) -> mx.array:
        q, k, v = self.heads(x)
        out = attend(ctx, layer, self._rope, q, k, v, self.scale, self.sinks)
        return self.o_proj(out)


class ClampedSwiGLU(nn.Module):
    """gpt-oss's expert activation, in SwitchGLU's argument order (up, gate)."""

    def __init__(self, alpha: float, limit: float):
        super().__init__()
        self._alpha, self._limit = alpha, limit

    def __call__(self, up: mx.array, gate: mx.array) -> mx.array:
        from mlx_lm.models.activations import swiglu_oai  # as experts.SwitchGLU: a lazy import

        return swiglu_oai(gate, up, alpha=self._alpha, limit=self._limit)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.router = nn.Linear(args.hidden_size, args.num_local_experts, bias=True)
        activation = ClampedSwiGLU(args.swiglu_alpha, args.swiglu_limit)
        self.experts = SwitchGLU(
            args.hidden_size, args.intermediate_size, args.num_local_experts, activation, True
        )

    def __call__(self, x: mx.array) -> mx.array:
        logits, indices = top_k(self.router(x), self.top_k)  # (B, L, k)
        weights = mx.softmax(logits, axis=-1, precise=True)
        y = self.experts(x, indices)  # (B, L, k, hidden)
        return (y * weights[..., None]).sum(axis=-2)


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(
            args, lambda _, rope: TransformerBlock(args, Attention(args, rope), MLP(args))
        )

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """transformers' fused, transposed expert tensors split into mlx-lm's layout
        (`weights` is consumed; each new tensor is read at once, so that the fused one is
        freed before the next is read)."""
        for i in range(self.args.num_hidden_layers):
            prefix = f"model.layers.{i}.mlp.experts"
            fused = {name: weights.pop(f"{prefix}.{name}", None) for name in _FUSED}
            if fused["gate_up_proj"] is None:
                continue  # mlx-lm's layout already
            if any(v is None for v in fused.values()):
                missing = next(n for n, v in fused.items() if v is None)
                raise ValueError(f"the checkpoint has no {prefix}.{missing}")
            gate_up, gate_up_bias = fused["gate_up_proj"], fused["gate_up_proj_bias"]
            split = {
                "gate_proj.weight": gate_up[..., ::2].swapaxes(-1, -2),  # (E, I, hidden)
                "up_proj.weight": gate_up[..., 1::2].swapaxes(-1, -2),
                "gate_proj.bias": gate_up_bias[..., ::2],
                "up_proj.bias": gate_up_bias[..., 1::2],
                "down_proj.weight": fused["down_proj"].swapaxes(-1, -2),  # (E, hidden, I)
                "down_proj.bias": fused["down_proj_bias"],
            }
            del fused, gate_up, gate_up_bias
            for name, value in split.items():
                weights[f"{prefix}.{name}"] = mx.contiguous(value)
                mx.eval(weights[f"{prefix}.{name}"])
        return super().sanitize(weights)

    def mlx_lm_layout(
        self, config: dict[str, Any], weights: dict[str, mx.array]
    ) -> tuple[dict[str, Any], dict[str, mx.array]]:
        """mlx-lm's gpt-oss reads `layer_types` and `sliding_window` (its defaults otherwise)
        and hard-codes the SwiGLU's alpha and limit: a folder with others would load there
        and compute something else."""
        args = self.args
        if (args.swiglu_alpha, args.swiglu_limit) != (1.702, 7.0):
            raise ValueError(
                f"mlx-lm's gpt_oss computes swiglu_alpha 1.702 and swiglu_limit 7.0; this model "
                f"has {args.swiglu_alpha} and {args.swiglu_limit}"
            )
        fields = (
            "layer_types",
            "sliding_window",
            "head_dim",
            "num_local_experts",
            "num_experts_per_tok",
            "rms_norm_eps",
        )
        return {**config, **{k: getattr(args, k) for k in fields}}, weights
