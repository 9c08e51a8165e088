"""Head projections with a batch-of-one weight: equal to nn.Linear bit for bit, in every head,
with fewer nodes in a compiled head call. Weights stored transposed keep their values and saved
bytes; their products (another gemm kernel) agree up to float32 rounding."""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_speculate.heads.eagle_format import build_eagle
from mlx_speculate.heads.linear import HeadLinear, store_transposed

from .helpers import assert_float32_close, eagle_config, random_eagle_weights, tiny_config


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(5, 7), (2, 5, 7), (1, 3, 5, 7)])
def test_equals_nn_linear_bit_for_bit(bias, shape):
    mx.random.seed(0)
    plain = nn.Linear(7, 9, bias=bias)
    batched = HeadLinear(7, 9, bias=bias)
    batched.update(plain.parameters())
    x = mx.random.normal(shape)
    out = batched(x)
    assert out.shape == (*shape[:-1], 9)
    assert mx.array_equal(out, plain(x)).item()


def head(version: int):
    config = eagle_config(tiny_config(), version, **({"draft_vocab": 40} if version == 3 else {}))
    return build_eagle(config, random_eagle_weights(config, 0))


def nodes(path, fn, *args) -> int:
    mx.export_to_dot(path, *mx.compile(fn)(*args))
    with open(path) as f:
        return len(re.findall(r"\[label", f.read()))


@pytest.mark.parametrize("version", [1, 3])
def test_heads_use_it_under_their_official_names_and_a_call_has_fewer_nodes(version, tmp_path):
    batched = head(version)
    linears = [m for _, m in batched.named_modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is HeadLinear for m in linears)
    plain = head(version)
    for _, m in plain.named_modules():
        if type(m) is HeadLinear:
            m.__class__ = nn.Linear  # the same arrays, multiplied as nn.Linear does
    assert set(dict(batched.parameters())) == set(dict(plain.parameters()))
    h = batched.args.hidden_size
    width = plain.fc.weight.shape[-1] if version == 3 else h
    embeds, hidden = mx.random.normal((1, 3, h)), mx.random.normal((1, 3, width))

    def call(module):
        def fn(e, x):
            out = module(e, x, module.make_cache(), from_target=True)
            return (out, module.feedback(out) @ mx.ones((h, 2)))

        return fn

    ours, theirs = call(batched)(embeds, hidden), call(plain)(embeds, hidden)
    assert mx.array_equal(ours[0], theirs[0]).item()
    # Each projection drops the Flatten/Unflatten pair around its matmul.
    dot = str(tmp_path / "graph.dot")
    assert nodes(dot, call(batched), embeds, hidden) < nodes(dot, call(plain), embeds, hidden)


@pytest.mark.parametrize("version", [1, 3])
def test_weights_stored_transposed_keep_values_outputs_and_saved_bytes(version, tmp_path):
    stored, plain = head(version), head(version)
    store_transposed(stored)
    weights = [dict(tree_flatten(m.parameters())) for m in (stored, plain)]
    assert all(mx.array_equal(w, weights[1][name]).item() for name, w in weights[0].items())
    h = stored.args.hidden_size
    width = stored.fc.weight.shape[-1] if version == 3 else h
    embeds, hidden = mx.random.normal((1, 3, h)), mx.random.normal((1, 3, width))
    outs = [m(embeds, hidden, m.make_cache(), from_target=True) for m in (stored, plain)]
    # Another weight layout is another gemm kernel (OpenBLAS's AVX-512 ones sum in another
    # order): equal up to float32 rounding, not bit for bit.
    assert_float32_close(np.array(outs[0]), np.array(outs[1]))
    for name, w in zip("ab", weights, strict=True):
        mx.save_safetensors(str(tmp_path / f"{name}.safetensors"), w)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
