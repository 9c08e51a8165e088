"""Shared fixtures: the ../shared data folder and tiny seeded models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .helpers import SHARED


def _require(path: Path) -> Path:
    if path.exists():
        return path
    reason = f"{path} is absent (it ships beside the development checkout, not in the repo)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


@pytest.fixture
def shared_models() -> Path:
    """../shared/models; skips when absent, fails under CI=true."""
    return _require(SHARED / "models")


@pytest.fixture
def shared_dir() -> Path:
    return _require(SHARED)
