"""Shared fixtures: the ../shared data folder and tiny seeded models."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import SHARED, require

_BESIDE = "it ships beside the development checkout, not in the repository"


@pytest.fixture
def shared_models() -> Path:
    """../shared/models; skips when absent, fails under CI=true."""
    return require(SHARED / "models", _BESIDE)


@pytest.fixture
def shared_dir() -> Path:
    return require(SHARED, _BESIDE)
