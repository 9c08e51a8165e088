"""benchmarks/gpu_suite.py as the device runs it, in its --dry-run mode on stories260K: the JSON
it writes has every key the issue's figures are read from, and each run's token count and
tokens agree with plain decoding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

from mlx_speculate import load
from mlx_speculate.heads.eagle import EagleConfig, eagle_head
from mlx_speculate.heads.eagle_format import save_official

from .helpers import MODELS

ROOT = Path(__file__).resolve().parents[1]
SUITE = [sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py")]
STEPS = {"chain1", "chain2", "chain3", "chain4", "tree60"}


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [*SUITE, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout
    )


def random_stories_head(out: Path) -> Path:
    """An untrained EAGLE-3 head for stories260K (5 layers: taps 0, 2, 4) in the official
    layout, standing in for a trained one: the suite's plumbing is under test, not its tau."""
    model, _ = load(MODELS / "stories260K-llama")
    args = model.args
    layer = {
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.rms_norm_eps,
        "num_hidden_layers": 1,
    }
    head = eagle_head(EagleConfig(version=3, layer=layer, taps=(0, 2, 4)))
    mx.eval(head.parameters())
    return save_official(head, out)


def test_dry_run_writes_every_key(tmp_path):
    head = random_stories_head(tmp_path / "head")
    out = tmp_path / "suite.json"
    result = run("--dry-run", "--eagle-head", str(head), "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    for key in ("device", "mlx_version", "commit", "date"):
        assert isinstance(report[key], str) and report[key], key
    assert report["mode"] == "dry-run" and report["env"]["MLX_ENABLE_TF32"] == "0"
    for key in ("plain_vs_mlx_lm", "draft_vs_mlx_lm", "adaptive_vs_plain", "eagle_vs_plain"):
        assert set(report[key]) == {"stories260K"}, key
        assert report[key]["stories260K"] > 0, key
    steps = report["step_cost_in_plain_steps"]["stories260K"]
    assert set(steps) == STEPS and all(cost > 0 for cost in steps.values())
    target = report["targets"]["stories260K"]
    assert target["eagle_head"] == str(head)
    assert set(target["verify_rows_cost"]) >= {"1", "64"}
    variants = target["variants"]
    assert {"plain", "mlx_lm plain", "adaptive", "eagle adaptive", *STEPS} <= set(variants)
    for label, row in variants.items():
        assert row["count_ok"] and row["tokens"] == target["max_tokens"], label
        # Greedy speculation is lossless; the margins of stories260K's first tokens are wide.
        assert row["equal_to_plain"], label
        assert row["tokens_per_s"] > 0 and row["warmup_seconds"] >= 0, label
    assert "(dry-run)" in result.stdout and "step_cost_in_plain_steps" in result.stdout


def test_bad_head_is_one_error(tmp_path):
    """A --eagle-head that holds no head is named in argparse's error, before any model loads."""
    result = run("--dry-run", "--eagle-head", str(tmp_path), "--out", str(tmp_path / "x.json"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(
        f"error: --eagle-head {tmp_path} holds no EAGLE head (no config.json)"
    )
    assert not (tmp_path / "x.json").exists()
