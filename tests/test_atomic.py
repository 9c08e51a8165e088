"""Renaming into place never replaces what another writer put there unless asked: two
`convert`s onto one new folder, both past their early check, end with one folder and one
one-line error, not two "wrote" lines and a silently replaced result."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_speculate import atomic

from .test_convert import save_hf_model

ROOT = Path(__file__).resolve().parents[1]

# The real CLI, held just before its final rename until both writers got there: each has
# checked that DST is absent and staged its whole folder, which is the race to lose.
AT_THE_BARRIER = """
import os, sys, time
from pathlib import Path
import mlx_speculate.convert as c

rename = c.move_into_place

def wait_for_the_other(tmp, dst, **options):
    barrier = Path(os.environ["BARRIER"])
    (barrier / str(os.getpid())).touch()
    deadline = time.monotonic() + 600
    while len(list(barrier.iterdir())) < 2:
        if time.monotonic() > deadline:
            sys.exit("the other writer never got to its rename")
        time.sleep(0.02)
    rename(tmp, dst, **options)

c.move_into_place = wait_for_the_other
sys.exit(c.main(sys.argv[1:]))
"""


def two_writers(src: Path, dst: Path, barrier: Path, *flags: str) -> dict[str, tuple]:
    """Two converts of `src` onto `dst` at once, one float16 and one float32 (to tell their
    folders apart): dtype -> (exit status, stdout, stderr)."""
    barrier.mkdir()
    env = {**os.environ, "BARRIER": str(barrier)}
    processes = {
        dtype: subprocess.Popen(
            [sys.executable, "-c", AT_THE_BARRIER, "--hf-path", str(src), "--mlx-path", str(dst),
             "--dtype", dtype, *flags],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for dtype in ("float16", "float32")
    }
    results = {}
    for dtype, process in processes.items():
        out, err = process.communicate(timeout=900)
        results[dtype] = (process.returncode, out, err)
    return results


@pytest.fixture(params=["hf folder", "gguf"])
def source(request, tmp_path) -> tuple[Path, tuple[str, ...]]:
    """A source and its flags: the GGUF keeps its 4-bit tensors (-q), a small folder to write."""
    if request.param == "gguf":
        return request.getfixturevalue("smollm2_file"), ("-q",)
    return save_hf_model(tmp_path / "hf"), ()


def test_two_converts_onto_one_new_folder_one_wins_the_other_says_so(source, tmp_path):
    src, flags = source
    dst = tmp_path / "out" / "mlx"
    results = two_writers(src, dst, tmp_path / "barrier", *flags)
    won = [dtype for dtype, (status, _, _) in results.items() if status == 0]
    assert len(won) == 1, results
    (lost,) = set(results) - set(won)
    status, out, err = results[lost]
    assert status == 2 and "wrote" not in out, (out, err)
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (  # after the progress bar of its own writing
        f"error: {dst} already exists: another process wrote it meanwhile "
        "(pass --overwrite to replace it)"
    )
    # The winner's folder stays, not replaced by the loser's; no staging folder is left.
    assert results[won[0]][1].strip().splitlines()[-1].startswith(f"wrote {dst} (")
    assert json.loads((dst / "config.json").read_text())["torch_dtype"] == won[0]
    assert sorted(p.name for p in dst.parent.iterdir()) == ["mlx"]


def test_with_overwrite_both_write_and_one_folder_stays(tmp_path):
    src = save_hf_model(tmp_path / "hf")
    dst = tmp_path / "mlx"
    results = two_writers(src, dst, tmp_path / "barrier", "--overwrite")
    assert [status for status, _, _ in results.values()] == [0, 0], results
    assert json.loads((dst / "config.json").read_text())["torch_dtype"] in results
    assert sorted(p.name for p in tmp_path.iterdir()) == ["barrier", "hf", "mlx"]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("there", ["empty folder", "folder", "file"])
def test_rename_no_replace_refuses_whatever_is_there(tmp_path, monkeypatch, native, there):
    """Even an empty folder, which a plain rename(2) of a folder would replace; the same
    through the locked fallback used where the system has no such call."""
    if not native:
        monkeypatch.setattr(atomic, "_native_no_replace", lambda src, dst: None)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "new").write_text("new")
    if there == "file":
        dst.write_text("old")
    else:
        dst.mkdir()
        if there == "folder":
            (dst / "old").write_text("old")
    with pytest.raises(FileExistsError, match=f"^{dst} already exists$"):
        atomic.rename_no_replace(src, dst)
    assert (src / "new").read_text() == "new"
    if there == "file":
        assert dst.read_text() == "old"
        dst.unlink()
    else:
        assert sorted(os.listdir(dst)) == ([] if there == "empty folder" else ["old"])
        shutil.rmtree(dst)
    atomic.rename_no_replace(src, dst)
    assert (dst / "new").read_text() == "new" and not src.exists()
