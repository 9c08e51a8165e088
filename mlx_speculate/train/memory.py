"""How much memory each training stage took: the process's resident peak (what the machine
feels: weights, MLX's buffers and its cache of freed ones, the memory-mapped features) and
MLX's own peak allocation, measured per stage so that a user sees which stage to shrink.

On Linux the resident peak is reset at each stage (`/proc/self/clear_refs`); elsewhere it is
the process's peak so far (`ru_maxrss`), which the report says.
"""

from __future__ import annotations

import re
import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass(frozen=True)
class Peak:
    resident: int  # bytes: the stage's resident peak (or the process's so far, `per_stage`)
    mlx: int  # bytes MLX held allocated at most during the stage
    per_stage: bool  # False where the resident peak could not be reset at the stage's start

    def describe(self) -> str:
        since = "" if self.per_stage else " (process peak so far)"
        return f"peak {self.resident / 1e9:.2f} GB resident{since}, {self.mlx / 1e9:.2f} GB MLX"


@contextmanager
def measured(peaks: dict[str, Peak], stage: str) -> Iterator[None]:
    """Records the block's peaks in `peaks[stage]`; MLX's buffer cache is emptied first, so
    that a stage does not carry the last one's freed buffers."""
    mx.clear_cache()
    per_stage = _reset_resident_peak()
    mx.reset_peak_memory()
    try:
        yield
    finally:
        peaks[stage] = Peak(_resident_peak(), mx.get_peak_memory(), per_stage)


def _reset_resident_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")  # 5: reset the peak resident set size (Linux >= 4.0)
    except OSError:
        return False
    return True


def _resident_peak() -> int:
    try:
        found = re.search(r"VmHWM:\s+(\d+) kB", _STATUS.read_text())
    except OSError:
        found = None
    if found is not None:
        return int(found.group(1)) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux kB
