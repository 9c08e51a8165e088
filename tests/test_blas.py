"""Importing `mlx_speculate` on Linux loads the system's OpenBLAS before MLX, without
LD_PRELOAD; `MLX_SPECULATE_OPENBLAS=0` keeps the wheel's BLAS; `--verbose` says which runs."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from mlx_speculate import blas

from .test_cli import ROOT, run, tiny  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux", reason="OpenBLAS is loaded on Linux only (macOS: Accelerate)"
)

PROBE = """
import json
import {first}
import {second}
from mlx_speculate import blas
mapped = sorted({{line.split()[-1] for line in open("/proc/self/maps") if "/libopenblas" in line}})
print(json.dumps(mapped))
print(blas.BLAS)
"""


def installed() -> bool:
    return any(p.exists() or not p.is_absolute() for p in blas.candidates())


def probe(first="mlx_speculate", second="mlx.core", **env) -> tuple[list[str], str]:
    """What a fresh interpreter without LD_PRELOAD maps, and what it says runs."""
    environment = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.VARIABLE)}
    code = PROBE.format(first=first, second=second)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
        env={**environment, **env}, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    mapped, said = done.stdout.strip().splitlines()
    return json.loads(mapped), said


def test_importing_the_package_maps_openblas_when_installed():
    mapped, said = probe()
    if installed():
        assert mapped and said.startswith("OpenBLAS ("), (mapped, said)
    else:
        assert not mapped and "apt install libopenblas0-pthread" in said


@pytest.mark.parametrize("value", ["0", "off"])
def test_the_variable_keeps_the_wheels_blas(value):
    mapped, said = probe(**{blas.VARIABLE: value})
    assert not mapped
    assert said == f"the mlx wheel's reference BLAS ({blas.VARIABLE}={value})"


def test_mlx_imported_first_is_too_late_and_says_so():
    mapped, said = probe(first="mlx.core", second="mlx_speculate")
    assert not mapped and "MLX was imported before mlx_speculate" in said


@pytest.mark.parametrize("value", [None, "0"])
def test_verbose_names_the_blas(tiny, value):  # noqa: F811
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.VARIABLE)}
    if value is not None:
        env[blas.VARIABLE] = value
    done = run(["--model", str(tiny), "--prompt", "w1 w2", "-m", "2", "--verbose"], env=env)
    err = done.stderr.decode()
    assert done.returncode == 0, err
    if value is None and installed():
        assert "Compute: float32 on the cpu (float32 matmuls: OpenBLAS (" in err, err
    else:
        assert "(float32 matmuls: the mlx wheel's reference BLAS (" in err, err
