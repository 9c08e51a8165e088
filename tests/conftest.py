"""Shared fixtures: the ../shared data folder and tiny seeded models."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import SHARED, require

_BESIDE = "it ships beside the development checkout, not in the repository"


@pytest.fixture(autouse=True, scope="session")
def _calibration_in_tmp(tmp_path_factory):
    """The cost curves tests measure go to a temporary folder, not the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLX_SPECULATE_CALIBRATION", str(tmp_path_factory.mktemp("calibration")))
        yield


@pytest.fixture
def shared_models() -> Path:
    """../shared/models; skips when absent, fails under CI=true."""
    return require(SHARED / "models", _BESIDE)


@pytest.fixture
def shared_dir() -> Path:
    return require(SHARED, _BESIDE)
