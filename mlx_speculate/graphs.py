"""Compiled graphs per model: each built once, shared by every decoder of the model (a
server's sessions, repeated generate calls), and every trace counted, since a step that paid
for one tells nothing of what its size costs (`decode.Step.traced`).

A graph's kernels are built off the request's path. Until they are, its calls run eagerly
(what mlx-lm runs), while a background thread traces the graph and evaluates it once on
zeros of the same shapes, which makes the backend compile its fused kernels. On a GPU that
thread works beside the request (Metal compiles in every process; the device does the
request's work). On the CPU the system's C++ compiler builds each kernel, seconds per graph,
and shares the cores with the request, so builds wait until no graph has been called for
IDLE_SECONDS (between requests; at exit, where a process finishes its builds before it
ends). MLX keeps CPU kernels on disk, and a marker beside them says a model's graphs of one
kind were built (`_kind`: a plain step, a fused EAGLE step, a batch step): later processes
compile graphs of that kind at once. Why: a model's first request would otherwise wait for
every kernel its graphs fuse, where the same ops eagerly cost about what mlx-lm's do.
`synchronous()` builds in the calling thread instead (what calibration times).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .memo import Table, per_model

# Compiled functions per model (keyed by id, dropped with the model).
_COMPILED: Table = {}
# Background builds per model, keyed by a graph's key without its span: graphs that differ
# only in how many cache slots they read fuse the same kernels.
_BUILDS: Table = {}
_built = 0  # graphs traced (or run eagerly while being built) so far

BACKGROUND = True  # first calls run eagerly while a thread builds the graph's kernels
IDLE_SECONDS = 0.25  # on the CPU, how long no graph is called before a build starts
NICENESS = 19  # the build thread's, and so its compiler's, priority below the caller's
EXIT_SECONDS = 300.0  # the most a process waits at exit for its queued builds

_local = threading.local()
_last_call = 0.0  # time.monotonic() of the last graph called in eager or compiled form


def built() -> int:
    """How many graphs the functions `compiled` makes have traced: one on each call with
    input shapes not seen before (a first call, and mx.compile traces again when a cache's
    storage grows: a step that traced costs several times a steady one), and one on each call
    run eagerly while its graph is built in the background (it costs what no later step will)."""
    return _built


def settle(timeout: float | None = None) -> bool:
    """Waits until no graph is being built or waits to be (at most `timeout` seconds); whether
    none is. On the CPU, a queued build starts once no graph has been called for a while."""
    return _builder.idle.wait(timeout)


def build_in_place() -> None:
    """From now on, in this process, graphs are built where they are called (no eager calls,
    no background builds): a model split over ranks has collectives in its graphs, which a
    background build would run out of step with the other ranks. Builds queued before (an
    unsplit model's) finish first, since one run after the split would trace its collectives
    on this rank alone."""
    global BACKGROUND
    BACKGROUND = False
    settle()


@contextmanager
def synchronous() -> Iterator[None]:
    """Within it, graphs this thread calls are traced and their kernels compiled at once in
    this thread, as every call after a background build is (what a measurement times). No
    background build starts while one is open, and one under way is waited for first: a
    build's compiler would share the cores and the compiler's lock with what is timed, and on
    an empty kernel cache price a step at many times its cost."""
    with _builder.holding(), _flag("synchronous", True):
        yield


@contextmanager
def eager() -> Iterator[None]:
    """Within it (a prompt's forward, a graph's eager call), a `Fused` function whose kernels
    are not built yet, or while any graph is being built, runs as MLX's own unfused ops: a
    compiled kernel would wait for the compiler, which builds one kernel at a time under one
    lock that every compiled kernel's lookup takes."""
    with _flag("eager", True):
        yield


def is_eager() -> bool:
    """Whether this thread is inside `eager()` (and not in a compiled graph's call)."""
    return getattr(_local, "eager", False)


@contextmanager
def _flag(name: str, value: bool) -> Iterator[None]:
    before = getattr(_local, name, False)
    setattr(_local, name, value)
    try:
        yield
    finally:
        setattr(_local, name, before)


def compiled(
    model,
    key: tuple,
    build: Callable[[], Callable],
    traced: bool = True,
    span: int | None = None,
) -> Callable:
    """The function `build()` makes for `model` and `key`, under `mx.compile` (the random state
    passed through) unless `traced` is False (a model that cannot be traced); built once, its
    first calls eager while its kernels are built in the background (see the module). `span`:
    the cache slots the graph reads, part of its shapes but not of its kernels (graphs of one
    key and several spans share one background build). Weights are the graph's constants, but
    a model with scalar weights passes its arrays as inputs (`_scalar_weights`)."""

    def make() -> Callable:
        fn = build()
        if not traced:
            return fn
        # Weights are evaluated first: a lazy one (random, quantized or cast in memory,
        # loaded lazily) would be computed again inside every call.
        mx.eval(model.parameters())
        graph = _counted(_compile(model, fn))
        marker = _marker(model, key)
        if not _unbuilt(marker):
            return graph
        pending = per_model(_BUILDS, model, key, lambda: _Build(marker=marker))
        return _Lazy(fn, graph, pending, lambda: _compile(model, build()))

    return per_model(_COMPILED, model, key if span is None else (*key, span), make)


def variable(value: float, dtype: mx.Dtype) -> mx.array:
    """`value` as a (1,) array of `dtype` made by an op, which a compiled graph computes: a
    Python number (or `mx.array(value)`) is a constant that MLX inlines into the fused
    kernels using it, so every value (a tree's width, a client's temperature) would compile
    kernels of its own, on the CPU seconds each inside the request that first meets it."""
    return mx.full((1,), value, dtype=dtype)


def ahead(model, name: tuple, build: Callable[[], None]) -> None:
    """Runs `build` (graphs built ahead of requests, `name` naming them: a server's start-up
    builds), unless this machine built them for a model of `model`'s class and parameters
    before: on the CPU a marker beside MLX's kernel cache says so, and the kernels they
    compiled are on disk, so requests trace their graphs at once. On a GPU, whose kernels
    live in the process, always."""
    marker = _named_marker((*_model_name(model), "ahead", name))
    if marker is not None and marker.exists():
        return
    build()
    if marker is not None:
        _touch(marker)


def _compile(model, fn: Callable) -> Callable:
    state = mx.random.state
    inputs = [state, model] if _scalar_weights(model) else state
    return mx.compile(fn, inputs=inputs, outputs=state)


def _scalar_weights(model) -> bool:
    """Whether `model` has a weight of one element (Gemma 4's per-layer `layer_scalar`). A graph
    inlines its scalar constants into its kernels, so such weights held as constants make a
    kernel per layer, each compiled by the backend's JIT on a model's first request; as inputs
    they share one (the module read on each call, which costs a traversal of its arrays)."""
    return any(w.size == 1 for _, w in tree_flatten(model.parameters()))


def _counted(fn: Callable) -> Callable:
    """`fn`, counting in `built()` the calls with input shapes it has not seen."""
    seen: set[tuple] = set()

    def call(*args: mx.array):
        global _built, _last_call
        _last_call = time.monotonic()
        shapes = tuple(a.shape for a in args)
        if shapes not in seen:
            seen.add(shapes)
            _built += 1
        return fn(*args)

    return call


def _marker(model, key: tuple) -> Path | None:
    """The marker of `model`'s graphs of `key`'s kind (`_named_marker`), named by the model's
    class, its parameters' names, shapes and dtypes, and the names in the key (`_kind`)."""
    return _named_marker((*_model_name(model), _kind(key)))


def _model_name(model) -> tuple:
    """What names a model in a marker: its class, its parameters' names, shapes and dtypes."""
    parameters = [(name, w.shape, str(w.dtype)) for name, w in tree_flatten(model.parameters())]
    return type(model).__module__, type(model).__qualname__, parameters


def _kind(key: object) -> tuple[str | bool, ...]:
    """The names and flags in a graph's key, nested keys included ("verify", "eagle", whether
    a step verifies a chain or a tree, reads a draft's probabilities, is masked by a grammar):
    what kind of graph it is, which decides the kernels it fuses, where its numbers (sizes,
    widths, a head's id) only vary its shapes. A nested key of a kind its key holds already
    counts once (a batch step's fused rows: four EAGLE rows fuse the kernels one does). Why:
    a method first used in a later process (its graphs' kind without a marker) builds its
    kernels in the background too, and a tree's step after chains' (a tree's mask fuses
    kernels of its own) runs eagerly while it builds rather than compiling them inside a
    request for seconds."""
    if isinstance(key, str | bool):
        return (key,)
    if not isinstance(key, tuple):
        return ()
    kind: list[str | bool] = []
    nested: list[tuple] = []
    for part in key:
        part_kind = _kind(part)
        if isinstance(part, tuple):
            if part_kind in nested:
                continue
            nested.append(part_kind)
        kind.extend(part_kind)
    return tuple(kind)


def _named_marker(name: tuple) -> Path | None:
    """On the CPU, the file that says the kernels of what `name` names were built on this
    machine, beside MLX's kernel cache (`$TMPDIR/mlx/<version>/cpu`). None on a GPU, whose
    kernels live in the process."""
    if mx.default_device() != mx.cpu:
        return None
    return _markers() / hashlib.sha256(repr(name).encode()).hexdigest()[:32]


def _markers() -> Path:
    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "cpu" / "mlx_speculate"


def _unbuilt(marker: Path | None) -> bool:
    """Whether a graph or function with this marker is built in the background: builds are
    on, and no earlier process built it (the marker is absent, or there is none: a GPU)."""
    return BACKGROUND and not (marker is not None and marker.exists())


@dataclass
class _Build:
    """One background build: started by a first call, done when its graph has run once or
    raised (the caller then traces the graph itself, and meets the error); `marker` written
    when it succeeded."""

    marker: Path | None = None
    started: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class _Lazy:
    """A graph's calls: eager until its build is done and no other is under way (a compiled
    call would wait for the compiler's lock), compiled after."""

    def __init__(self, fn: Callable, graph: Callable, build: _Build, make: Callable[[], Callable]):
        self.fn, self.graph, self.build, self.make = fn, graph, build, make

    def __call__(self, *args: mx.array):
        global _built, _last_call
        if getattr(_local, "synchronous", False):
            with _flag("eager", False):
                out = self.graph(*args)
            # Its kernels are built here, as the caller evaluates it: later calls run it
            # compiled (after a start-up calibration, a first request's steps too), and a
            # later process compiles graphs of its kind at once.
            if not self.build.started:
                self.build.started = True
                self.build.done.set()
                if self.build.marker is not None:
                    _touch(self.build.marker)
            return out
        if _builder.ready(self.build):
            with _flag("eager", False):  # traced with the fused functions inline
                return self.graph(*args)
        _last_call = time.monotonic()
        if not self.build.started:
            self.build.started = True
            _builder.submit(self.build, self.make, [(a.shape, a.dtype) for a in args])
        _built += 1
        with eager():
            return self.fn(*args)


class Fused:
    """`fn` under mx.compile, for calls outside a compiled graph (inside one it is traced
    inline). Within `eager()`, `fallback` (the same math in MLX's own ops) runs instead until
    `fn`'s kernels for the arguments' dtypes and ranks are built in the background."""

    def __init__(self, fn: Callable, fallback: Callable):
        self.fn, self.fallback, self.compiled = fn, fallback, mx.compile(fn)
        self.builds: dict[tuple, _Build] = {}

    def __call__(self, *args: mx.array) -> mx.array:
        global _last_call
        if not is_eager():
            return self.compiled(*args)
        signature = tuple((a.dtype, a.ndim) for a in args)
        build = self.builds.get(signature)
        if build is None:
            build = self.builds[signature] = self._build(signature, args)
        if _builder.ready(build):
            return self.compiled(*args)
        _last_call = time.monotonic()
        return self.fallback(*args)

    def _build(self, signature: tuple, args: tuple[mx.array, ...]) -> _Build:
        marker = _named_marker((self.fn.__module__, self.fn.__qualname__, signature))
        build = _Build(marker=marker, started=True)
        if _unbuilt(marker):
            _builder.submit(build, lambda: mx.compile(self.fn), [(a.shape, a.dtype) for a in args])
        else:
            build.done.set()
        return build


class _Builder:
    """The thread that builds graphs, one at a time, at a lower priority, and on the CPU only
    once no graph has been called for IDLE_SECONDS or the main thread has ended. It lives as
    long as the process (a daemon blocked between builds), and a process waits at exit for
    the builds it queued (`finish`): a thread that ended just before the process did would
    race MLX's per-thread state against its teardown."""

    def __init__(self):
        self.lock = threading.Condition()
        self.queue: deque = deque()
        self.thread: threading.Thread | None = None
        self.building = 0  # builds queued or under way
        self.idle = threading.Event()
        self.idle.set()
        self.stopping = False  # set at exit by Ctrl-C: no further build starts
        self.held = 0  # `synchronous()` sections open: no build starts meanwhile
        self.under_way = False  # a build has started and not ended

    @contextmanager
    def holding(self) -> Iterator[None]:
        """No build starts within it; entering waits for one under way to end."""
        global _last_call
        with self.lock:
            self.held += 1
            while self.under_way:
                self.lock.wait()
        try:
            yield
        finally:
            with self.lock:
                _last_call = time.monotonic()  # builds wait for quiet from here
                self.held -= 1
                self.lock.notify_all()

    def ready(self, build: _Build) -> bool:
        """Whether `build` is done and no build is under way (one only queued, waiting for the
        cores to be free, holds no lock a compiled call takes)."""
        return build.done.is_set() and not self.under_way

    def submit(self, build: _Build, make: Callable[[], Callable], shapes: list) -> None:
        with self.lock:
            self.queue.append((build, make, shapes))
            self.building += 1
            self.idle.clear()
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, name="mlx_speculate-graphs", daemon=True
                )
                self.thread.start()
                atexit.register(self.finish)
            self.lock.notify_all()

    def finish(self) -> None:
        """Waits for the queued builds (at exit, where the main thread has ended). Ctrl-C
        leaves those not started to a later process and waits for the one under way (a thread
        inside MLX as the process tears MLX down could crash it); a second Ctrl-C waits for
        nothing."""
        try:
            self.idle.wait(EXIT_SECONDS)
        except KeyboardInterrupt:
            with self.lock:
                self.stopping = True
            try:
                self.idle.wait(EXIT_SECONDS)
            except KeyboardInterrupt:
                pass

    def _run(self) -> None:
        if sys.platform.startswith("linux"):
            try:  # a Linux thread's own priority, inherited by the compiler it starts
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
            except OSError:
                pass
        while True:
            with self.lock:
                while not self.queue:
                    self.lock.wait()
                build, make, shapes = self.queue[0]
            if not self._start(build):
                continue
            try:
                mx.eval(make()(*(mx.zeros(shape, dtype) for shape, dtype in shapes)))
                if build.marker is not None:
                    _touch(build.marker)
            except Exception:  # the caller's own trace meets it again
                pass
            with self.lock:
                self._ended(build)

    def _start(self, build: _Build) -> bool:
        """Takes the queue's first build, `build`, once the cores are free (on the CPU, once no
        graph has been called for a while; and no synchronous section is open); False when it
        is not to start (Ctrl-C at exit)."""
        while True:
            if build.marker is not None:  # on the CPU: the request's cores first
                self._wait_for_quiet()
            with self.lock:
                if self.held:  # a section times or builds in its thread: quiet after it
                    while self.held:
                        self.lock.wait()
                    continue
                self.queue.popleft()
                if self.stopping:  # left to be traced where it is called
                    self._ended(build)
                    return False
                self.under_way = True
                return True

    def _ended(self, build: _Build) -> None:
        """Marks `build` done, built or not; under the lock."""
        self.under_way = False
        self.lock.notify_all()
        build.done.set()
        self.building -= 1
        if self.building == 0:
            self.idle.set()

    @staticmethod
    def _wait_for_quiet() -> None:
        while threading.main_thread().is_alive():
            quiet = time.monotonic() - _last_call
            if quiet >= IDLE_SECONDS:
                return
            time.sleep(IDLE_SECONDS - quiet)


def _touch(marker: Path) -> None:
    """Creates the empty marker (one step, so never half written); a folder that cannot be
    written only costs later processes their eager first calls."""
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass


_builder = _Builder()
