"""Shared fixtures: the ../shared data folder and tiny seeded models."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from .blas import BLAS  # first: before anything imports MLX
from .helpers import SHARED, require

_BESIDE = "it ships beside the development checkout, not in the repository"


def pytest_report_header() -> str:
    return f"float32 matmuls: {BLAS}"


@pytest.fixture(autouse=True, scope="session")
def _calibration_in_tmp(tmp_path_factory):
    """The cost curves tests measure go to a temporary folder, not the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLX_SPECULATE_CALIBRATION", str(tmp_path_factory.mktemp("calibration")))
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


@pytest.fixture
def shared_models() -> Path:
    """../shared/models; skips when absent, fails under CI=true."""
    return require(SHARED / "models", _BESIDE)


@pytest.fixture
def shared_dir() -> Path:
    return require(SHARED, _BESIDE)
