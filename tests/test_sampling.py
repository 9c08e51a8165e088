
import mlx.core as mx
import numpy as np
import pytest

from mlx_speculate.sampling import SamplingParams, log_probs, sample

from .markov import chi_square_limit


def reference_log_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Hugging Face's warpers (temperature, top-k, top-p, min-p) re-done row by row in numpy."""
    out = []
    for row in logits.reshape(-1, logits.shape[-1]).astype(np.float64):
        row = row / params.temperature
        if params.top_k:
            kth = np.sort(row)[-min(params.top_k, row.size)]
            row = np.where(row < kth, -np.inf, row)
        if params.top_p < 1:
            order = np.argsort(row)  # ascending, as Hugging Face does
            probs = np.exp(row[order] - row.max())
            cumulative = np.cumsum(probs / probs.sum())
            drop = cumulative <= 1 - params.top_p
            drop[-1] = False
            row = row.copy()
            row[order[drop]] = -np.inf
        if params.min_p > 0:
            probs = np.exp(row - row.max())
            row = np.where(probs < params.min_p * probs.max(), -np.inf, row)
        finite = row[np.isfinite(row)]
        out.append(row - (finite.max() + np.log(np.exp(finite - finite.max()).sum())))
    return np.array(out).reshape(logits.shape)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, min_p=0.1),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=100),  # k >= V: a no-op
        SamplingParams(temperature=2.0, top_p=1e-6),  # only the top token survives
    ],
)
def test_log_probs_matches_numpy_reference(params):
    logits = np.random.default_rng(0).normal(size=(16, 50)).astype(np.float32) * 3
    got = np.asarray(log_probs(mx.array(logits), params))
    want = reference_log_probs(logits, params)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], atol=1e-5)
    assert np.all(np.isfinite(got).sum(-1) >= 1)


def test_each_filter_removes_something():
    logits = mx.array(np.random.default_rng(1).normal(size=(8, 50)).astype(np.float32) * 3)

    def kept(**kwargs) -> np.ndarray:
        return np.isfinite(np.asarray(log_probs(logits, SamplingParams(**kwargs)))).sum(-1)

    assert np.all(kept(temperature=1.0, top_k=5) == 5)
    assert np.all(kept(temperature=1.0, top_p=0.5) < 50)
    assert np.all(kept(temperature=1.0, min_p=0.2) < 50)
    assert np.all(kept(temperature=1.0) == 50)


def test_greedy_is_a_point_mass_at_argmax():
    logits = mx.array(np.random.default_rng(2).normal(size=(4, 30)).astype(np.float32))
    params = SamplingParams(top_p=0.5, top_k=3)
    assert params.greedy
    got = np.asarray(log_probs(logits.astype(mx.bfloat16), params))
    best = np.argmax(np.asarray(logits.astype(mx.bfloat16).astype(mx.float32)), axis=-1)
    want = np.full((4, 30), -np.inf, dtype=np.float32)
    want[np.arange(4), best] = 0.0
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(sample(mx.array(got))), best)


@pytest.mark.parametrize("shape", [(40,), (3, 40), (2, 3, 40)])
def test_any_leading_shape(shape):
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.02)
    logits = np.random.default_rng(3).normal(size=shape).astype(np.float32) * 2
    got = np.asarray(log_probs(mx.array(logits), params))
    rows = np.asarray(log_probs(mx.array(logits.reshape(-1, 40)), params)).reshape(shape)
    assert got.shape == shape
    np.testing.assert_array_equal(got, rows)
    assert sample(mx.array(got), mx.random.key(0)).shape == shape[:-1]
    assert sample(mx.array(got)).dtype == mx.int32


def test_log_probs_is_lazy_and_compilable():
    # .item() or a numpy round trip would fail inside mx.compile.
    params = SamplingParams(temperature=0.7, top_k=8, top_p=0.9, min_p=0.05)
    logits = mx.random.normal((5, 64), key=mx.random.key(4))
    compiled = mx.compile(lambda x: log_probs(x, params))
    want = np.asarray(log_probs(logits, params))
    np.testing.assert_array_equal(np.asarray(compiled(logits)), want)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": float("nan")},
        {"top_k": -1},
        {"min_p": 1.0},
        {"min_p": -0.1},
    ],
)
def test_invalid_params_raise(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_sampling_frequencies_match_probabilities():
    params = SamplingParams(temperature=1.0, top_k=5)
    logits = mx.array([1.0, 0.2, -0.5, 2.0, 0.0, -3.0, 0.7])
    logprobs = log_probs(logits, params)  # (V,)
    probs = np.exp(np.asarray(logprobs, dtype=np.float64))
    n = 200_000
    draws = np.asarray(sample(mx.broadcast_to(logprobs, (n, 7)), mx.random.key(5)))  # (n,)
    counts = np.bincount(draws, minlength=7)
    assert counts[probs == 0].sum() == 0
    support = probs > 0
    expected = n * probs[support]
    chi2 = (((counts[support] - expected) ** 2) / expected).sum()
    assert chi2 < chi_square_limit(int(support.sum()) - 1)
