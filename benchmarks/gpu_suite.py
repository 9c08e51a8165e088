"""The accelerator suite (issue 39): plain decoding against mlx-lm's, the cost of a verify step
in plain steps, EAGLE and the adaptive policy against plain decoding, on three targets, in one
command that prints a table and writes one JSON file.

On an H100/H200 (the kit in ../shared/gpu packs MLX's CUDA backend, mlx-lm and ../shared/models
into .gpu/; run from the checkout, about 20 s of set-up and at most 8 minutes of suite):

    . .gpu/setup.sh && python benchmarks/gpu_suite.py 2>&1 | tee gpu.log

writes benchmarks/results/gpu-<date>-<device>.json (commit it). On this CPU,
`python benchmarks/gpu_suite.py --quick` runs the same code with smaller stand-ins and fewer
rounds (at most 10 minutes) and writes quick-<date>-cpu.json; `--dry-run` (stories260K, a few
tokens, one round) checks the plumbing in well under a minute. `--out FILE` writes elsewhere.

Targets: `stories260K` (the real checkpoint in tests/data/models: overhead-bound), `smollm2`
(SmolLM2-135M's shapes, random weights, bfloat16) and `llama8b` (Llama-3.1-8B's shapes in 4-bit,
random: memory-bound, with a random draft in Qwen2.5-0.5B's shapes). Under --quick the random
targets shrink (fewer layers; a small 4-bit stand-in for the 8B) and, like every run on a CPU,
compute in float32: MLX's CPU backend runs bfloat16 arithmetic many times slower. Random
weights measure cost only: their drafts are rejected, so tau there says nothing about a trained
drafter's (take tau from real heads).

Per target, variants run interleaved: a warm-up round first (on CUDA it compiles a kernel per
new fused graph and shape; its seconds are recorded), then `rounds` timed rounds; medians of
tokens/s from the first token to the last (the prompt's forward excluded). Every run's token
count is checked against plain decoding's, and so is every token (greedy: speculation is
lossless, so any difference is a bug or, on a GPU, kernel rounding; the suite sets
MLX_ENABLE_TF32=0 for CUDA's sake). mlx-lm's rows are compared too, but their kernels are not
ours (its 4-bit prompt forward, say), so a difference there is rounding, not a loss.

Step costs come from fixed-shape EAGLE-3 drafting with a random head of the target's EAGLE-3
shape: a chain of k (`chain1`..`chain4`) and the official 60-node tree (`tree60`), each step's
time over a plain step's. `verify_rows_cost` is one target forward over r rows against one row
(where a GPU's quantized matmul switches kernels shows there).

`eagle_vs_plain` needs a trained stories260K EAGLE head: the suite reads `--eagle-head DIR`,
by default ../shared/models/stories260K-eagle3, which the kit packs into .gpu/ (it copies
../shared/models whole) and setup.sh links back to ../shared on the device. Train one with
`python benchmarks/bench_train.py eagle3 --model tests/data/models/stories260K-llama
--self-samples 400 --max-tokens 256 --runs 0` and copy its output folder there before packing.
Without one the figure is null, with the reason in `notes`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import date
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("MLX_ENABLE_TF32", "0")  # exact float32 matmuls on CUDA: greedy equality


def _load_openblas() -> str:
    """Debian's OpenBLAS for the CPU's float32 matmuls, loaded before MLX when it is there."""
    from common import OPENBLAS

    if "openblas" in os.environ.get("LD_PRELOAD", ""):
        return f"OpenBLAS via LD_PRELOAD ({os.environ['LD_PRELOAD']})"
    if platform.system() != "Linux" or "mlx.core" in sys.modules or not Path(OPENBLAS).exists():
        return "the mlx wheel's"
    ctypes.CDLL(OPENBLAS, mode=ctypes.RTLD_GLOBAL)
    return f"OpenBLAS ({OPENBLAS})"


BLAS = _load_openblas()

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from bench_verify_cost import curve  # noqa: E402
from common import median  # noqa: E402
from suite_targets import (  # noqa: E402
    EAGLE_HEAD,
    PROMPT,
    SETTINGS,
    STEP_SHAPES,
    STORIES,
    STORIES_DRAFT,
    TARGETS,
    TRAINED_SHAPES,
    VERIFY_ROWS,
    VERIFY_RUNS,
    K,
    Target,
    random_eagle_head,
    write_random_folder,
)

from mlx_speculate import load, stream_generate  # noqa: E402

# ---- timing ---------------------------------------------------------------------------------


@dataclass
class Run:
    tokens: list[int]
    seconds: float  # from the first token to the last: decoding, the prompt's forward excluded
    total: float  # from the call to the last token: prompt and set-up included
    steps: int  # target forwards after the first token


@dataclass
class Variant:
    label: str
    generate: Callable[[], Iterator]  # responses with .token (ours or mlx-lm's)
    ours: bool = True
    runs: list[Run] = field(default_factory=list)
    warmup_seconds: float = 0.0


def timed(generate, ours: bool) -> Run:
    mx.clear_cache()  # each run starts from an empty allocator cache
    tokens, first, last = [], 0.0, None
    start = time.perf_counter()
    for last in generate():
        if not tokens:
            first = time.perf_counter()
        tokens.append(last.token)
    end = time.perf_counter()
    steps = last.stats.target_forwards if ours and last is not None else len(tokens) - 1
    return Run(tokens, end - first, end - start, steps)


def summarise(variant: Variant, reference: list[int]) -> dict:
    """Medians over the timed runs; counts and tokens checked against `reference` (ours,
    plain, warm-up round)."""
    runs = variant.runs[1:]
    counts = sorted({len(r.tokens) for r in variant.runs})
    row = {
        "tokens_per_s": median([(len(r.tokens) - 1) / r.seconds for r in runs]),
        "runs_tokens_per_s": [round((len(r.tokens) - 1) / r.seconds, 2) for r in runs],
        "e2e_tokens_per_s": median([len(r.tokens) / r.total for r in runs]),
        "step_ms": 1e3 * median([r.seconds / max(r.steps, 1) for r in runs]),
        "tau": median([(len(r.tokens) - 1) / max(r.steps, 1) for r in runs]),
        "tokens": counts[0] if len(counts) == 1 else counts,
        "count_ok": counts == [len(reference)],
        "equal_to_plain": all(r.tokens == reference for r in variant.runs),
        "warmup_seconds": round(variant.warmup_seconds, 2),
    }
    if not variant.ours:
        del row["tau"], row["step_ms"]
    return row


def measure(variants: list[Variant], rounds: int, deadline: float) -> int:
    """A warm-up round, then up to `rounds` interleaved timed rounds while time is left;
    returns the timed rounds run."""
    for round_ in range(rounds + 1):
        if round_ > 1 and time.monotonic() > deadline:
            return round_ - 1
        for v in variants:
            start = time.perf_counter()
            v.runs.append(timed(v.generate, v.ours))
            if round_ == 0:
                v.warmup_seconds = time.perf_counter() - start
            r = v.runs[-1]
            print(
                f"  round {round_} {v.label:<22} {(len(r.tokens) - 1) / r.seconds:9.1f} "
                f"tok/s ({len(r.tokens)} tokens, {r.total:.1f} s)",
                flush=True,
            )
    return rounds


# ---- one target -----------------------------------------------------------------------------


def target_variants(
    target: Target,
    folders: dict,
    model,
    tokenizer,
    prompt: list[int],
    n: int,
    eagle_head_dir: Path | None,
) -> tuple[list[Variant], str]:
    """The variants of one target, and what drafts for its adaptive policy."""
    theirs = mlx_lm.load(str(folders["target"]))
    config = target.config or json.loads((STORIES / "config.json").read_text())

    def ours(**kwargs):
        return lambda: stream_generate(model, tokenizer, prompt, max_tokens=n, **kwargs)

    def mlx_lms(**kwargs):
        return lambda: mlx_lm.stream_generate(*theirs, prompt, max_tokens=n, **kwargs)

    variants = [Variant("plain", ours()), Variant("mlx_lm plain", mlx_lms(), ours=False)]
    head = random_eagle_head(model, config, target.draft_vocab)
    if "draft" in folders:
        draft, draft_tokenizer = load(folders["draft"])
        their_draft, _ = mlx_lm.load(str(folders["draft"]))
        with_draft = dict(draft_model=draft, draft_tokenizer=draft_tokenizer)
        variants += [
            Variant(f"draft k{K}", ours(**with_draft, num_draft_tokens=K)),
            Variant(
                f"mlx_lm draft k{K}",
                mlx_lms(draft_model=their_draft, num_draft_tokens=K),
                ours=False,
            ),
            Variant("adaptive", ours(**with_draft)),
        ]
        adaptive = f"draft model ({folders['draft'].name})"
    else:
        variants.append(Variant("adaptive", ours(eagle=head)))
        adaptive = "random EAGLE-3 head"
    for label, tree in STEP_SHAPES.items():
        variants.append(
            Variant(label, ours(eagle=head, eagle_tree=tree, num_draft_tokens=tree.total - 1))
        )
    if eagle_head_dir is not None:
        trained = str(eagle_head_dir)
        for label, tree in TRAINED_SHAPES.items():
            kwargs = dict(eagle=trained, eagle_tree=tree, num_draft_tokens=tree.total - 1)
            variants.append(Variant(f"eagle {label}", ours(**kwargs)))
        variants.append(Variant("eagle adaptive", ours(eagle=trained)))
    return variants, adaptive


def run_target(
    target: Target,
    mode: str,
    work: Path,
    n: int,
    rounds: int,
    deadline: float,
    eagle_head_dir: Path | None,
) -> dict:
    """One target's checkpoints built (random ones in `work`), its variants measured, and its
    verify forward's cost over 1-64 rows."""
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
    start = time.perf_counter()
    if target.config is None:
        folders = {"target": STORIES, "draft": STORIES_DRAFT}
        weights = "real, float32"
    else:
        folders = {"target": work / target.name}
        write_random_folder(folders["target"], target.config, dtype, target.bits, seed=0)
        if target.draft is not None:
            folders["draft"] = work / f"{target.name}-draft"
            write_random_folder(folders["draft"], target.draft, dtype, target.bits, seed=1)
        weights = str(dtype).split(".")[-1]
        weights = (
            f"random, {target.bits}-bit ({weights} scales)" if target.bits else f"random, {weights}"
        )
    built = time.perf_counter() - start
    model, tokenizer = load(folders["target"])
    prompt = tokenizer.encode(PROMPT)
    head = eagle_head_dir if target.name == "stories260K" else None
    variants, adaptive = target_variants(target, folders, model, tokenizer, prompt, n, head)
    timed_rounds = measure(variants, rounds, deadline)
    reference = variants[0].runs[0].tokens
    verify = curve(model, VERIFY_ROWS, len(prompt), VERIFY_RUNS[mode])
    return {
        "note": target.note,
        "weights": weights,
        "prompt_tokens": len(prompt),
        "max_tokens": n,
        "timed_rounds": timed_rounds,
        "build_seconds": round(built, 1),
        "adaptive_drafter": adaptive,
        "eagle_head": None if head is None else str(head),
        "variants": {v.label: summarise(v, reference) for v in variants},
        "verify_rows_cost": {r: round(t / verify[1], 3) for r, t in verify.items()},
    }


# ---- the report -----------------------------------------------------------------------------


def ratio(rows: dict, a: str, b: str) -> float | None:
    """tokens/s of a over b, or None when either is missing or miscounted."""
    if a not in rows or b not in rows or not (rows[a]["count_ok"] and rows[b]["count_ok"]):
        return None
    return round(rows[a]["tokens_per_s"] / rows[b]["tokens_per_s"], 3)


def summary(results: dict, notes: dict) -> dict:
    out = {
        "plain_vs_mlx_lm": {},
        "draft_vs_mlx_lm": {},
        "step_cost_in_plain_steps": {},
        "eagle_vs_plain": {"stories260K": None},
        "adaptive_vs_plain": {},
    }
    for name, result in results.items():
        rows = result["variants"]
        out["plain_vs_mlx_lm"][name] = ratio(rows, "plain", "mlx_lm plain")
        if f"draft k{K}" in rows:
            out["draft_vs_mlx_lm"][name] = ratio(rows, f"draft k{K}", f"mlx_lm draft k{K}")
        plain = rows["plain"]["step_ms"]
        out["step_cost_in_plain_steps"][name] = {
            label: round(rows[label]["step_ms"] / plain, 3) for label in STEP_SHAPES
        }
        out["adaptive_vs_plain"][name] = ratio(rows, "adaptive", "plain")
    stories = results.get("stories260K", {}).get("variants", {})
    trained = {label: ratio(stories, f"eagle {label}", "plain") for label in TRAINED_SHAPES}
    trained = {k: v for k, v in trained.items() if v is not None}
    if trained:
        best = max(trained, key=trained.get)
        out["eagle_vs_plain"]["stories260K"] = trained[best]
        notes["eagle_vs_plain"] = f"best fixed shape of {sorted(trained)}: {best}"
    return out


def device_name() -> tuple[str, str]:
    """The device in words, and its slug for the file name."""
    if mx.default_device() == mx.cpu:
        return f"cpu ({platform.machine()}, {os.cpu_count()} cores)", "cpu"
    name = mx.device_info().get("device_name", "gpu")
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower().removeprefix("nvidia")).strip("-")
    return name, slug or "gpu"


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=HERE,
            check=True,
            capture_output=True,
            text=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):  # a copy without .git (the device's)
        return os.environ.get("MLX_SPECULATE_COMMIT", "unknown")


def print_table(results: dict, report: dict) -> None:
    for name, result in results.items():
        print(
            f"\n## {name} ({result['weights']}; {result['note']}), {result['max_tokens']} "
            f"tokens, {result['timed_rounds']} timed rounds"
        )
        print(
            f"{'variant':<22} {'tok/s':>9} {'vs plain':>9} {'step ms':>8} {'tau':>6} "
            f"{'warm-up s':>9}  equal"
        )
        plain = result["variants"]["plain"]["tokens_per_s"]
        for label, row in result["variants"].items():
            step = f"{row['step_ms']:8.2f}" if "step_ms" in row else f"{'-':>8}"
            tau = f"{row['tau']:6.2f}" if "tau" in row else f"{'-':>6}"
            ok = row["equal_to_plain"] if row["count_ok"] else f"COUNT {row['tokens']}"
            print(
                f"{label:<22} {row['tokens_per_s']:9.1f} {row['tokens_per_s'] / plain:8.2f}x "
                f"{step} {tau} {row['warmup_seconds']:9.1f}  {ok}"
            )
        print(
            "verify forward over r rows / one row: "
            + ", ".join(f"{r}: {c:.2f}" for r, c in result["verify_rows_cost"].items())
        )
    print()
    for key in (
        "plain_vs_mlx_lm",
        "draft_vs_mlx_lm",
        "step_cost_in_plain_steps",
        "eagle_vs_plain",
        "adaptive_vs_plain",
    ):
        print(f"{key}: {json.dumps(report[key])}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--quick", action="store_true", help="smaller stand-ins, for a CPU")
    modes.add_argument("--dry-run", action="store_true", help="stories260K, a few tokens")
    parser.add_argument("--targets", help="comma-separated subset of stories260K,smollm2,llama8b")
    parser.add_argument(
        "--eagle-head",
        type=Path,
        metavar="DIR",
        help=f"a trained stories260K EAGLE head (default: {EAGLE_HEAD})",
    )
    parser.add_argument("--out", type=Path, help="the JSON file (default benchmarks/results/)")
    args = parser.parse_args(argv)
    mode = "dry-run" if args.dry_run else "quick" if args.quick else "full"
    tokens, rounds, budget = SETTINGS[mode]
    targets = TARGETS["full" if mode == "full" else "quick"]
    names = args.targets.split(",") if args.targets else list(tokens)
    unknown = set(names) - {t.name for t in targets}
    if unknown or (mode == "dry-run" and names != ["stories260K"]):
        parser.error(f"unknown or unavailable targets {sorted(unknown) or names} in {mode} mode")
    notes = {}
    head = args.eagle_head or EAGLE_HEAD
    if not (head / "config.json").is_file():
        if args.eagle_head is not None:
            parser.error(f"--eagle-head {head} holds no EAGLE head (no config.json)")
        notes["eagle_vs_plain"] = f"no trained stories260K EAGLE head at {head} (see the docstring)"
        head = None
    if not STORIES.is_dir():  # after the arguments: a bad one is a usage error (exit 2) anyway
        raise SystemExit(f"{STORIES} not found: the suite runs from a checkout (tests/data)")
    device, slug = device_name()
    prefix = {"full": "gpu" if slug != "cpu" else "full", "quick": "quick", "dry-run": "dry-run"}
    out = args.out or HERE / "results" / f"{prefix[mode]}-{date.today().isoformat()}-{slug}.json"
    print(f"# gpu_suite ({mode}) on {device}, mlx {mx.__version__}, BLAS: {BLAS}", flush=True)

    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="gpu_suite-"))
    calibration = os.environ.get("MLX_SPECULATE_CALIBRATION")
    os.environ["MLX_SPECULATE_CALIBRATION"] = str(work / "calibration")  # measured afresh here
    chosen = [t for t in targets if t.name in names]
    results, skipped = {}, {}
    try:
        for i, target in enumerate(chosen):
            if time.monotonic() - start > budget:
                skipped[target.name] = f"the time budget of {budget} s was spent before it"
                continue
            print(f"\n# {target.name}: {target.note}", flush=True)
            share = start + budget * (i + 1) / len(chosen)
            n = tokens[target.name]
            results[target.name] = run_target(target, mode, work, n, rounds, share, head)
            mx.clear_cache()
            write_report(out, results, notes, skipped, mode, device, BLAS, start)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if calibration is None:
            del os.environ["MLX_SPECULATE_CALIBRATION"]
        else:
            os.environ["MLX_SPECULATE_CALIBRATION"] = calibration
    report = write_report(out, results, notes, skipped, mode, device, BLAS, start)
    print_table(results, report)
    print(f"\nwrote {out} ({report['seconds']:.0f} s)")
    return report


def write_report(
    out: Path,
    results: dict,
    notes: dict,
    skipped: dict,
    mode: str,
    device: str,
    blas: str,
    start: float,
) -> dict:
    """The JSON file of the targets done so far (written after each: a run cut short keeps
    what it measured)."""
    report = {
        "device": device,
        "mlx_version": mx.__version__,
        "mlx_lm_version": version("mlx-lm"),
        "commit": commit(),
        "date": date.today().isoformat(),
        "mode": mode,
        "blas": blas,
        "env": {"MLX_ENABLE_TF32": os.environ["MLX_ENABLE_TF32"]},
        # A shared CPU's other work: how far its timings are from an idle machine's.
        "load_average": [round(x, 1) for x in os.getloadavg()],
        "seconds": round(time.monotonic() - start, 1),
        **summary(results, notes),
        "notes": notes | ({"skipped": skipped} if skipped else {}),
        "targets": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
