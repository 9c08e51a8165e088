"""Packaging: the project's metadata builds without setuptools' deprecation warnings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_metadata_builds_without_license_deprecation(tmp_path):
    """`project.license` as a TOML table made every `pip install` print a deprecation warning;
    it is an SPDX expression now."""
    script = (
        "import sys, warnings\n"
        "warnings.simplefilter('always')\n"
        "from setuptools import build_meta\n"
        "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Deprecat" not in result.stderr, result.stderr
    metadata = (tmp_path / result.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    assert "License-Expression: MIT" in metadata.splitlines()
