"""Measured step costs and their file: what one verify over r rows and one proposal of k
tokens cost, per target, drafter, device, dtype, BLAS and MLX version.

The curves are kept on disk (`calibration_dir()`, one JSON file per target key, written
atomically), so the adaptive policy weighs draft lengths by what this machine measured rather
than probing them during generation; policy/measure.py measures them.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..atomic import install_file, staging_folder
from ..default_model import cache_dir

if TYPE_CHECKING:
    from ..drafters.base import Drafter
    from ..models.base import CausalLM

ROWS = (1, 2, 4, 8, 16, 32, 64)  # verify row counts measured (the verify buckets)
PROMPT = 64  # tokens before the timed forwards: a short context, as a chat turn starts
CATCH_UP = 32  # skipped tokens a drafter catches up on (DraftModelDrafter's window)
MAX_AGE = 30 * 24 * 3600.0  # seconds before a curve is measured again
FORMAT = 4  # 4: the longest draft always measured (3: least times; weights evaluated first)


@dataclass(frozen=True)
class StepCosts:
    """Seconds of the parts of a decoding step: `verify[r]` one target forward over r rows,
    `draft[k]` one proposal of k tokens (empty without a drafter) and `catch_up` a drafter's
    extra cost after sitting out `CATCH_UP` steps; `trees`: whether the drafter's proposals
    are trees (seen while timing them) rather than chains."""

    verify: dict[int, float]
    draft: dict[int, float]
    catch_up: float = 0.0
    trees: bool = False

    def __post_init__(self) -> None:
        # A forward over fewer rows costs no more than one over more: a point measured slow
        # (another process took the CPU) takes the cost of the next larger one.
        for name in ("verify", "draft"):
            curve = dict(sorted(getattr(self, name).items()))
            cap = float("inf")
            for x in reversed(curve):
                cap = curve[x] = min(curve[x], cap)
            object.__setattr__(self, name, curve)

    def verify_cost(self, rows: int) -> float:
        """Linear between measured row counts, and past the last in proportion to the rows."""
        return _interpolate(self.verify, rows)

    def draft_cost(self, k: int) -> float:
        return _interpolate(self.draft, k) if k > 0 and self.draft else 0.0

    def step(self, k: int) -> float:
        """A step drafting k tokens (tree: nodes below the root)."""
        return self.draft_cost(k) + self.verify_cost(k + 1)


def _interpolate(points: dict[int, float], x: int) -> float:
    """Linear between points; below the first, its value; past the last, in proportion to x
    (where a time budget cut the curve short, the machine is compute-bound)."""
    xs = sorted(points)
    if x in points:
        return points[x]
    if x < xs[0]:
        return points[xs[0]]
    if x > xs[-1]:
        return points[xs[-1]] * x / xs[-1]
    hi = next(v for v in xs if v > x)
    lo = xs[xs.index(hi) - 1]
    return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)


def calibration_dir() -> Path:
    """$MLX_SPECULATE_CALIBRATION, else `calibration/` in the package's cache."""
    path = os.environ.get("MLX_SPECULATE_CALIBRATION")
    return Path(path).expanduser() if path else cache_dir() / "calibration"


def fingerprint(module: nn.Module) -> dict[str, Any]:
    """What a module's speed depends on: its class, configuration and parameter bytes by
    dtype (quantization and dtype change them, the weights' values do not)."""
    sizes: dict[str, int] = {}
    params = module.parameters() if isinstance(module, nn.Module) else {}  # a stand-in: none
    for _, p in tree_flatten(params):
        sizes[str(p.dtype)] = sizes.get(str(p.dtype), 0) + p.nbytes
    args = getattr(module, "args", None) or getattr(module, "config", None)
    return {"class": type(module).__name__, "args": repr(args), "bytes": sizes}


def target_key(model: CausalLM) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "model": fingerprint(model),
        "device": str(mx.default_device()),
        "blas": blas_name(),
        "mlx": mx.__version__,
        "rows": list(ROWS),
        "prompt": PROMPT,
    }


def drafter_key(drafter: Drafter) -> str:
    parts = [type(drafter).__name__, str(drafter.max_draft)]
    parts += [json.dumps(fingerprint(m), sort_keys=True) for m in drafter.weights()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def blas_name() -> str:
    """Which BLAS serves float32 matmuls on a Linux CPU (OpenBLAS is several times faster)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "default"
    return "openblas" if "libopenblas" in maps else "default"


def cache_file(model: CausalLM) -> Path:
    key = json.dumps(target_key(model), sort_keys=True)
    return calibration_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def costs_of(record: dict, name: str | None) -> StepCosts:
    verify = {int(r): t for r, t in record["verify"].items()}
    if name is None:
        return StepCosts(verify, {})
    entry = record["drafters"][name]
    draft = {int(k): t for k, t in entry["draft"].items()}
    return StepCosts(verify, draft, entry["catch_up"], entry["trees"])


def cached_costs(model: CausalLM) -> StepCosts | None:
    """The target's verify costs as calibrated on this machine, if a calibration of this
    model is cached (no drafter's, nothing measured now)."""
    record = read_record(cache_file(model))
    if record.get("key") != target_key(model) or "verify" not in record:
        return None
    return costs_of(record, None)


def read_record(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # absent or torn by hand: measured again
    return record if isinstance(record, dict) else {}


def write_record(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = staging_folder(path) / path.name
    staged.write_text(json.dumps(record, indent=1, sort_keys=True))
    install_file(staged, path)


