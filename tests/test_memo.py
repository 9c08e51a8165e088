"""Heads and draft models named by folder are loaded once per target: `stream_generate(...,
eagle="folder")` in a loop neither reads the files again nor traces the head's graphs again,
until a file in the folder changes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_speculate.drafters import DraftModelSpec, EagleSpec, MedusaSpec
from mlx_speculate.heads.eagle_format import build_eagle
from mlx_speculate.heads.store import save_heads

from .helpers import eagle_config, random_eagle_weights, random_weights, tiny_config, tiny_model
from .test_loading import write_folder
from .test_medusa import published_weights, write_published


def later(folder: Path) -> None:
    """Every file's mtime a second later, as an edit minutes later would leave it (two writes
    in one test may fall in one timestamp tick)."""
    for f in folder.iterdir():
        st = f.stat()
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def eagle(folder: Path, seed: int) -> EagleSpec:
    config = eagle_config(tiny_config(), 1)
    save_heads(build_eagle(config, random_eagle_weights(config, seed)), folder, config.to_json())
    return EagleSpec(heads=str(folder))


def medusa(folder: Path, seed: int) -> MedusaSpec:
    shutil.rmtree(folder, ignore_errors=True)
    write_published(folder, published_weights(seed=seed))
    return MedusaSpec(heads=str(folder))


def draft(folder: Path, seed: int) -> DraftModelSpec:
    config = tiny_config(num_hidden_layers=1)
    write_folder(folder, config, random_weights(config, seed=seed))
    return DraftModelSpec(model=str(folder))


LOADED = {"eagle": ("heads", eagle), "medusa": ("heads", medusa), "draft": ("model", draft)}


@pytest.mark.parametrize("method", LOADED)
def test_a_folder_is_loaded_once_per_target(tmp_path, method):
    field, write = LOADED[method]
    spec = write(tmp_path / "f", seed=0)
    target = tiny_model("llama")

    def loaded(spec, target=target):
        return getattr(spec.resolve(target), field)

    first = loaded(spec)
    assert loaded(spec) is first
    assert loaded(type(spec)(**{field: Path(getattr(spec, field))})) is first  # str or Path
    assert loaded(spec, tiny_model("llama")) is not first  # another target
    write(tmp_path / "f", seed=1)
    later(tmp_path / "f")
    again = loaded(spec)
    assert again is not first
    old, new = (np.array(sorted(tree_flatten(m.parameters()))[0][1]) for m in (first, again))
    assert not np.array_equal(old, new)  # the new files' weights
