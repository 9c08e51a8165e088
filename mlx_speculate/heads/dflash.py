"""DFlash block drafters (z-lab/dflash `DFlashDraftModel`), as z-lab's `model.py` and
`model_mlx.py` define them.

A few Qwen3 decoder layers draft a block of B tokens in one non-causal forward. Their context
is the target's own features: the outputs of the target layers `target_layer_ids` at every
committed position, concatenated and projected by `fc` then `hidden_norm` to the draft's
width; every draft layer turns those rows into keys and values with its own `k_proj`/`v_proj`
(and `k_norm`), at the positions they were computed at. The block is the last verified token
followed by B - 1 `mask_token_id`s, embedded with the TARGET's embedding at the next B
positions; each block row attends to the whole context and to every block row, and the
outputs of rows 1..B-1, through `norm` and the TARGET's lm_head, predict the tokens at their
own positions. The draft holds no embedding and no lm_head.

A layer's context keys and values depend on the context rows alone (not on the block), so
they are computed once per committed position and cached; a block's own keys and values are
written after them and overwritten by the next block.

The target's layer outputs are the states entering the next layer, `CausalLM`'s taps
`target_layer_ids + 1` (transformers' `hidden_states[i + 1]`, as z-lab's
`extract_context_feature` reads them), so a drafter cannot read the last layer's output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cache import KVCache
from ..models import qwen3
from ..models.base import CausalLM, attend
from ..models.context import ForwardContext, additive_mask
from ..models.llama import MLP
from ..models.rope import RotaryEmbedding, native

ARCHITECTURE = "DFlashDraftModel"
Tables = tuple[tuple[mx.array, ...], tuple[mx.array, ...]]  # rotations: block rows, context


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's `build_target_layer_ids`: the target layers a drafter reads when its config
    names none, spread from layer 1 to layer L - 3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    return tuple(
        int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)
    )


@dataclass(frozen=True)
class DFlashConfig:
    """Everything that shapes a drafter: the Qwen3 config of its layers and z-lab's block
    settings (`block_size`, `dflash_config.target_layer_ids` and `mask_token_id`,
    `num_target_layers`)."""

    layer: dict[str, Any]  # the HF Qwen3 config of the draft layers: sizes, rope, eps, window
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int | None = None  # the depth of the target it was trained for

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise ValueError(f"DFlash block_size must be an integer, got {self.block_size!r}")
        if self.block_size < 2:
            raise ValueError(
                f"DFlash block_size must be >= 2 (the verified token and a draft), got "
                f"{self.block_size}"
            )
        if not self.target_layer_ids or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.target_layer_ids
        ):
            raise ValueError(
                f"DFlash target_layer_ids must be layer indices, got {list(self.target_layer_ids)}"
            )
        if isinstance(self.mask_token_id, bool) or not isinstance(self.mask_token_id, int):
            raise ValueError(f"DFlash mask_token_id must be a token id, got {self.mask_token_id!r}")

    @property
    def args(self) -> qwen3.ModelArgs:
        try:
            return qwen3.ModelArgs.from_dict({**self.layer, "model_type": "qwen3"})
        except TypeError as e:  # a required size is absent
            raise ValueError(f"DFlash drafter config is incomplete: {e}") from e

    @property
    def taps(self) -> tuple[int, ...]:
        """The target taps (states entering a layer) that hold the outputs it reads."""
        return tuple(i + 1 for i in self.target_layer_ids)


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys and values also come from the context rows."""

    def __init__(self, args: qwen3.ModelArgs, rope: RotaryEmbedding):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        self._rope = rope
        dim, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)

    def keys_values(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(B, L, h) rows -> their (B, H_kv, L, D) keys (normed, not yet rotated) and values."""
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return k, v

    def queries(self, x: mx.array) -> mx.array:
        B, L, _ = x.shape
        return self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, ctx: ForwardContext, layer: int) -> mx.array:
        k, v = self.keys_values(x)
        return self.o_proj(attend(ctx, layer, self._rope, self.queries(x), k, v, self.scale))

    def over(self, x: mx.array, rows: mx.array, tables: Tables, mask: mx.array) -> mx.array:
        """Training's form, with no cache: the (B, A S, h) rows of A blocks of S tokens side
        by side attend to the (B, T, h) context rows under the additive (B, A, T) `mask` and
        to their own block's rows; `tables`: the rotations of the block rows and of the
        context rows. Scores against other blocks are never formed: the cost is A S (T + S)
        a head, not A S (T + A S)."""
        B, L, _ = x.shape
        A, T = mask.shape[1:]
        S, Hkv, D = L // A, self.n_kv_heads, self.head_dim
        G = self.n_heads // Hkv  # query heads sharing one key head (head h reads h // G)
        kc, vc = self.keys_values(rows)  # (B, Hkv, T, D)
        kb, vb = self.keys_values(x)  # (B, Hkv, L, D)
        q = self._rope.rotate(self.queries(x), tables[0]) * self.scale  # (B, H, L, D)
        kc, kb = self._rope.rotate(kc, tables[1]), self._rope.rotate(kb, tables[0])
        q = q.reshape(B, Hkv, G, A, S, D)
        context = q.reshape(B, Hkv, G * L, D) @ kc.swapaxes(-1, -2)  # (B, Hkv, G L, T)
        context = context.reshape(B, Hkv, G, A, S, T) + mask[:, None, None, :, None, :]
        kb, vb = kb.reshape(B, Hkv, 1, A, S, D), vb.reshape(B, Hkv, 1, A, S, D)
        own = q @ kb.swapaxes(-1, -2)  # (B, Hkv, G, A, S, S)
        p = mx.softmax(mx.concatenate([context, own.astype(context.dtype)], axis=-1), axis=-1)
        out = p[..., :T].reshape(B, Hkv, G * L, T) @ vc  # (B, Hkv, G L, D)
        out = out.reshape(B, Hkv, G, A, S, D) + p[..., T:] @ vb  # (B, Hkv, G, A, S, D)
        out = out.reshape(B, self.n_heads, L, D).transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(out)


class DFlashLayer(nn.Module):
    def __init__(self, args: qwen3.ModelArgs, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = DFlashAttention(args, rope)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, ctx: ForwardContext, layer: int) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), ctx, layer)
        return h + self.mlp(self.post_attention_layernorm(h))

    def over(self, x: mx.array, rows: mx.array, tables: Tables, mask: mx.array) -> mx.array:
        h = x + self.self_attn.over(self.input_layernorm(x), rows, tables, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashHead(nn.Module):
    """The drafter's weights in z-lab's names: `fc`, `hidden_norm`, `layers.N.*`, `norm`."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        args = config.args
        self.args = args
        h = args.hidden_size
        self._rope = RotaryEmbedding(
            args.head_dim, args.rope_config(), args.max_position_embeddings
        )
        self.fc = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.layers = [DFlashLayer(args, self._rope) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self._sliding = args.sliding_layers()

    @property
    def rope(self) -> RotaryEmbedding:
        return self._rope

    @property
    def window(self) -> int | None:
        """The sliding window of the layers that have one (`sliding`), else None."""
        return self.args.sliding_window if any(self._sliding) else None

    @property
    def sliding(self) -> tuple[bool, ...]:
        return self._sliding

    @property
    def traceable(self) -> bool:
        """Whether a block's graph can be independent of the host offset."""
        return not self._rope.depends_on_length

    def make_cache(self, dtype: mx.Dtype = mx.float32) -> KVCache:
        args = self.args
        like = mx.zeros((1, args.num_key_value_heads, 0, args.head_dim), dtype)
        return KVCache(len(self.layers), like=like)

    def context(self, features: mx.array) -> mx.array:
        """(..., n * h) concatenated target layer outputs -> (..., h) context rows."""
        return self.hidden_norm(self.fc(features))

    def write_context(
        self, rows: mx.array, cache: KVCache, start: mx.array, seq_len: int | None = None
    ) -> None:
        """Writes every layer's keys and values of the (B, P, h) context rows at slot and
        position `start` (int32) on: the part of attention that no block changes.
        `seq_len`: the largest rotary position + 1, for ropes that depend on it."""
        rope, length = self._rope, rows.shape[1]
        freqs = rope.freqs(seq_len or rope.max_position_embeddings)
        tables = None if native() else rope.tables(start, None, length, freqs, rows.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.keys_values(rows)  # (B, H_kv, P, D)
            k = rope(k, start, None, freqs) if tables is None else rope.rotate(k, tables)
            cache.write(i, k, v, start, None)

    def __call__(self, embeds: mx.array, ctx: ForwardContext) -> mx.array:
        """(B, L, h) block embeddings -> (B, L, h) normed outputs (lm_head's input), each
        row attending to the cached context and to the block as `ctx` says."""
        x = embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, i)
        return self.norm(x)

    def blocks(
        self, embeds: mx.array, rows: mx.array, positions: mx.array, visible: mx.array
    ) -> mx.array:
        """Training's forward, with no cache: (B, A S, h) embeddings of A blocks of S tokens
        side by side at rotary `positions` (B, A S), over the (B, T, h) context rows at
        positions 0..T-1, block a seeing the context rows `visible[:, a]` ((B, A, T) bool:
        those before its anchor) and its own rows -> (B, A S, h) normed outputs."""
        rope, T = self._rope, rows.shape[1]
        freqs = rope.freqs(rope.max_position_embeddings)
        dtype = embeds.dtype
        tables = (
            rope.tables(0, positions, positions.shape[1], freqs, dtype),
            rope.tables(0, None, T, freqs, dtype),
        )
        mask = additive_mask(visible, dtype)
        x = embeds
        for layer in self.layers:
            x = layer.over(x, rows, tables, mask)
        return self.norm(x)

    def check_fits(self, target: CausalLM) -> tuple[int, ...]:
        """Raises a one-line ValueError unless the drafter reads the target's states and
        speaks its vocabulary; returns the target taps it reads."""
        args, config = target.args, self.config
        layers = args.num_hidden_layers
        if self.args.hidden_size != args.hidden_size:
            raise ValueError(
                f"the DFlash drafter has hidden size {self.args.hidden_size}, the target's is "
                f"{args.hidden_size}"
            )
        if self.args.vocab_size != args.vocab_size:
            raise ValueError(
                f"the DFlash drafter predicts a vocabulary of {self.args.vocab_size}, the "
                f"target's is {args.vocab_size}"
            )
        if not 0 <= config.mask_token_id < args.vocab_size:
            raise ValueError(
                f"the DFlash mask token {config.mask_token_id} is outside the target's "
                f"vocabulary of {args.vocab_size}"
            )
        if config.num_target_layers not in (None, layers):
            raise ValueError(
                f"the DFlash drafter was made for a {config.num_target_layers}-layer target; "
                f"this one has {layers} layers"
            )
        if max(config.target_layer_ids) >= layers - 1:
            raise ValueError(
                f"the DFlash drafter reads target layers {list(config.target_layer_ids)}; a "
                f"{layers}-layer target's readable layers are 0 to {layers - 2}"
            )
        return config.taps


def features(taps: Sequence[mx.array]) -> mx.array:
    """(n, k * h): the target's tapped states of some positions, concatenated as `fc` reads
    them."""
    return taps[0] if len(taps) == 1 else mx.concatenate(list(taps), axis=-1)
