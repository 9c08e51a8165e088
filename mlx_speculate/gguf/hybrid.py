"""llama.cpp's Gated DeltaNet hybrids `qwen3next`, `qwen35` and `qwen35moe` as HF ones.

What convert_hf_to_gguf.py (Qwen3NextModel and its Qwen3.5 subclasses) changed, undone here:

- `A_log` is stored as `ssm_a` = -exp(A_log), `dt_bias` as `ssm_dt.bias`, the (C, 1, K) conv
  weight squeezed to (C, K) (MLX's conv wants (C, K, 1)).
- RMSNorms stored as 1 + w (all but the DeltaNet's gated norm): that is the effective weight
  the models here and mlx-lm hold, so they stay as stored.
- Qwen3-Next's `in_proj_qkvz`, grouped per key head as [q, k, v, z], is split into `attn_qkv`
  ([all q, all k, all v]) and `attn_gate` (z): regrouped.
- Qwen3.5 with fewer key than value heads has its value heads reordered from grouped by key
  head to tiled ([k0, k1, k0, k1, ...], for ggml's broadcast) in every tensor that holds them:
  the v rows of `attn_qkv` and of the conv, `attn_gate`, `ssm_alpha`, `ssm_beta`, `ssm_a`,
  `ssm_dt` and the columns of `ssm_out`.

Every `full_attention_interval`-th layer is full attention, the others DeltaNet layers (the
tensors are checked to agree); the blocks without a router have a dense MLP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .moe import EXPERT_LAYER, dense_layers, expert_config, split_gate_up
from .spec import LLAMA_LAYER, QK_NORMS, Architecture, blocks_with, required
from .tensors import Value, concat_rows, take_columns, take_rows

_LAYER = {
    **{k: v for k, v in LLAMA_LAYER.items() if k != "ffn_norm"},
    **QK_NORMS,
    **EXPERT_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_PARAMS = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}


def _config(arch: str):
    def extra(
        meta: dict[str, Any],
        config: dict[str, Any],
        shapes: dict[str, tuple[int, ...]],
        path: Path,
    ) -> dict[str, Any]:
        layers = config["num_hidden_layers"]
        value_heads = required(meta, f"{arch}.ssm.time_step_rank", path)
        inner = required(meta, f"{arch}.ssm.inner_size", path)
        if value_heads <= 0 or inner % value_heads:
            raise ValueError(
                f"{path}: ssm.inner_size {inner} is not a multiple of ssm.time_step_rank "
                f"{value_heads}"
            )
        # llama.cpp (and mlx-lm) place the layers by the interval; the tensors must agree.
        every = meta.get(f"{arch}.full_attention_interval", 4)
        linear = [(i + 1) % every != 0 for i in range(layers)]
        if blocks_with(shapes, "ssm_a", layers) != linear:
            raise ValueError(
                f"{path}: the blocks holding DeltaNet tensors (ssm_a) are not those "
                f"full_attention_interval {every} makes linear-attention layers"
            )
        extra = {
            "full_attention_interval": every,
            "linear_conv_kernel_dim": required(meta, f"{arch}.ssm.conv_kernel", path),
            "linear_key_head_dim": required(meta, f"{arch}.ssm.state_size", path),
            "linear_num_key_heads": required(meta, f"{arch}.ssm.group_count", path),
            "linear_num_value_heads": value_heads,
            "linear_value_head_dim": inner // value_heads,
            "layer_types": ["linear_attention" if x else "full_attention" for x in linear],
        }
        if f"{arch}.expert_count" in meta:
            extra |= expert_config(meta, arch, path)
            extra["mlp_only_layers"] = dense_layers(shapes, layers)
            shared = meta.get(f"{arch}.expert_shared_feed_forward_length")
            if shared is not None:
                extra["shared_expert_intermediate_size"] = shared
        else:
            extra["num_experts"] = 0
        return extra

    return extra


def _transform(regroup_qkvz: bool):
    def transform(weights: dict[str, Value], config: dict[str, Any]) -> None:
        for i, kind in enumerate(config["layer_types"]):
            if kind == "linear_attention":
                _delta_net(weights, config, f"model.layers.{i}.linear_attn.", regroup_qkvz)
            gate = f"model.layers.{i}.mlp.shared_expert_gate.weight"
            if gate in weights and weights[gate].ndim == 1:  # llama.cpp reads it as {n_embd}
                weights[gate] = weights[gate][None, :]
        split_gate_up(weights, config)

    return transform


def _delta_net(weights: dict[str, Value], config: dict[str, Any], at: str, qkvz: bool) -> None:
    nk, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
    nv, dv = config["linear_num_value_heads"], config["linear_value_head_dim"]
    a = weights[f"{at}A_log"]
    if not np.all(a < 0):
        raise ValueError(f"{at}A_log: ssm_a holds values >= 0, which -exp(A_log) never is")
    weights[f"{at}A_log"] = np.log(-a)
    if nk != nv and not qkvz:
        _untile(weights, at, nk, dk, nv, dv)
    conv = weights[f"{at}conv1d.weight"]
    weights[f"{at}conv1d.weight"] = conv.reshape(conv.shape[0], -1, 1)  # (C, K, 1)
    if qkvz:
        per = nv // nk
        head = np.arange(nk)[:, None]
        q = head * dk + np.arange(dk)
        k = nk * dk + q
        v = 2 * nk * dk + head * per * dv + np.arange(per * dv)
        z = nv * dv + v
        order = np.concatenate([q, k, v, z], axis=1).reshape(-1)  # per key head: q, k, v, z
        parts = [weights.pop(f"{at}in_proj_qkv.weight"), weights.pop(f"{at}in_proj_z.weight")]
        weights[f"{at}in_proj_qkvz.weight"] = take_rows(concat_rows(parts), order)


def _untile(weights: dict[str, Value], at: str, nk: int, dk: int, nv: int, dv: int) -> None:
    """Value heads back from tiled order to grouped by key head, in every tensor holding them."""

    def grouped(size: int) -> np.ndarray:  # tiled index of each grouped position
        return np.arange(nv * size).reshape(nv // nk, nk, size).swapaxes(0, 1).reshape(-1)

    qk = np.arange(2 * nk * dk)
    channels = np.concatenate([qk, 2 * nk * dk + grouped(dv)])
    for name, order in (
        ("in_proj_qkv.weight", channels),
        ("conv1d.weight", channels),
        ("in_proj_z.weight", grouped(dv)),
        ("in_proj_b.weight", grouped(1)),
        ("in_proj_a.weight", grouped(1)),
    ):
        weights[at + name] = take_rows(weights[at + name], order)
    for name in ("A_log", "dt_bias"):
        weights[at + name] = weights[at + name][grouped(1)]
    weights[f"{at}out_proj.weight"] = take_columns(weights[f"{at}out_proj.weight"], grouped(dv))


def _hybrid(model_type: str, hf_class: str, arch: str, qkvz: bool = False) -> Architecture:
    return Architecture(
        model_type,
        hf_class,
        _LAYER,
        _config(arch),
        layer_params=_PARAMS,
        partial_rotary=True,
        query_gate=True,
        transform=_transform(qkvz),
    )


HYBRID_ARCHITECTURES = {
    "qwen3next": _hybrid("qwen3_next", "Qwen3NextForCausalLM", "qwen3next", qkvz=True),
    "qwen35": _hybrid("qwen3_5_text", "Qwen3_5ForCausalLM", "qwen35"),
    "qwen35moe": _hybrid("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "qwen35moe"),
}
