"""The training recipe's stages are keyed by what they were built from (a run with other settings
never reuses a stale one), its defaults and flags come from the recipe's fields, it says when a
drafter will not pay, and bad input is one line. Tiny models, a step or two: seconds."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import replace

import pytest

from mlx_speculate.train import __main__ as train_cli
from mlx_speculate.train import loop
from mlx_speculate.train.data import make_data, read_conversations, read_prompts
from mlx_speculate.train.features import open_features
from mlx_speculate.train.loop import TrainConfig
from mlx_speculate.train.payoff import BREAK_EVEN, payoff, tokens_per_step
from mlx_speculate.train.recipe import dflash_layers, train_head
from mlx_speculate.train.settings import TRAINING, Recipe, default_training

from .helpers import MODELS, tiny_model

STORIES = MODELS / "stories260K-llama"
ONE_STEP = TrainConfig(epochs=1, max_steps=1, batch_tokens=128, holdout=0.25)


def tiny_recipe(kind: str = "dflash", **settings) -> Recipe:
    return Recipe(kind, self_samples=6, max_tokens=8, sample_prefix=2, data_batch=4,
                  train=ONE_STEP, **settings)  # fmt: skip


def run(model, tmp_path, name: str, recipe: Recipe):
    return train_head(recipe.kind, model, tmp_path / name, cache=tmp_path / "cache",
                      recipe=recipe, progress=False)  # fmt: skip


def test_a_checkpoint_of_another_block_size_is_refused_not_resumed(tmp_path):
    """`--block-size 4` after a block-8 run: one line naming the change, before any stage
    runs, and the old checkpoint kept. A schedule change (the learning rate) resumes it."""
    model = tiny_model("llama")
    first = run(model, tmp_path, "b8", tiny_recipe(block_size=8))
    checkpoint = tmp_path / "cache" / "train-dflash" / "checkpoint"
    before = (checkpoint / "head.safetensors").read_bytes()
    with pytest.raises(ValueError) as refused:
        run(model, tmp_path, "b4", tiny_recipe(block_size=4))
    message = str(refused.value)
    assert "was trained with other settings (block_size 8 -> 4)" in message
    assert str(checkpoint) in message and "\n" not in message
    assert (checkpoint / "head.safetensors").read_bytes() == before
    assert not (tmp_path / "b4").exists()
    later = replace(ONE_STEP, learning_rate=1e-2, epochs=2, max_steps=None)
    history = run(model, tmp_path, "lr", replace(tiny_recipe(), train=later)).history
    assert len(history) == 2 and history[0] == first.history[0]  # epoch 1 resumed, not redone


def test_other_self_samples_make_the_data_again_and_the_checkpoint_says_so(tmp_path):
    """`--self-samples 3` after a 6-sample run trained on 6 before: now the checkpoint refuses,
    naming the change, and without it the data and features are made again from 3."""
    model = tiny_model("llama")
    run(model, tmp_path, "six", tiny_recipe("eagle1"))
    cache = tmp_path / "cache"
    assert len(read_conversations(cache)) == 6
    with pytest.raises(ValueError, match=r"other settings \(self_samples 6 -> 3\)"):
        run(model, tmp_path, "three", replace(tiny_recipe("eagle1"), self_samples=3))
    assert len(read_conversations(cache)) == 6  # refused before the data stage ran
    shutil.rmtree(cache / "train-eagle1")
    result = run(model, tmp_path, "three", replace(tiny_recipe("eagle1"), self_samples=3))
    assert len(read_conversations(cache)) == 3
    assert open_features(cache / "features-final").conversations == 3
    assert result.tokens == sum(len(c.tokens) for c in read_conversations(cache))


def test_the_data_stage_is_keyed_by_its_target_and_settings(tmp_path):
    """Fewer samples, another target or another answer length: the data is made again (it
    once returned the 160 conversations of an earlier run asked for 40); the same call
    resumes, the conversations read back."""
    model = tiny_model("llama", seed=1)
    options = dict(self_samples=5, sample_prefix=2, max_tokens=6, progress=False)
    five = make_data(model, None, tmp_path, **options)
    assert make_data(model, None, tmp_path, **options) == five
    assert len(make_data(model, None, tmp_path, **options | {"self_samples": 2})) == 2
    longer = make_data(model, None, tmp_path, **options | {"max_tokens": 9})
    assert len(longer) == 5 and max(len(c.tokens) for c in longer) > 3 + 6
    other = make_data(tiny_model("llama", seed=2), None, tmp_path, **options | {"max_tokens": 9})
    assert [c.tokens for c in other] != [c.tokens for c in longer]


def test_default_recipe_is_the_one_that_paid_for_a_small_target():
    """DFlash trains by the results page's stories260K recipe (8 epochs, lr 3e-3, 1,024
    tokens a step, layers 1 and 3 of 5); the others keep TrainConfig's."""
    dflash = Recipe("dflash").train
    assert (dflash.epochs, dflash.learning_rate, dflash.batch_tokens) == (8, 3e-3, 1024)
    assert Recipe("eagle1").train == TrainConfig() == default_training("medusa")
    assert dflash_layers(5, 1) == (1, 3)  # stories260K
    assert dflash_layers(36, 5) == (1, 9, 18, 26, 34)
    assert dflash_layers(30, 1) == (1, 28)
    assert [dflash_layers(n) for n in (2, 3, 4)] == [(0,), (1,), (1, 2)]
    with pytest.raises(ValueError, match="a 1-layer target has none"):
        dflash_layers(1)


def test_the_payoff_estimate_and_its_warning():
    assert tokens_per_step(0.5, 3) == 1 + 0.5 + 0.25 + 0.125
    assert tokens_per_step(0.0, 7) == 1.0
    weak, strong = payoff(0.3, 7), payoff(0.858, 7)
    assert weak.pays is False and weak.tokens_per_step < BREAK_EVEN
    assert weak.describe().startswith("warning: held-out first-draft top-1 30.0%: chains of 7")
    assert "slower than plain decoding" in weak.describe()
    assert strong.pays is True and not strong.describe().startswith("warning")
    assert payoff(-1.0, 7).pays is None and "no estimate" in payoff(-1.0, 7).describe()


def test_the_cli_ends_with_the_payoff_of_a_tiny_run(tmp_path, capsys, monkeypatch):
    """A tiny medusa run whose held-out accuracy is pinned low: the last line warns."""
    model = STORIES
    monkeypatch.setattr(loop, "evaluate", lambda *args: 0.25)
    args = ["medusa", "--model", str(model), "--self-samples", "4", "--max-tokens", "16",
            "--epochs", "1", "--quiet", "--out", str(tmp_path / "heads")]  # fmt: skip
    assert train_cli.main(args) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("warning: held-out first-draft top-1 25.0%: chains of 4 yield at")
    assert f"{tokens_per_step(0.25, 4):.2f} tokens a step" in last


def parsed_recipe(monkeypatch, argv: list[str]) -> Recipe:
    """The recipe the CLI hands to train_head for `argv` (nothing runs)."""
    seen = {}

    def stop(kind, model, out, **kwargs):
        seen["recipe"] = kwargs["recipe"]
        raise ValueError("stop")

    monkeypatch.setattr(train_cli, "train_head", stop)
    assert train_cli.main([*argv, "--model", "m", "--out", "o"]) == 2
    return seen["recipe"]


def test_the_flags_are_the_recipe_s_fields(monkeypatch, capsys):
    """No flag given: the kind's default recipe; each given flag replaces its field only."""
    for kind in ("eagle1", "eagle3", "medusa", "dflash"):
        assert parsed_recipe(monkeypatch, [kind]) == Recipe(kind)
    given = ["dflash", "--taps", "1", "3", "--block-size", "4", "--lr", "0.01", "--max-steps",
             "7", "--intermediate-size", "96", "--self-samples", "5"]  # fmt: skip
    expected = replace(
        Recipe("dflash"), taps=(1, 3), block_size=4, intermediate_size=96, self_samples=5,
        train=replace(default_training("dflash"), learning_rate=0.01, max_steps=7),
    )  # fmt: skip
    assert parsed_recipe(monkeypatch, given) == expected
    help_text = " ".join(train_cli.parser().format_help().split())
    for name, value in TRAINING["dflash"].items():
        flag = "--lr" if name == "learning_rate" else "--" + name.replace("_", "-")
        default = getattr(TrainConfig(), name)
        assert f"(default: {default}; dflash: {value})" in help_text, flag
    with pytest.raises(SystemExit):
        train_cli.main(["medusa", "--model", "m", "--out", "o", "--intermediate-size", "8"])
    assert "--intermediate-size applies to eagle1, eagle3 and dflash, not medusa" in (
        capsys.readouterr().err
    )


def test_the_settings_and_their_flags_import_no_mlx():
    """The CLI's flags come from settings.py, which a `--help` or a flag error can read
    without loading MLX; its layouts are the EAGLE writer's."""
    from mlx_speculate.heads.eagle_format import LAYOUTS
    from mlx_speculate.train import settings

    assert settings.LAYOUTS == LAYOUTS
    code = "import sys, mlx_speculate.train.settings; print('mlx.core' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


def test_a_bad_jsonl_line_is_named_by_its_number(tmp_path):
    file = tmp_path / "p.jsonl"
    file.write_text('"one"\n\n{"messages": [{"role": "user", "content": "two"}]}\n{"bad": \n')
    with pytest.raises(ValueError) as bad:
        read_prompts(file)
    assert str(bad.value).startswith(f"{file}:4: line 4 is not valid JSON (")
    file.write_text('"one"\n{"neither": 1}\n')
    with pytest.raises(ValueError, match=f"^{file}:2: neither text nor a conversation"):
        read_prompts(file)


def test_a_block_larger_than_the_context_is_one_line(tmp_path, capsys):
    model = STORIES  # context 512
    args = ["dflash", "--model", str(model), "--self-samples", "2", "--block-size", "600",
            "--quiet", "--out", str(tmp_path / "d")]  # fmt: skip
    assert train_cli.main(args) == 2
    err = capsys.readouterr().err
    assert err == "error: DFlash block size 600 is larger than the model's context of 512 tokens\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["dflash", "eagle1"])
def test_a_hybrid_target_is_refused_with_its_reason(tmp_path, kind):
    model = tiny_model("qwen3_5_text")
    with pytest.raises(ValueError) as refused:
        run(model, tmp_path, "head", tiny_recipe(kind))
    message = str(refused.value)
    assert message.startswith(f"training a {kind} head for a qwen3_5_text target is not supp")
    assert "recurrent layers" in message and "\n" not in message
    assert not (tmp_path / "cache").exists()
