"""Graphs built in the background (graphs.py): a first call runs eagerly while a thread
builds the graph's kernels; the output is the same, later calls run compiled, a marker lets
the next process compile at once, and a process that ends with builds queued finishes them
and exits cleanly."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import mlx.core as mx
import pytest

from mlx_speculate import graphs
from mlx_speculate.models import fast_exp
from mlx_speculate.sampling import SamplingParams

from .helpers import MODELS, decode, greedy_reference, tiny_model, to_float32

PROMPT = [1, 5, 9, 14, 3, 7, 11, 2]


@pytest.fixture
def background(monkeypatch, tmp_path):
    """Builds in the background, as outside the tests, with markers in a folder of the test's
    own; settled before and after."""
    assert graphs.settle(60)
    monkeypatch.setattr(graphs, "BACKGROUND", True)
    monkeypatch.setattr(graphs, "_markers", lambda: tmp_path / "markers")
    yield tmp_path / "markers"
    assert graphs.settle(60)


def test_a_first_call_runs_eagerly_and_later_ones_compiled(background):
    model = to_float32(tiny_model())
    calls = []
    build = lambda: lambda x: (calls.append(x.shape) or x * 2 + 1,)  # noqa: E731
    fn = graphs.compiled(model, ("test", "eager then compiled"), build, span=4)
    before = graphs.built()
    (out,) = fn(mx.arange(4, dtype=mx.float32))
    assert out.tolist() == [1.0, 3.0, 5.0, 7.0]
    assert graphs.built() == before + 1  # an eager call prices nothing, as a trace
    assert graphs.settle(60)
    traced = len(calls)  # the builder's own trace ran the function once more
    assert traced >= 2
    (out,) = fn(mx.arange(4, dtype=mx.float32))
    assert out.tolist() == [1.0, 3.0, 5.0, 7.0]
    assert len(calls) == traced + 1  # this thread's trace
    fn(mx.arange(4, dtype=mx.float32))
    assert len(calls) == traced + 1  # compiled: the Python function no longer runs
    # Another span of the same key is compiled at once: its kernels are built already.
    other = graphs.compiled(model, ("test", "eager then compiled"), build, span=8)
    other(mx.arange(4, dtype=mx.float32))
    assert len(calls) == traced + 2 and graphs.settle(0)
    if mx.default_device() == mx.cpu:  # the kernels are on disk: a next process compiles
        assert len(list(background.iterdir())) == 1
        graphs._COMPILED.pop(id(model))
        again = graphs.compiled(model, ("test", "eager then compiled"), build, span=4)
        again(mx.arange(4, dtype=mx.float32))
        assert len(calls) == traced + 3 and graphs.settle(0)  # traced here, nothing queued


def test_a_marker_covers_graphs_of_its_kind_only(background):
    """A marker names the kind of graph that was built (the names in its key): one of the same
    kind with other numbers compiles at once, one of another kind (a method first used after
    the marker was written) still runs eagerly while it builds in the background."""
    if mx.default_device() != mx.cpu:
        pytest.skip("markers say which CPU kernels are on disk; a GPU has none")
    model = to_float32(tiny_model())
    build = lambda: lambda x: (x * 3 - 1,)  # noqa: E731
    graphs.compiled(model, ("test", "kind one", 1), build)(mx.zeros((3,)))
    assert graphs.settle(60) and len(list(background.iterdir())) == 1
    before = graphs.built()
    (out,) = graphs.compiled(model, ("test", "kind one", 2), build)(mx.ones((5,)))
    assert out.tolist() == [2.0] * 5
    assert graphs.settle(0) and graphs.built() == before + 1  # traced here, nothing queued
    (out,) = graphs.compiled(model, ("test", "kind two", 1), build)(mx.ones((5,)))
    assert out.tolist() == [2.0] * 5  # eager, its build queued behind the request
    assert not graphs.settle(0)
    assert graphs.settle(60) and len(list(background.iterdir())) == 2
    # A flag is part of the kind (a tree's step after chains'): eager while it builds.
    (out,) = graphs.compiled(model, ("test", "kind one", (2, False)), build)(mx.ones((5,)))
    assert out.tolist() == [2.0] * 5
    assert not graphs.settle(0)
    assert graphs.settle(60) and len(list(background.iterdir())) == 3
    # Nested keys of one kind count once (a batch step's fused rows, one or four of them):
    # compiled at once; a nested key of another kind beside them makes a kind of its own.
    rows = lambda *kinds: ("test", "kind one", tuple((i, k) for i, k in enumerate(kinds)))  # noqa: E731
    graphs.compiled(model, rows(("eagle", False)), build)(mx.ones((5,)))
    assert graphs.settle(60) and len(list(background.iterdir())) == 4
    before = graphs.built()
    graphs.compiled(model, rows(*[("eagle", False)] * 4), build)(mx.ones((5,)))
    assert graphs.settle(0) and graphs.built() == before + 1  # traced here, nothing queued
    graphs.compiled(model, rows(("eagle", False), ("mtp", True)), build)(mx.ones((5,)))
    assert not graphs.settle(0)
    assert graphs.settle(60) and len(list(background.iterdir())) == 5


def test_fused_functions_run_unfused_in_eager_calls_until_built(background, monkeypatch):
    """Within `eager()`, SiLU's and softmax's fused kernels are used only once built; the
    unfused ops give the same values to float32 rounding (fast_exp's polynomial exp)."""
    x = mx.random.normal((4, 2048))  # past fast_exp.MIN_ELEMENTS
    fresh = graphs.Fused(fast_exp._fused_softmax, lambda a: mx.softmax(a, axis=-1, precise=True))
    taken = []
    monkeypatch.setattr(fresh, "fallback", lambda a: taken.append(1) or mx.softmax(a, axis=-1))
    with graphs.eager():
        first = fresh(x)
    assert taken == [1]
    assert graphs.settle(60)
    with graphs.eager():
        later = fresh(x)
    assert taken == [1]
    assert mx.allclose(first, later, rtol=1e-5, atol=1e-7).item()
    assert mx.allclose(fast_exp.silu(x), x * mx.sigmoid(x), rtol=1e-5, atol=1e-6).item()


@pytest.mark.parametrize("method", ["plain", "draft model"])
def test_greedy_output_is_the_same_while_graphs_build(background, method):
    """Greedy decoding on a fresh model: the first steps eager, the rest compiled once the
    builds finished; tokens equal plain greedy decoding with one forward a token."""
    from mlx_speculate.drafters.draft_model import DraftModelDrafter

    model = to_float32(tiny_model())
    drafter = None
    if method == "draft model":
        drafter = DraftModelDrafter(to_float32(tiny_model(seed=1)), model.args.vocab_size)
    reference = greedy_reference(model, PROMPT, 24)
    tokens, steps, _ = decode(model, PROMPT, 24, drafter, sampling=SamplingParams())
    assert tokens == reference
    assert graphs.settle(60)
    again, _, _ = decode(model, PROMPT, 24, drafter, sampling=SamplingParams())
    assert again == reference


def test_a_process_ending_with_builds_queued_exits_cleanly(tmp_path):
    """A fresh process with an empty kernel cache: its generation ends with its graphs' builds
    queued or under way; it finishes them, exits with 0 and leaves kernels and a marker, with
    which the next process compiles its graphs at once and exits with 0 too."""
    code = (
        "import mlx_speculate as m\n"
        f"model, tok = m.load({str(MODELS / 'stories260K-llama')!r})\n"
        "print(len(list(m.stream_generate(model, tok, 'Once upon', max_tokens=4))))\n"
    )
    env = dict(os.environ, TMPDIR=str(tmp_path))
    for run in range(2):
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split()[-1] == "4"
        if run == 0 and mx.default_device() == mx.cpu:
            assert list(tmp_path.rglob("*.so"))
            assert list(tmp_path.glob("mlx/*/cpu/mlx_speculate/*"))  # the model's marker


@pytest.mark.parametrize("name", ["gelu_approx", "softplus", "silu"])
def test_activations_in_eager_calls_equal_mlx_nn(background, name):
    """The models' activations, eager before and after their kernels are built, give
    `mlx.nn`'s values."""
    import mlx.nn as nn

    from mlx_speculate.models import activations

    x = 4 * mx.random.normal((3, 50))
    for _ in range(2):
        with graphs.eager():
            ours = getattr(activations, name)(x)
        assert mx.allclose(ours, getattr(nn, name)(x), rtol=1e-5, atol=1e-6).item()
        assert graphs.settle(60)


def test_a_split_model_builds_its_graphs_in_place(monkeypatch):
    """A model split over ranks has collectives in its graphs: no background build may run
    them out of step with the other ranks."""
    from mlx_speculate.parallel.sharding import Split

    monkeypatch.setattr(graphs, "BACKGROUND", True)
    Split(mx.distributed.init(), "pipeline").apply(tiny_model())
    assert graphs.BACKGROUND is False


def test_a_graph_built_synchronously_runs_compiled_after(background):
    """A graph first called within `synchronous()` (a start-up calibration's steps) is built
    there: later calls outside it run compiled with nothing queued, and on the CPU a marker
    lets the next process compile graphs of its kind at once."""
    model = to_float32(tiny_model())
    calls = []
    build = lambda: lambda x: (calls.append(x.shape) or x + 1,)  # noqa: E731
    fn = graphs.compiled(model, ("test", "built synchronously"), build)
    with graphs.synchronous():
        mx.eval(fn(mx.zeros((3,))))
    traced = len(calls)
    (out,) = fn(mx.ones((3,)))
    assert out.tolist() == [2.0] * 3
    assert len(calls) == traced  # compiled: the Python function did not run again
    assert graphs.settle(0)  # and no build was queued
    if mx.default_device() == mx.cpu:
        assert len(list(background.iterdir())) == 1


def test_no_build_starts_within_a_synchronous_section(background):
    """A build queued before a synchronous section (what calibration times) waits for its end,
    however long it is quiet: a build's compiler would share the cores with what is timed."""
    model = to_float32(tiny_model())
    build = lambda: lambda x: (x * 5 + 2,)  # noqa: E731
    (out,) = graphs.compiled(model, ("test", "held back"), build)(mx.ones((3,)))
    assert out.tolist() == [7.0] * 3  # eager, its build queued
    with graphs.synchronous():
        time.sleep(4 * graphs.IDLE_SECONDS)  # quiet for longer than a build waits
        assert not graphs.settle(0)
    assert graphs.settle(60)


@pytest.mark.parametrize("family", ["llama", "qwen3_5_text"])
def test_batch_steps_built_ahead_compile_at_once(background, family):
    """A server builds its batch step's graphs at start-up (`batch.step.build`), in place:
    nothing is left queued, and on the CPU a batch step of another width and span (a first
    request's) compiles at once where it would run eagerly with a build queued behind it."""
    from mlx_speculate.batch.cache import BatchKVCache
    from mlx_speculate.batch.step import build, forward

    from .test_hybrid import tiny_hybrid

    model = to_float32(tiny_model() if family == "llama" else tiny_hybrid(family))
    build(model, 2)
    assert graphs.settle(0)
    if mx.default_device() != mx.cpu:
        return  # no markers: a GPU builds each graph in the background on its first call
    # The batch step's kinds: a plain (chain) step's, and a tree step's where the cache
    # follows trees (a hybrid's does not).
    assert len(list(background.iterdir())) == (2 if family == "llama" else 1)
    cache = BatchKVCache.of(model, 2)
    cache.offsets = [40, 7]
    start = cache.prepare(3)
    positions = start[:, None] + mx.arange(3, dtype=mx.int32)
    out = forward(model, cache, mx.ones((2, 3), dtype=mx.int32), positions, None, ()).model
    mx.eval(out.logits)
    assert graphs.settle(0)


def test_calibrating_a_tree_drafter_builds_a_trees_step(background):
    """A calibration whose drafter drafts trees (Medusa's, prompt lookup's) builds a tree's
    verify step too, whose mask fuses kernels of its own: a first request's tree step, of
    another shape, then compiles at once (on the CPU; a GPU has no markers)."""
    if mx.default_device() != mx.cpu:
        pytest.skip("markers say which CPU kernels are on disk; a GPU has none")
    from mlx_speculate.drafters import MedusaSpec, make_drafter
    from mlx_speculate.heads.medusa import MedusaHeads
    from mlx_speculate.policy import measure
    from mlx_speculate.sequence import Sequence
    from mlx_speculate.step import verify as verify_step
    from mlx_speculate.tree import Tree

    model = to_float32(tiny_model())
    drafter = make_drafter(MedusaSpec(heads=MedusaHeads(64, 97, num_heads=2)), model)
    *_, trees = measure.measure(model, drafter, (1, 4, 8), progress=False, quick=True)
    assert trees and graphs.settle(60)
    sequence = Sequence(model)
    sequence.prefill(PROMPT)  # eager: its fused functions' builds are queued
    assert graphs.settle(60)
    tree = Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0)])
    drafted = mx.ones((tree.num_nodes - 1,), dtype=mx.int32)
    pending = mx.ones((1,), dtype=mx.int32)
    out = verify_step(model, sequence.cache, pending, tree, drafted, None, measure.GREEDY)
    mx.eval(out.logits)
    assert graphs.settle(0)


def test_a_built_graph_runs_compiled_beside_a_queued_build(background):
    """Another graph's build only queued (waiting for the cores to be free, as it does under
    concurrent requests) leaves a built graph compiled: only a build under way, whose compiler
    holds the lock a compiled call takes, sends calls to their eager form."""
    model = to_float32(tiny_model())
    calls = []
    build = lambda: lambda x: (calls.append(x.shape) or x - 1,)  # noqa: E731
    built = graphs.compiled(model, ("test", "built first"), build)
    with graphs.synchronous():
        mx.eval(built(mx.zeros((3,))))
    graphs.compiled(model, ("test", "queued after"), build)(mx.ones((3,)))  # eager
    traced = len(calls)
    (out,) = built(mx.ones((3,)))
    assert out.tolist() == [0.0] * 3
    assert len(calls) == traced and not graphs.settle(0)  # compiled, the other still queued


def test_building_in_place_finishes_the_builds_queued_before(background):
    """A model about to be split over ranks (`build_in_place`) first has its queued builds
    run: one left for after the split would trace its collectives on one rank alone."""
    model = to_float32(tiny_model())
    build = lambda: lambda x: (x * 7,)  # noqa: E731
    graphs.compiled(model, ("test", "queued before a split"), build)(mx.ones((3,)))
    assert not graphs.settle(0)
    graphs.build_in_place()
    assert graphs.settle(0)


def test_a_build_ahead_runs_once_per_machine(background):
    """`graphs.ahead` runs a start-up build on a machine's first start only (on the CPU, where
    its kernels stay on disk); on a GPU every process builds its own."""
    model = to_float32(tiny_model())
    runs = []
    for _ in range(2):
        graphs.ahead(model, ("test", 2), lambda: runs.append(1))
    assert len(runs) == (1 if mx.default_device() == mx.cpu else 2)
    graphs.ahead(model, ("test", 4), lambda: runs.append(1))  # another name: built too
    assert len(runs) == (2 if mx.default_device() == mx.cpu else 3)


def test_start_up_builds_trace_the_steps_at_the_depths_requests_reach(background):
    """A server's start-up builds (`step.build`, `batch.step.build`) leave the steps of
    greedy and sampled decoding alone, and greedy batch steps, traced at each of DEPTHS: a
    first request's step there traces nothing."""
    from mlx_speculate.batch.cache import BatchKVCache
    from mlx_speculate.batch.step import build as build_batch
    from mlx_speculate.batch.step import forward
    from mlx_speculate.step import BUILT_RULES, DEPTHS, build, verify
    from mlx_speculate.tree import Tree

    model = to_float32(tiny_model(max_position_embeddings=1024))
    build(model)
    build_batch(model, 2)
    before = graphs.built()
    for depth in DEPTHS[1:]:
        cache = model.make_cache()
        model(mx.ones((1, depth), dtype=mx.int32), cache)
        for rule in BUILT_RULES:
            drafted = mx.ones((3,), mx.int32)
            out = verify(model, cache, mx.ones((1,), mx.int32), Tree.chain(3), drafted, None, rule)
            mx.eval(out.acceptance.tokens, out.logits)
            cache.truncate(depth)
        batch = BatchKVCache.of(model, 2)
        batch.offsets = [depth, depth]
        start = batch.prepare(4)
        positions = start[:, None] + mx.arange(4, dtype=mx.int32)
        tokens = mx.ones((2, 4), dtype=mx.int32)
        mx.eval(forward(model, batch, tokens, positions, None, ()).model.logits)
    assert graphs.built() == before


CONSTANT_KERNELS = """
import glob, json, os, sys
import mlx.core as mx
from mlx_speculate.batch.cache import BatchKVCache
from mlx_speculate.batch.step import forward
from mlx_speculate.graphs import synchronous
from mlx_speculate.sampling import SamplingParams
from mlx_speculate.step import decode, verify
from mlx_speculate.tree import Tree
from mlx_speculate.verify import AcceptanceRule
from tests.helpers import tiny_model, to_float32

model = to_float32(tiny_model())
V = model.args.vocab_size
def kernels():
    return set(glob.glob(os.path.join(os.environ["TMPDIR"], "mlx", "**", "*.so"), recursive=True))
def trees(n):  # a tree of n nodes, alone and in a batch
    cache = model.make_cache()
    model(mx.ones((1, 9), dtype=mx.int32), cache)
    tree = Tree((-1, 0, *range(n - 2)))  # two branches
    out = verify(model, cache, mx.ones((1,), mx.int32), tree, mx.ones((n - 1,), mx.int32), None,
                 AcceptanceRule(SamplingParams()))
    mx.async_eval(out.acceptance.tokens, out.acceptance.num_accepted, out.acceptance.path)
    mx.eval(out.logits, cache.state)
    batch = BatchKVCache.of(model, 2)
    batch.offsets = [9, 30]
    start = batch.prepare(n)
    positions = start[:, None] + mx.arange(n, dtype=mx.int32)
    mask = mx.stack([mx.tril(mx.ones((n, n), dtype=mx.bool_))] * 2)
    step = forward(model, batch, mx.ones((2, n), dtype=mx.int32), positions, mask, ())
    mx.eval(step.model.logits, batch.state)
def sampling(params):  # a sampled verify step and a draft model's sampled chain
    cache = model.make_cache()
    model(mx.ones((1, 9), dtype=mx.int32), cache)
    q = mx.log(mx.softmax(mx.random.normal((3, V)), axis=-1))
    out = verify(model, cache, mx.ones((1,), mx.int32), Tree.chain(3), mx.ones((3,), mx.int32),
                 q, AcceptanceRule(params))
    mx.async_eval(out.acceptance.tokens, out.acceptance.num_accepted, out.acceptance.path)
    mx.eval(out.logits, cache.state)
    mx.eval(decode(model, cache, mx.ones((2,), mx.int32), 3, params, V, V))
case = sys.argv[1]
runs = {
    "trees": [lambda: trees(12), lambda: trees(24)],  # two row buckets
    "sampling": [lambda: sampling(SamplingParams(0.7, top_p=0.9, min_p=0.05)),
                 lambda: sampling(SamplingParams(1.3, top_p=0.8, min_p=0.1))],
}[case]
new = []
with synchronous():
    for run in runs:
        before = kernels()
        run()
        new.append(sorted(os.path.basename(k) for k in kernels() - before))
print(json.dumps(new))
"""


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="MLX keeps kernels on disk on the CPU")
@pytest.mark.parametrize("case", ["trees", "sampling"])
def test_widths_and_sampling_settings_share_their_compiled_kernels(tmp_path, case):
    """A tree's width and a request's sampling settings (temperature, top-p, min-p) reach a
    step's graph as inputs, never as constants inlined into a fused kernel: on an empty
    kernel cache, a second width (alone and in a batch) or a second client's settings (a
    sampled verify step, a draft model's sampled chain) compile no kernel that differs from
    one of the first's only by its constants, where each value would compile its own inside
    the request that first meets it. (Other new kernels are layouts the backend picks by
    shape, which start-up builds cover.)"""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run(
        [sys.executable, "-c", CONSTANT_KERNELS, case],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    first, second = json.loads(run.stdout)
    assert first  # the cache was empty: the first run compiled its kernels

    def stem(name: str) -> str:  # a kernel's name without the hash of its constants
        return re.sub(r"_\d{6,}_", "_", name)

    assert not {stem(k) for k in second} & {stem(k) for k in first}
