"""A head's projections with their weight as a batch of one.

`nn.Linear` multiplies (B, L, in) activations by a 2-D weight, which MLX does by flattening
them to (B * L, in) and back: two graph nodes around every matmul. A draft head runs several
times inside one compiled EAGLE step (the catch-up and each tree level), and on an
overhead-bound target each node costs about as much as its arithmetic. Broadcasting the
weight as (1, in, out) instead leaves one batched matmul a call; the weight's transpose and
batch axis are the same nodes in every call of the graph, which compile merges into one.
The products are the same gemm, so the outputs are equal bit for bit.

A drafter also stores each weight row-major by input (`store_transposed`): the (out, in)
weight a view of an (in, out) array. A head level multiplies one row, and OpenBLAS's gemm runs
that product faster with the weight untransposed.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map


class HeadLinear(nn.Linear):
    """`nn.Linear` (same parameters and names) without the reshapes around its matmul."""

    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"].T
        if x.ndim > 2:
            weight = weight.reshape((1,) * (x.ndim - 2) + weight.shape)
        if "bias" in self:
            return mx.addmm(self["bias"], x, weight)
        return x @ weight


def batch_weights(module: nn.Module) -> None:
    """Swaps every `nn.Linear` in `module` for a `HeadLinear` holding the same arrays."""

    def swap(layer: nn.Module) -> nn.Module:
        if type(layer) is not nn.Linear:
            return layer
        out_dims, in_dims = layer.weight.shape
        batched = HeadLinear(in_dims, out_dims, bias="bias" in layer)
        batched.update(layer.parameters())
        return batched

    leaves = module.leaf_modules()
    module.update_modules(tree_map(swap, leaves, is_leaf=lambda m: isinstance(m, nn.Module)))


def store_transposed(module: nn.Module) -> None:
    """Stores every `HeadLinear` weight in `module` as the transpose of an (in, out) row-major
    array: the same values and (out, in) shape, so saving and training see no difference (an
    update, as loading weights or an optimizer step, just takes the layout back)."""
    for _, layer in module.named_modules():
        if isinstance(layer, HeadLinear):
            layer.weight = mx.contiguous(layer.weight.T).T
