"""What a cached stage was built from: a key written beside it, compared on every run.

Each stage (data, features, checkpoint) records in a key file everything that changes what it
holds: the target (its config and a sample of every weight), the prompts as token ids, and
the settings that stage reads. A run whose key differs rebuilds the stage (data, features) or
refuses in one line naming the difference (a checkpoint: hours of training are not deleted
silently), so a run with other settings never trains on a stale stage.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..models.base import CausalLM

_SAMPLE = 64  # values read from each weight: enough to tell two checkpoints of one config apart


def digest(value: Any) -> str:
    """A short hash of a JSON-able value (dict keys sorted)."""
    text = json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_identity(model: CausalLM) -> str:
    """The target's config and the first values of each of its weights, hashed: another
    model, another checkpoint of it or a requantized copy differs, a moved folder does not."""
    h = hashlib.sha256(digest(vars(model.args)).encode())
    for name, array in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        sample = array.reshape(-1)[:_SAMPLE]
        if sample.dtype == mx.bfloat16:  # numpy has no bfloat16
            sample = sample.view(mx.uint16)
        h.update(name.encode())
        h.update(np.array(sample).tobytes())
    return h.hexdigest()[:16]


def read_key(file: Path) -> dict[str, Any] | None:
    """The key recorded in `file` (None: none, or unreadable)."""
    try:
        value = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def write_json(path: Path, value: dict) -> None:
    """Writes `path` whole or not at all (a rename over the old one)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True))
    os.replace(tmp, path)


def differences(old: dict[str, Any], new: dict[str, Any]) -> str:
    """What changed, `name was -> now` for each setting (hashes named, not shown)."""
    out = []
    for name in sorted(old.keys() | new.keys()):
        a, b = old.get(name), new.get(name)
        if a == b:
            continue
        if name in ("model", "inputs", "data", "features"):
            out.append(f"another {_WHAT[name]}")
        else:
            out.append(f"{name} {_show(a)} -> {_show(b)}")
    return ", ".join(out)


_WHAT = {"model": "target", "inputs": "set of prompts", "data": "data", "features": "features"}


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)
