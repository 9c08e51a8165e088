"""Training keeps its memory bounded and says how much each stage took: the data stage projects
only the last prompt position, MLX's buffer cache is bounded while training and emptied between
stages, and the CLI prints every stage's peaks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_speculate.device import roomy_cache
from mlx_speculate.sampling import SamplingParams
from mlx_speculate.train import recipe as recipe_module
from mlx_speculate.train.memory import measured

from .helpers import MODELS, tiny_model

ROOT = Path(__file__).resolve().parents[1]
STORIES = MODELS / "stories260K-llama"


def test_measured_reports_each_stage_s_own_peak():
    peaks = {}
    held = mx.get_active_memory()  # what earlier tests in this process keep (models, tables)
    with measured(peaks, "big"):
        big = mx.zeros((64 << 20) // 4)  # 64 MB
        mx.eval(big)
        del big
    with measured(peaks, "small"):
        mx.eval(mx.zeros(1024))
    assert peaks["big"].mlx - held >= 64 << 20 > peaks["small"].mlx - held
    assert peaks["big"].resident >= 64 << 20
    if peaks["small"].per_stage:  # Linux: reset at the stage's start
        assert peaks["small"].resident < peaks["big"].resident
    assert peaks["big"].describe().startswith("peak ")


def test_the_training_cache_is_bounded_and_emptied_after():
    before = mx.set_cache_limit(32 << 20)
    try:
        with roomy_cache(256 << 20):
            assert mx.set_cache_limit(256 << 20) == 256 << 20  # raised to the bound only
            for size in range(1, 12):  # buffers of many sizes, as batch shapes give
                mx.eval(mx.zeros(size * (8 << 20) // 4))
            assert mx.get_cache_memory() <= 256 << 20
        assert mx.get_cache_memory() == 0
        assert mx.set_cache_limit(32 << 20) == 32 << 20  # restored
    finally:
        mx.set_cache_limit(before)


def test_the_data_stage_never_evaluates_the_prompt_s_full_logits():
    """The prompt's forward projects one row a prompt: the (B, P, V) logits would be the
    stage's largest array (16 prompts of 300 tokens of SmolLM2: 944 MB)."""
    from mlx_speculate.train.data import answer

    model = tiny_model(vocab_size=50_000)  # (2, 200, 50k) float32 logits: 80 MB
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    prompts = [list(range(1, 201)), list(range(3, 180))]
    mx.eval(model.parameters())
    mx.clear_cache()
    mx.reset_peak_memory()
    held = mx.get_active_memory()  # the weights and what earlier tests in this process keep
    rows = answer(model, prompts, [2, 2], [], SamplingParams(), mx.random.key(0))
    assert [len(r) for r in rows] == [2, 2]
    assert weights < held
    assert mx.get_peak_memory() - held < 40e6


def test_the_cli_prints_each_stage_s_peak_memory(tmp_path):
    model = STORIES
    done = subprocess.run(
        [sys.executable, "-m", "mlx_speculate.train", "medusa", "--model", str(model),
         "--self-samples", "4", "--max-tokens", "16", "--epochs", "1", "--out",
         str(tmp_path / "heads")],
        capture_output=True, text=True, cwd=ROOT, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for stage in ("data", "features", "train"):
        # As each stage ends, and again in the summary.
        assert any(line.startswith(f"{stage}: ") and " GB resident" in line for line in lines)
        assert any(line.startswith(f"  {stage}: peak ") for line in lines), done.stdout


@pytest.mark.parametrize("kind", ["eagle1"])
def test_the_recipe_releases_a_target_it_loaded_before_training(tmp_path, monkeypatch, kind):
    """Training reads the embedding and lm_head only: the target's layers are gone by then."""
    import weakref

    model = STORIES
    seen = {}
    load = recipe_module.load

    def loading(path):
        target, tokenizer = load(path)
        seen["target"] = weakref.ref(target)
        return target, tokenizer

    train = recipe_module.train

    def training(*args, **kwargs):
        seen["alive while training"] = seen["target"]() is not None
        return train(*args, **kwargs)

    monkeypatch.setattr(recipe_module, "load", loading)
    monkeypatch.setattr(recipe_module, "train", training)
    config = recipe_module.TrainConfig(epochs=1, max_steps=2, batch_tokens=128)
    result = recipe_module.train_head(
        kind, model, tmp_path / "head", progress=False,
        recipe=recipe_module.Recipe(kind, self_samples=4, max_tokens=16, train=config),
    )  # fmt: skip
    assert seen["alive while training"] is False
    assert set(result.peaks) == {"data", "features", "train"}
