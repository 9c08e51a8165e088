"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5: a depthwise causal
conv1d over the q/k/v projections, then the gated delta rule, a recurrence over a (H, Dk, Dv)
state per sequence, read out by the queries and normed under a SiLU gate.

The recurrence, token by token (transformers' torch reference, in float32):

    S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t

A forward that keeps its final state alone (a prompt's) runs it CHUNK tokens at a time in closed
form (`chunked_delta_rule`: a handful of matmuls a chunk instead of a dozen ops a token); a
verify forward, whose every row's state is kept, runs it token by token. Its state lives in the
hybrid cache (state_cache.py), which keeps the state after every row of a short forward, so
that a verify forward's rejected rows can be rolled back exactly.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..state_cache import ROWS, RecurrentShape, keeps_every
from .activations import silu, softplus
from .context import ForwardContext


def l2norm(x: mx.array, eps: float = 1e-6) -> mx.array:
    """x / sqrt(sum x^2 + eps) over the last axis (FLA's and transformers' form)."""
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


CHUNK = 64  # tokens of a prompt's forward the closed form takes at once


def gated_delta_rule(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    every: bool,
    at: mx.array | None = None,
) -> tuple[mx.array, list[mx.array], mx.array | None]:
    """(B, L, H, Dk) queries and keys, (B, L, H, Dv) values, (B, L, H) log-decays and betas,
    all float32, from the (B, H, Dk, Dv) `state`: the (B, L, H, Dv) outputs and the states,
    the entering one and one after each row when `every`, else the final one alone; and, for
    `at` (B,) token counts, each row's state after its first at[b] tokens (else None)."""
    if not every and q.shape[1] > 1:
        return chunked_delta_rule(q, k, v, g, beta, state, at)
    decay = mx.exp(g)[..., None, None]  # (B, L, H, 1, 1)
    outputs, states = [], [state]
    marked = None if at is None else state
    for t in range(q.shape[1]):
        state = state * decay[:, t]
        remembered = (k[:, t, :, None, :] @ state)[:, :, 0]  # (B, H, Dv)
        delta = (v[:, t] - remembered) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outputs.append((q[:, t, :, None, :] @ state)[:, :, 0])
        if every:
            states.append(state)
        if at is not None:
            marked = mx.where((at == t + 1)[:, None, None, None], state, marked)
    return mx.stack(outputs, axis=1), states if every else [state], marked


def chunked_delta_rule(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    at: mx.array | None = None,
) -> tuple[mx.array, list[mx.array], mx.array | None]:
    """`gated_delta_rule`'s outputs, final state and states at `at`, CHUNK tokens at a time in
    closed form.

    Within a chunk from state S0, with G_t = g_1 + ... + g_t (so exp(G_t - G_i) <= 1 for
    i <= t), the state is S_t = exp(G_t) S0 + sum_{i <= t} exp(G_t - G_i) k_i u_i^T, where the
    rows u_t solve (I + A) U = diag(beta) (V - diag(exp G) K S0) with A strictly lower
    triangular, A[t, i] = beta_t exp(G_t - G_i) k_t.k_i (`unit_lower_inverse`); the outputs
    are O = diag(exp G) Q S0 + (exp(G_t - G_i) q_t.k_i)_{i <= t} U."""
    outputs = []
    marked = None if at is None else state
    for first in range(0, q.shape[1], CHUNK):
        rows = slice(first, first + CHUNK)
        # (B, H, C, D) and (B, H, C)
        qc, kc, vc = (x[:, rows].swapaxes(1, 2) for x in (q, k, v))
        gc, bc = (x[:, rows].swapaxes(1, 2) for x in (g, beta))
        n = gc.shape[-1]
        cum = mx.cumsum(gc, axis=-1)
        lower = mx.tril(mx.ones((n, n), dtype=mx.bool_))
        ratio = mx.where(
            lower, mx.exp(mx.where(lower, cum[..., :, None] - cum[..., None, :], 0)), 0
        )
        strict = ratio * (1 - mx.eye(n, dtype=ratio.dtype))
        a = bc[..., :, None] * strict * (kc @ kc.swapaxes(-1, -2))
        grown = mx.exp(cum)[..., None]  # (B, H, C, 1)
        u = unit_lower_inverse(a) @ (bc[..., None] * (vc - grown * (kc @ state)))
        readout = (ratio * (qc @ kc.swapaxes(-1, -2))) @ u
        outputs.append((grown * (qc @ state) + readout).swapaxes(1, 2))
        if at is not None:  # row b's S_t for t = at[b] - first - 1, where it falls here
            t = mx.clip(at - first - 1, 0, n - 1)[:, None, None]  # (B, 1, 1)
            upto = mx.take_along_axis(
                ratio, mx.broadcast_to(t[..., None], (*ratio.shape[:2], 1, n)), axis=2
            )
            grown_t = mx.exp(
                mx.take_along_axis(cum, mx.broadcast_to(t, cum.shape[:2] + (1,)), axis=2)
            )
            s_t = grown_t[..., None] * state + (kc * upto.swapaxes(-1, -2)).swapaxes(-1, -2) @ u
            here = ((at > first) & (at <= first + n))[:, None, None, None]
            marked = mx.where(here, s_t, marked)
        left = mx.exp(cum[..., -1:] - cum)[..., None]  # (B, H, C, 1)
        state = mx.exp(cum[..., -1])[..., None, None] * state + (kc * left).swapaxes(-1, -2) @ u
    return mx.concatenate(outputs, axis=1), [state], marked


def unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + a)^-1 of a strictly lower triangular (..., n, n) `a`, by blocks doubling in size:
    the inverse of [[M11, 0], [M21, M22]] is [[N11, 0], [-N22 M21 N11, N22]] (the standard
    triangular inversion, as stable as substitution; a power series of -a is not)."""
    n = a.shape[-1]
    size = 1 << max(0, (n - 1).bit_length())
    if size != n:  # padded with identity rows, which leave the rest as it is
        a = mx.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, size - n), (0, size - n)])
    lead = a.shape[:-2]
    inverse = mx.ones((*lead, size, 1, 1), a.dtype)  # the diagonal blocks' inverses
    s = 1
    while s < size:
        count = size // s
        blocks = a.reshape(*lead, count, s, count, s).swapaxes(-3, -2)  # (..., c, c, s, s)
        blocks = blocks.reshape(*lead, count * count, s, s)
        pairs = mx.arange(0, count, 2)
        m21 = mx.take(
            blocks, (pairs + 1) * count + pairs, axis=-3
        )  # (..., count / 2, size s, size s)
        n11, n22 = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        top = mx.concatenate([n11, mx.zeros_like(n11)], axis=-1)
        bottom = mx.concatenate([-(n22 @ m21 @ n11), n22], axis=-1)
        inverse = mx.concatenate([top, bottom], axis=-2)
        s *= 2
    return inverse[..., 0, :n, :n]


def state_shape(args) -> RecurrentShape:
    """The recurrent state of the layers `args` (a hybrid family's) describes."""
    key_dim = args.linear_key_head_dim * args.linear_num_key_heads
    value_dim = args.linear_value_head_dim * args.linear_num_value_heads
    return RecurrentShape(
        2 * key_dim + value_dim,
        args.linear_conv_kernel_dim,
        args.linear_num_value_heads,
        args.linear_key_head_dim,
        args.linear_value_head_dim,
    )


class GatedRMSNorm(nn.Module):
    """RMSNorm per value head (weight, not 1 + weight), times SiLU of the gate, in float32."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        h = x.astype(mx.float32)
        h = h * mx.rsqrt((h * h).mean(axis=-1, keepdims=True) + self.eps)
        h = self.weight * h.astype(x.dtype)
        return (h * silu(gate.astype(mx.float32))).astype(x.dtype)


class GatedDeltaNet(nn.Module):
    """The layer's shared core; a family's subclass names its input projections (`project`).
    Parameters keep HF names; `conv1d.weight` is MLX's (channels, kernel, 1)."""

    def __init__(self, args):
        super().__init__()
        self.num_k_heads = args.linear_num_key_heads
        self.num_v_heads = args.linear_num_value_heads
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_k_heads})"
            )
        self.head_k_dim = args.linear_key_head_dim
        self.head_v_dim = args.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.kernel = args.linear_conv_kernel_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, kernel_size=self.kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = mx.ones((self.num_v_heads,))
        self.A_log = mx.zeros((self.num_v_heads,))
        self.norm = GatedRMSNorm(self.head_v_dim, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, args.hidden_size, bias=False)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """(B, L, hidden) -> q|k|v (B, L, conv_dim), z (B, L, Hv, Dv), b and a (B, L, Hv)."""
        raise NotImplementedError

    def __call__(self, x: mx.array, ctx: ForwardContext, layer: int) -> mx.array:
        B, L, _ = x.shape
        mixed, z, b, a = self.project(x)
        cache = ctx.cache
        if cache is None:
            window = mx.zeros((B, self.kernel - 1, self.conv_dim), mixed.dtype)
            shape = (B, self.num_v_heads, self.head_k_dim, self.head_v_dim)
            state = mx.zeros(shape, mx.float32)
        else:
            padded = cache.lengths is not None  # a batch's prefill: its final states alone
            if ctx.end is None and L > ROWS and not padded:  # a step: rows must be rollable
                raise ValueError(f"recurrent layers verify at most {ROWS} rows at once, got {L}")
            window, state = cache.recurrent(layer, ctx.start, B, mixed.dtype)
        conv_in = mx.concatenate([window.astype(mixed.dtype), mixed], axis=1)
        conv = silu(self.conv1d(conv_in))  # (B, L, conv_dim)
        q, k, v = mx.split(conv, [self.key_dim, 2 * self.key_dim], axis=-1)
        q = l2norm(q.reshape(B, L, self.num_k_heads, -1).astype(mx.float32))
        k = l2norm(k.reshape(B, L, self.num_k_heads, -1).astype(mx.float32))
        q = q * self.head_k_dim**-0.5
        if self.num_v_heads != self.num_k_heads:  # each k head serves consecutive v heads
            q = mx.repeat(q, self.num_v_heads // self.num_k_heads, axis=2)
            k = mx.repeat(k, self.num_v_heads // self.num_k_heads, axis=2)
        v = v.reshape(B, L, self.num_v_heads, -1).astype(mx.float32)
        beta = mx.sigmoid(b).astype(mx.float32)
        dt = a.astype(mx.float32) + self.dt_bias.astype(mx.float32)
        g = -mx.exp(self.A_log.astype(mx.float32)) * softplus(dt)
        if cache is not None and cache.lengths is not None:
            # A padded row's padding neither decays nor writes its state (g = beta = 0), so
            # its final state is the one at its own end; the conv only looks back.
            real = (mx.arange(L) < cache.lengths[:, None])[..., None]  # (B, L, 1)
            g, beta = mx.where(real, g, 0.0), mx.where(real, beta, 0.0)
        # Per-row states only where a rollback may follow: a verify step's view (no host end);
        # a prompt's forward keeps its final state (per-row states of a real model's layers
        # would hold gigabytes for a short prompt).
        every = cache is not None and ctx.end is None and cache.lengths is None and keeps_every(L)
        # A prompt's forward also gives the state at a marked slot (`KVCache.mark`): its end
        # before its last token, for the checkpoint a repeated prompt returns to.
        at = None
        if cache is not None and cache.marks is not None:
            at = mx.clip(cache.marks - ctx.start, 0, L)  # (B,) tokens before the mark
        out, states, marked = gated_delta_rule(q, k, v, g, beta, state, every, at)
        if cache is not None:
            cache.keep(layer, ctx.start, conv_in, states)
        if marked is not None:
            near = at[:, None] + mx.arange(self.kernel - 1, dtype=at.dtype)  # its conv window
            cache.keep_marked(layer, mx.take_along_axis(conv_in, near[..., None], axis=1), marked)
        out = self.norm(out.astype(x.dtype), z)  # (B, L, Hv, Dv)
        return self.out_proj(out.reshape(B, L, -1))
