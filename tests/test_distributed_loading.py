"""Loading under `mlx.launch` (ring backend on loopback, CPU): each rank reads only its part
of the checkpoint; ranks that found different checkpoints, a rank that exits and a rank that
hangs each end the run with a one-line error instead of a hang."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .helpers import random_weights, tiny_config
from .test_distributed import run_launch, worker_command
from .test_loading import write_folder

# Layers dominate (embeddings stay whole on every rank): 4 x 0.98M parameters vs 50K.
WIDE = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4}


def folder(path: Path, **overrides) -> str:
    config = tiny_config(**{**WIDE, **overrides})
    return str(write_folder(path, config, random_weights(config)))


def launch(tmp_path: Path, spec: dict, ranks: int = 2):
    done = run_launch(worker_command("dist_loading.py", ranks, tmp_path, spec))
    records = {}
    for rank in range(ranks):
        file = tmp_path / f"rank{rank}.json"
        records[rank] = json.loads(file.read_text()) if file.exists() else None
    return done, records


def test_each_rank_reads_only_its_slices(tmp_path):
    model = folder(tmp_path / "m")
    whole = (Path(model) / "model.safetensors").stat().st_size
    done, records = launch(tmp_path, {"folders": [model, model]})
    assert all(r is not None and "tokens" in r for r in records.values()), done.stderr[-3000:]
    assert records[0]["tokens"] == records[1]["tokens"]
    for r in records.values():
        assert 0.48 * whole < r["bytes"] < 0.53 * whole, (r["bytes"], whole)
        # Read lazily, one tensor at a time: the whole model never sits in memory at once.
        assert r["peak"] < 0.7 * whole, (r["peak"], whole)
        mb = r["bytes"] / 1e6
        assert f"tensor parallel over 2 ranks, {mb:.1f} MB of weights on this rank" in (
            r["describe"]
        )


def test_ranks_with_different_models_fail_naming_them(tmp_path):
    a, b = folder(tmp_path / "a"), folder(tmp_path / "b", max_position_embeddings=512)
    done, records = launch(tmp_path, {"folders": [a, b]})
    for r in records.values():
        assert r is not None, done.stderr[-3000:]
        assert r["error"].startswith("the ranks loaded different models (rank 0 vs rank 1)")


def test_ranks_with_different_draft_models_fail_naming_them(tmp_path):
    model = folder(tmp_path / "m")
    a, b = folder(tmp_path / "a", num_hidden_layers=1), folder(tmp_path / "b")
    done, records = launch(tmp_path, {"folders": [model, model], "drafts": [a, b]})
    for r in records.values():
        assert r is not None, done.stderr[-3000:]
        assert r["error"].startswith("the ranks loaded different drafters (rank 0 vs rank 1)")


def test_a_rank_that_exits_ends_the_others_with_one_line(tmp_path):
    model = folder(tmp_path / "m")
    done, records = launch(tmp_path, {"folders": [model, model], "fault": "exit"})
    assert records[1] is None
    assert records[0] is not None, done.stderr[-3000:]
    assert records[0]["error"].startswith("rank 0: lost the connection to another rank")


def test_a_rank_that_hangs_ends_the_others_within_the_timeout(tmp_path):
    model = folder(tmp_path / "m")
    start = time.monotonic()
    done, records = launch(tmp_path, {"folders": [model, model], "fault": "hang", "timeout": 3})
    # The hung rank would sleep 600 s: the watchdog ended rank 0, and mlx.launch rank 1.
    assert time.monotonic() - start < 200
    assert records == {0: None, 1: None}
    assert "error: rank 0: no step finished in 3 s: another rank died or hangs" in done.stderr
