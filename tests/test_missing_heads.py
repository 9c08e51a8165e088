"""Asking for heads a model does not have says how to get them: name their folder, convert
published ones, or train them with `python -m mlx_speculate.train`, in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_speculate import load, make_drafter
from mlx_speculate.drafters import DFlashSpec, EagleSpec, MedusaSpec

from .helpers import random_weights, tiny_config
from .test_loading import write_folder

TRAIN = "python -m mlx_speculate.train"


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> Path:
    """A model folder with no heads of any kind beside it."""
    config = tiny_config(num_hidden_layers=6)
    return write_folder(tmp_path_factory.mktemp("heads") / "bare", config, random_weights(config))


@pytest.mark.parametrize(
    "spec, words",
    [
        (EagleSpec(), f"no EAGLE heads beside the model: .*{TRAIN} eagle3"),
        (DFlashSpec(), f"no DFlash drafter beside the model: .*{TRAIN} dflash"),
        (MedusaSpec(), f"no Medusa heads weights in .*{TRAIN} --help"),
    ],
)
def test_missing_heads_point_to_training(bare, spec, words):
    model, tokenizer = load(bare)
    with pytest.raises((ValueError, OSError), match=words) as error:
        make_drafter(spec, model, tokenizer)
    assert "\n" not in str(error.value)


def test_heads_named_but_absent_point_to_training(tmp_path):
    empty = tmp_path / "heads"
    empty.mkdir()
    config = tiny_config(num_hidden_layers=6)
    model, tokenizer = load(write_folder(tmp_path / "m", config, random_weights(config)))
    with pytest.raises(OSError, match=f"no EAGLE heads weights in {empty} .*{TRAIN} --help"):
        make_drafter(EagleSpec(heads=empty), model, tokenizer)
