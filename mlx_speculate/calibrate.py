"""Measured step costs, per model, device, dtype, BLAS and MLX version: what the adaptive policy
weighs draft lengths with, instead of probing them during generation.

    python -m mlx_speculate.calibrate --model M [--draft-model D | --prompt-lookup | --medusa |
        --eagle ...] [--force]

It times one target forward over r rows (`ROWS`, the verify buckets: 1 to 64) after a short
prompt, and for a drafter one proposal per draft length the policy weighs (`policy.sizes`)
and, for drafters that keep a cache, catching up on `CATCH_UP` skipped tokens. Points are
measured smallest first within `BUDGET` seconds each for the verify and the draft curve (the
verify rows of the longest draft, up to `NEEDED_ROWS`, and the longest draft itself, whatever
the time; draft costs between are interpolated); where the budget runs out (a slow CPU: a
64-row forward of a 4-bit model takes seconds) the verify curve goes on in proportion to the
rows, as it does on such a machine. The curve is cached on disk (`calibration_dir()`, one
JSON file per target key, written atomically) and measured again when older than `MAX_AGE` or
when the key changes (another model, dtype, quantization, device, BLAS or MLX version): a few
seconds on first use, with a progress bar.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .atomic import install_file, staging_folder
from .decode import Decoder
from .default_model import cache_dir
from .drafters.base import Drafter
from .models.base import CausalLM
from .sampling import SamplingParams
from .step import verify as verify_step
from .tree import Tree

ROWS = (1, 2, 4, 8, 16, 32, 64)
PROMPT = 64  # tokens before the timed forwards: a short context, as a chat turn starts
RUNS = 3  # timed runs per point (after one warm-up); the least is kept
BUDGET = 3.0  # seconds for the verify curve, and again for the draft curve
NEEDED_ROWS = 16  # verify rows measured past the budget where the longest draft needs them
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
        "blas": _blas(),
        "mlx": mx.__version__,
        "rows": list(ROWS),
        "prompt": PROMPT,
    }


def drafter_weights(drafter: Drafter) -> list:
    """The modules a drafter drafts with (none for prompt lookup)."""
    modules = [getattr(drafter, a, None) for a in ("model", "head", "heads")]
    return [m for m in modules if m is not None]


def drafter_key(drafter: Drafter) -> str:
    parts = [type(drafter).__name__, str(drafter.max_draft)]
    parts += [json.dumps(fingerprint(m), sort_keys=True) for m in drafter_weights(drafter)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _blas() -> str:
    """Which BLAS serves float32 matmuls on a Linux CPU (OpenBLAS is several times faster)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "default"
    return "openblas" if "libopenblas" in maps else "default"


def cache_file(model: CausalLM) -> Path:
    key = json.dumps(target_key(model), sort_keys=True)
    return calibration_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def load_costs(
    model: CausalLM,
    drafter: Drafter | None = None,
    sizes: Sequence[int] = (),
    *,
    force: bool = False,
    now: Callable[[], float] = time.time,
    progress: bool | None = None,
    decide: Callable[[bool], bool] = bool,
) -> StepCosts:
    """The cached costs of `model` (and `drafter` at draft lengths `sizes`), measured now when
    missing, stale or `force`d. `drafter` must be fresh: it is rewound to nothing after.
    `decide` makes each timing-dependent choice (cached or not, one more run): a sharded target's
    ranks take rank 0's, so that they run the same forwards."""
    path = cache_file(model)
    record = _read(path)
    if record.get("key") != target_key(model):
        record = {"key": target_key(model)}
    fresh = not force and now() - record.get("created", -MAX_AGE) < MAX_AGE
    name = None if drafter is None else drafter_key(drafter)
    entry = record.get("drafters", {}).get(name) if name else None
    wanted = sorted({k for k in sizes if 0 < k <= drafter.max_draft}) if drafter else []
    have = entry is not None and set(entry["sizes"]) >= set(wanted)
    if decide(fresh and "verify" in record and (drafter is None or have)):
        return _costs(record, name)
    measured = measure(model, drafter, wanted, progress=progress, decide=decide)
    verify, draft, catch_up, trees = measured
    if not fresh or "verify" not in record:
        record = {"key": target_key(model), "created": now(), "drafters": {}}
    # The verify curve measured beside this draft curve: the policy weighs one against the
    # other, so both come from the same conditions (a busy machine slows both).
    record["verify"] = verify
    if name is not None:
        entry = {"sizes": wanted, "draft": draft, "catch_up": catch_up, "trees": trees}
        record.setdefault("drafters", {})[name] = entry
    _write(path, record)
    return _costs(json.loads(json.dumps(record)), name)


def _costs(record: dict, name: str | None) -> StepCosts:
    verify = {int(r): t for r, t in record["verify"].items()}
    if name is None:
        return StepCosts(verify, {})
    entry = record["drafters"][name]
    draft = {int(k): t for k, t in entry["draft"].items()}
    return StepCosts(verify, draft, entry["catch_up"], entry["trees"])


def _read(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # absent or torn by hand: measured again
    return record if isinstance(record, dict) else {}


def _write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = staging_folder(path) / path.name
    staged.write_text(json.dumps(record, indent=1, sort_keys=True))
    install_file(staged, path)


def measure(
    model: CausalLM,
    drafter: Drafter | None = None,
    sizes: Sequence[int] = (),
    *,
    progress: bool | None = None,
    decide: Callable[[bool], bool] = bool,
) -> tuple[dict[int, float], dict[int, float], float, bool]:
    """(verify seconds per row count, draft seconds per draft length, catch-up seconds, and
    whether the drafts were trees). `decide`: as `load_costs`'s."""
    from tqdm import tqdm

    context = model.args.max_position_embeddings
    # Few distinct tokens, in an irregular order: n-grams recur with several continuations, so
    # a lookup drafter has matches (its trees show) as it would on text.
    alphabet = min(11, model.args.vocab_size - 1)
    prompt = [1 + (i * i + i // 3) % alphabet for i in range(min(PROMPT, context // 2))]
    rows = [r for r in ROWS if r <= context - len(prompt)] or [1]
    bar = tqdm(
        total=len(rows) + len(sizes) + (drafter is not None),
        desc="calibrating step costs",
        unit="point",
        file=sys.stderr,
        disable=None if progress is None else not progress,
        leave=False,
    )
    decoder = Decoder(model, drafter)
    decoder.prefill(prompt)
    offset = decoder.cache.offset
    pending = mx.ones((1,), dtype=mx.int32)
    verify: dict[int, float] = {}
    # The rows a step of the longest draft verifies are measured whatever the budget (up to
    # 16): a curve cut short and carried on in proportion would price long drafts far above
    # their cost where rows are cheap (float32 with BLAS), and the policy would draft short.
    needed = min(max(sizes, default=0) + 1, NEEDED_ROWS)
    start = time.perf_counter()
    for r in rows:
        # decide() last: every rank reaches it on the same rows (the row counts are the same).
        enough = len(verify) >= 2 and max(verify) >= needed
        if enough and decide(time.perf_counter() - start > BUDGET):
            break
        # The loop's own compiled verify step over r rows (a row bucket): the cost depends on
        # the row count, not the tree's shape.
        tree, drafted = Tree.chain(r - 1), mx.ones((r - 1,), dtype=mx.int32)

        def forward(tree=tree, drafted=drafted):
            out = verify_step(model, decoder.cache, pending, tree, drafted, None, SamplingParams())
            mx.eval(out.acceptance.tokens, out.logits)
            decoder.cache.truncate(offset)

        verify[r] = _time(forward, decide)
        bar.update()
    draft: dict[int, float] = {}
    catch_up, trees = 0.0, False
    if drafter is not None:
        # The prompt and the pending token (the verify's): a head drafter proposes from the
        # features of every committed position, so it drafts nothing on the prompt alone.
        context, greedy = [*decoder.context, 1], SamplingParams()
        start = time.perf_counter()
        # The longest draft is measured whatever the budget: the curve between it and the
        # last point within budget is then interpolated, never carried on in proportion,
        # which would price an EAGLE tree (whose draft cost stops growing once its levels
        # are all expanded) at ten times its cost, and the policy would never grow one.
        for i, k in enumerate(sizes):
            last = i == len(sizes) - 1
            if len(draft) >= 2 and not last and decide(time.perf_counter() - start > BUDGET):
                continue
            draft[k] = _time(lambda k=k: _propose(drafter, context, k, greedy), decide)
            trees = trees or _propose(drafter, context, k, greedy) == "tree"
            bar.update()
        catch_up = _catch_up(drafter, context, greedy, draft.get(1, 0.0))
        bar.update()
        drafter.rewind(0)
    bar.close()
    return verify, draft, catch_up, trees


def _propose(drafter: Drafter, context: list[int], k: int, sampling: SamplingParams) -> str:
    """What one proposal of k tokens was: "none", "chain" or "tree"."""
    draft = drafter.propose(context, k, sampling)
    if draft is None:
        return "none"
    mx.eval(draft.tokens)
    return "chain" if draft.tree.is_chain else "tree"


def _catch_up(drafter: Drafter, context: list[int], sampling, steady: float) -> float:
    """Extra seconds of a one-token proposal after `CATCH_UP` skipped tokens, for drafters that
    re-read them (a draft model's forward over them); 0 for those that keep no such state."""
    length = len(context) - 1 - CATCH_UP
    if length < 1:
        return 0.0
    times = []
    for _ in range(RUNS):
        drafter.rewind(length)
        start = time.perf_counter()
        if _propose(drafter, context, 1, sampling) == "none":
            return 0.0  # its state went with the rewind: nothing to catch up on
        times.append(time.perf_counter() - start)
    return max(min(times) - steady, 0.0)


def _time(run: Callable[[], object], decide: Callable[[bool], bool] = bool) -> float:
    """Least seconds of `run` after a warm-up (allocation, kernel set-up); a single timed run
    where one takes a tenth of the budget. The least, not the median: other processes on a
    shared machine only ever add time, and a point slowed by them would skew the draft curve
    against the verify curve for as long as the cache lives."""
    run()
    times: list[float] = []
    while len(times) < RUNS and decide(sum(times) < BUDGET / 10):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: Sequence[str] | None = None) -> int:
    from . import cli
    from .drafters import cli as drafter_cli
    from .drafters import make_drafter
    from .generate import _load
    from .loading import DTYPES
    from .policy import candidate_lengths

    parser = cli.ArgumentParser(
        prog=cli.prog("mlx_speculate.calibrate"),
        description="Measure (or show the cached) verify and draft costs of a model on this "
        "machine: what the adaptive policy chooses draft lengths with.",
    )
    parser.add_argument("--model", default=None, help="model folder or hub id (default model)")
    parser.add_argument("--dtype", choices=list(DTYPES), help="compute dtype, as generate's")
    parser.add_argument("--force", action="store_true", help="measure again even if cached")
    drafter_cli.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        spec = drafter_cli.spec_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    try:
        model, tokenizer = _load(args.model, args.dtype)
        drafter = None if spec is None else make_drafter(spec, model, tokenizer)
        sizes = candidate_lengths(drafter.max_draft) if drafter else ()
        costs = load_costs(model, drafter, sizes, force=args.force, progress=True)
    except (ValueError, OSError, ImportError) as e:
        return cli.fail(e)
    print(f"# {cache_file(model)}")
    print(f"device {mx.default_device()}, BLAS {_blas()}, mlx {mx.__version__}")
    print(f"{'rows':>5} {'verify ms':>10} {'x one row':>10}")
    for r, t in sorted(costs.verify.items()):
        print(f"{r:>5} {1e3 * t:>10.2f} {t / costs.verify[1]:>10.2f}")
    if costs.draft:
        print(f"\n{'k':>5} {'draft ms':>10} {'step ms':>10}")
        for k, t in sorted(costs.draft.items()):
            print(f"{k:>5} {1e3 * t:>10.2f} {1e3 * costs.step(k):>10.2f}")
        print(f"catch-up after {CATCH_UP} skipped tokens: {1e3 * costs.catch_up:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
