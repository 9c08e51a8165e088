"""Every method on the shared models and SmolLM2-135M-Instruct (float32 and 4-bit), interleaved
with mlx-lm's plain decoding on the same weights, and plain decoding against mlx-lm's on the
2026 families: the results page docs/results.md and its chart docs/results.png (tokens/s, tau
and the ratio to our plain decoding, with their spread).

    python benchmarks/report.py [--openblas] [--runs 3] [--max-tokens 96]
        [--models stories,smollm2-f32,smollm2-4bit,families] [--out docs/results.md]
    python benchmarks/report.py --render   # the page again from docs/results*.json, no runs

The page names the machine (CPU, cores, OS, BLAS, load average), the versions (mlx, mlx-lm,
Python, this checkout's commit), the exact command and every prompt; each row gives the median
of its timed rounds and their range. Rounds are interleaved (the first warms up, calibrates the
adaptive policy, and is dropped); decoding is greedy, so every method emits the same tokens as
plain decoding. A speculative row whose adaptive policy drafted nothing says so. mlx-lm
computes in our dtype (by default it keeps the checkpoint's float16 scales, which MLX's CPU
backend computes far slower). The chart needs matplotlib: `pip install mlx_speculate[bench]`.
The measured values go to results.json beside the page. The page then shows the families
section (below), the newest concurrent-serving run (benchmarks/bench_serving.py's
benchmarks/results/serving-*.json, with its own device, date and command) and ends with the
earlier measurements recorded in benchmarks/measurements.json (each with its device, date and
command).

The `families` set (benchmarks/family_models.py: Qwen3.5, Qwen3.5-MoE, Qwen3-Next, Qwen3-MoE,
gpt-oss, Gemma 4 text, each tiny and SmolLM2-sized, random float32 weights) times plain decoding
only, with EOS ignored and every run's token count checked; it is saved to results-families.json
and rendered as a section of its own, so a run of either kind keeps the other's section.
Converted models go under $MLX_SPECULATE_BENCH_DIR, else $MLX_SPECULATE_CACHE, else
~/.cache/mlx_speculate.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    MODELS,
    SHARED,
    add_blas_argument,
    describe_machine,
    describe_versions,
    header,
    setup_blas,
    smollm2_f32,
)

ROOT = Path(__file__).resolve().parents[1]
MEASUREMENTS = Path(__file__).resolve().parent / "measurements.json"
RESULTS = Path(__file__).resolve().parent / "results"  # bench_serving.py's runs, among others
MIN_RUNS = 3  # a median and its spread need at least three timed rounds
MODEL_SETS = ("stories", "smollm2-f32", "smollm2-4bit", "families")
METHOD_TOKENS = 96
FAMILY_TOKENS = 24  # twelve models, two decoders each: the set stays within minutes on a CPU


@dataclass(frozen=True)
class Prompt:
    name: str
    text: str
    chat: bool  # given through the model's chat template (else as plain text after BOS)


STORY = Prompt("story", "Once upon a time, there was a little girl named Lily. She", chat=False)
EDIT = Prompt(
    "edit",
    "Fix the typos in this text and return it unchanged otherwise:\n\n"
    "The quick brown fox jumpd over the lazy dog. The dog was not amused, and it barkd at the "
    "fox. The fox ran into the forest, where it met an owl. The owl said: it is late, little fox, "
    "go home. The fox went home and slept until the morning sun woke it up again.",
    chat=True,
)


@dataclass(frozen=True)
class Row:
    """One method on one model: a value per timed round, in round order."""

    model: str
    method: str
    prompt: str  # a Prompt's name
    tokens_per_s: tuple[float, ...]
    tau: tuple[float, ...]
    drafted: tuple[int, ...] | None  # tokens proposed per round; None: a row that never drafts
    tokens: tuple[int, ...] | None = None  # tokens emitted per round (None: not recorded)


@dataclass(frozen=True)
class Measurement:
    """A figure recorded by hand from a benchmark's output (measurements.json)."""

    what: str
    result: str
    device: str
    date: str
    conditions: str
    command: str


@dataclass(frozen=True)
class ServingRow:
    """One server at one client count: medians over rounds."""

    server: str
    clients: int
    tokens_per_s: float  # aggregate: every client's completion tokens over the wall time
    ttft_p50_ms: float
    ttft_p95_ms: float


@dataclass(frozen=True)
class Serving:
    """A run of benchmarks/bench_serving.py (its JSON file), as the page shows it."""

    date: str
    command: str
    device: str  # in words: CPU or GPU, cores, BLAS
    load: tuple[float, float]  # 1-minute load average when the run started and ended
    cores: int
    model: str
    method: str  # our server's method per request
    max_tokens: int
    rounds: int
    rows: tuple[ServingRow, ...]


@dataclass(frozen=True)
class Report:
    date: str
    command: str
    machine: dict[str, str]  # label -> value, in display order
    cores: int
    load: tuple[float, float]  # 1-minute load average when the runs started and ended
    versions: dict[str, str]
    prompts: tuple[Prompt, ...]
    max_tokens: int
    rows: tuple[Row, ...]
    recorded: tuple[Measurement, ...] = ()  # not saved with the run: read at each rendering
    described: dict[str, str] = field(default_factory=dict)  # model label -> its shapes
    serving: Serving | None = None  # likewise: the newest serving run in benchmarks/results


def recorded(path: Path = MEASUREMENTS) -> tuple[Measurement, ...]:
    """The measurements file's entries, each device key replaced by the device's description."""
    data = json.loads(path.read_text())
    devices = data["devices"]
    return tuple(
        Measurement(**{**entry, "device": devices[entry["device"]]})
        for entry in data["measurements"]
    )


def newest_serving(folder: Path = RESULTS) -> Serving | None:
    """The serving run in `folder` (serving-*.json) with the latest date, None when there is
    none; a file that is not such a run is a one-line SystemExit."""
    runs = []
    for path in sorted(folder.glob("serving-*.json")):
        try:
            data = json.loads(path.read_text())
            machine = data["machine"]
            runs.append(Serving(
                date=data["date"],
                command=data["command"],
                device=f"{machine['CPU']} ({machine['MLX device']}), BLAS: {machine['BLAS']}",
                load=tuple(data["load"]),
                cores=data["cores"],
                model=data["model"],
                method=data["method"],
                max_tokens=data["max_tokens"],
                rounds=data["rounds"],
                rows=tuple(
                    ServingRow(r["server"], r["clients"], r["tokens_per_s"], r["ttft_p50_ms"],
                               r["ttft_p95_ms"])
                    for r in data["rows"]
                ),
            ))
        except (ValueError, KeyError, TypeError) as e:
            raise SystemExit(
                f"{path} is not a bench_serving.py run: {type(e).__name__}: {e}"
            ) from None
    return max(runs, key=lambda run: run.date, default=None)


def save(report: Report, path: Path) -> None:
    run = dataclasses.asdict(dataclasses.replace(report, recorded=(), serving=None))
    del run["recorded"], run["serving"]
    _install(path, lambda staged: staged.write_text(json.dumps(run, indent=1) + "\n"))


def load_saved(path: Path) -> Report:
    if not path.exists():
        raise SystemExit(f"{path} not found: run benchmarks/report.py without --render first")
    run = json.loads(path.read_text())
    return Report(
        **{**run, "load": tuple(run["load"]),
           "prompts": tuple(Prompt(**p) for p in run["prompts"]),
           "rows": tuple(_row(r) for r in run["rows"])}
    )


def _row(fields: dict) -> Row:
    drafted, tokens = fields["drafted"], fields.get("tokens")
    return Row(
        **{**fields, "tokens_per_s": tuple(fields["tokens_per_s"]), "tau": tuple(fields["tau"]),
           "drafted": None if drafted is None else tuple(drafted),
           "tokens": None if tokens is None else tuple(tokens)}
    )


def cases(names: list[str]):
    """(label, model folder, Prompt, {method: stream_generate keywords})."""
    from mlx_speculate.default_model import default_model_path

    eagle1, eagle3 = SHARED / "eagle" / "smollm2-eagle1", SHARED / "eagle" / "smollm2-eagle3"
    for name in names:
        if name == "stories":
            folder = MODELS / "stories260K-llama"
            draft = MODELS / "llama2xs281K-llama"
            yield "stories260K", folder, STORY, {
                "draft model (llama2xs281K)": {"draft_model": str(draft)},
                "prompt lookup (trees, the default)": {"prompt_lookup": True},
                "prompt lookup chain": {"prompt_lookup": True, "lookup_branches": 1},
            }
        elif name in ("smollm2-f32", "smollm2-4bit"):
            f32, q4 = smollm2_f32(), default_model_path()
            folder = f32 if name == "smollm2-f32" else q4
            methods = {
                "prompt lookup (trees, the default)": {"prompt_lookup": True},
                "prompt lookup chain": {"prompt_lookup": True, "lookup_branches": 1},
                "EAGLE-1 adaptive": {"eagle": str(eagle1)},
                "EAGLE-3 adaptive": {"eagle": str(eagle3)},
            }
            if name == "smollm2-f32":
                methods["draft model (its 4-bit copy)"] = {"draft_model": str(q4)}
            yield f"SmolLM2-135M {name.split('-')[1]}", folder, EDIT, methods
        else:
            raise SystemExit(f"unknown model {name!r} (stories, smollm2-f32, smollm2-4bit)")


def timed(stream, decode_only: bool) -> tuple[float, list]:
    """Tokens/s of a generation and its responses: from the call on, or with `decode_only` from
    the first token (the prompt's forward) to the last."""
    start, first, responses = time.perf_counter(), None, []
    for response in stream:
        responses.append(response)
        first = first or time.perf_counter()
    end = time.perf_counter()
    if decode_only:
        return (len(responses) - 1) / (end - first), responses
    return len(responses) / (end - start), responses


def ours(model, tokenizer, prompt, max_tokens, decode_only=False, **kwargs):
    """tokens/s, tau, the tokens drafted and the tokens emitted, for one generation."""
    from mlx_speculate import stream_generate

    stream = stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs)
    rate, responses = timed(stream, decode_only)
    stats = responses[-1].stats
    tau = stats.tokens_per_forward if stats.target_forwards else 1.0
    return rate, tau, stats.drafted, len(responses)


def theirs(model, tokenizer, prompt, max_tokens, decode_only=False):
    import mlx_lm

    stream = mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)
    rate, responses = timed(stream, decode_only)
    return rate, 1.0, 0, len(responses)


def measure(label, folder, prompt: Prompt, methods, runs, max_tokens, exact=False) -> list[Row]:
    """Every method's rows on one model, interleaved round by round. `exact`: EOS is ignored
    (random weights emit it by chance), every run must emit `max_tokens` (else SystemExit), and
    tokens/s counts decoding only, from the first token on."""
    import mlx_lm

    from mlx_speculate import load
    from mlx_speculate.chat import apply_chat_template, plain_tokens
    from mlx_speculate.drafters import spec_from_keywords

    model, tokenizer = load(folder)
    their_model, their_tokenizer = mlx_lm.load(str(folder))
    their_model.set_dtype(model.compute_dtype)  # same weights, same arithmetic
    if exact:
        tokenizer.eos_token_ids = their_tokenizer.eos_token_ids = []
    if prompt.chat:
        tokens = apply_chat_template(tokenizer, prompt.text)
    else:
        tokens = plain_tokens(tokenizer, [prompt.text])
    rows = {
        "plain": lambda: ours(model, tokenizer, tokens, max_tokens, exact),
        "mlx-lm plain": lambda: theirs(their_model, their_tokenizer, tokens, max_tokens, exact),
    }
    for name, kwargs in methods.items():
        # Draft models and heads are loaded once here, not inside each timed generation.
        spec = spec_from_keywords(**kwargs).resolve(model)
        rows[name] = lambda spec=spec: ours(model, tokenizer, tokens, max_tokens, drafter=spec)
    results = {name: [] for name in rows}
    for round_ in range(runs + 1):
        for name, run in rows.items():
            results[name].append(run())
            if exact and (n := results[name][-1][3]) != max_tokens:
                raise SystemExit(f"{label}, {name}: {n} tokens in round {round_} (0 warms up), "
                                 f"not {max_tokens}: a run must emit all of them")
    out = []
    for name, values in results.items():
        timed = values[1:]  # the first round warms up
        row = Row(
            model=label,
            method=name,
            prompt=prompt.name,
            tokens_per_s=tuple(v[0] for v in timed),
            tau=tuple(v[1] for v in timed),
            drafted=None if name in ("plain", "mlx-lm plain") else tuple(v[2] for v in timed),
            tokens=tuple(v[3] for v in timed),
        )
        print(f"{label:<28} {name:<34} {statistics.median(row.tokens_per_s):>8.2f} tok/s  "
              f"tau {statistics.median(row.tau):.2f}", flush=True)
        out.append(row)
    return out


def ratios(row: Row, rows: Sequence[Row]) -> tuple[float, ...]:
    """The row's tokens/s over plain decoding's of the same model, round by round."""
    plain = next(r for r in rows if r.model == row.model and r.method == "plain")
    return tuple(a / b for a, b in zip(row.tokens_per_s, plain.tokens_per_s, strict=True))


def spread(values: Sequence[float], digits: int, suffix: str = "") -> str:
    """'median (min-max)' of the values, the range left out when every value is the same."""
    low, mid, high = min(values), statistics.median(values), max(values)
    text = f"{mid:,.{digits}f}{suffix}"
    if f"{low:.{digits}f}" != f"{high:.{digits}f}":
        text += f" ({low:,.{digits}f}–{high:,.{digits}f})"
    return text


def note(row: Row) -> str:
    if row.drafted is None:
        return ""
    never = sum(d == 0 for d in row.drafted)
    if never == len(row.drafted):
        return "the adaptive policy never drafted: it ran as plain decoding"
    if never:
        return f"drafted nothing in {never} of {len(row.drafted)} rounds"
    return ""


def render(report: Report, chart: str | None = None, families: Report | None = None) -> str:
    """The results page, in markdown: a pure function of the reports (`chart`: the PNG's path
    relative to the page, or None for no chart; `families`: the families set's run, measured
    apart, as its own section)."""
    runs = {len(row.tokens_per_s) for row in report.rows}
    lines = [
        "# Results",
        "",
        "<!-- Generated by benchmarks/report.py: edit the script, not this page. -->",
        "",
        "Every method against plain decoding and mlx-lm's plain decoding on the same weights, "
        "greedy, so every method emits exactly the tokens plain decoding does. Each row is the "
        f"median of {' / '.join(str(n) for n in sorted(runs))} timed rounds, the rounds "
        "interleaved across rows after one warm-up round, with the range (min–max) in "
        "brackets. *vs plain* is the median of the per-round ratios to plain decoding in the "
        "same round; *tau* is tokens per target forward (1.00: nothing drafted was accepted).",
        "",
        f"Measured on {report.date}:",
        "",
        "```",
        report.command,
        "```",
        "",
        "## Machine",
        "",
        *_busy(report),
        *(f"- {key}: {value}" for key, value in report.machine.items()),
        f"- cores: {report.cores}",
        f"- load average (1 min) at start / end: {report.load[0]:.1f} / {report.load[1]:.1f}",
        "",
        "## Versions",
        "",
        *(f"- {key}: {value}" for key, value in report.versions.items()),
        "",
        "## Prompts",
        "",
        f"Up to {report.max_tokens} tokens from each.",
        "",
    ]
    for prompt in report.prompts:
        how = "through the model's chat template" if prompt.chat else "as plain text after BOS"
        lines += [f"**{prompt.name}** ({how}):", "", "```text", prompt.text, "```", ""]
    lines += [
        "## Table",
        "",
        "| model | method | prompt | tokens/s | tau | vs plain | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report.rows:
        cells = [
            row.model,
            row.method,
            row.prompt,
            spread(row.tokens_per_s, 1),
            spread(row.tau, 2),
            spread(ratios(row, report.rows), 2, "x"),
            note(row),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if chart is not None:
        lines += ["", f"![tokens/s relative to plain decoding, median and range]({chart})"]
    if families is not None:
        lines += ["", *family_section(families)]
    if report.serving is not None:
        lines += ["", *serving_section(report.serving)]
    if report.recorded:
        lines += [
            "",
            "## Earlier measurements",
            "",
            "Figures recorded from the benchmark scripts' output on earlier versions of the "
            "code (benchmarks/measurements.json), each with its device, date and command; "
            "the machine was often shared, so compare ratios within a row, not across rows.",
            "",
            "| what | result | device | date | conditions | command |",
            "|---|---|---|---|---|---|",
        ]
        for n, m in enumerate(report.recorded, 1):
            lines.append(f"| {m.what} | {m.result} | {m.device} | {m.date} | {m.conditions} "
                         f"| [{n}] |")
        lines += ["", "Commands:", ""]
        lines += [f"{n}. `{m.command}`" for n, m in enumerate(report.recorded, 1)]
    return "\n".join(lines) + "\n"


def family_section(report: Report) -> list[str]:
    """The families set's section: each model's shapes, the tokens every timed run emitted,
    and our plain decoding against mlx-lm's, with the machine and versions of that run."""
    runs = {len(row.tokens_per_s) for row in report.rows}
    lines = [
        "## Families",
        "",
        "Plain decoding, ours against mlx-lm's, on the families added in 2026: random float32 "
        "weights in each family's shapes (benchmarks/family_models.py), converted by "
        "`mlx_speculate.convert` into one folder that both load. Greedy, with EOS ignored: "
        f"every timed run emitted exactly its {report.max_tokens} tokens (checked), after the "
        f"**{', '.join(p.name for p in report.prompts)}** prompt above. Tokens/s counts "
        "decoding only, from the first token (the prompt's forward) to the last. Each row is "
        "the median of "
        f"{' / '.join(str(n) for n in sorted(runs))} timed rounds, ours and mlx-lm's "
        "interleaved after one warm-up round, with the range (min–max) in brackets; *ours / "
        "mlx-lm* is the median of the per-round ratios.",
        "",
        f"Measured on {report.date}, apart from the table above:",
        "",
        "```",
        report.command,
        "```",
        "",
        *_busy(report, tau=False),
        *(f"- {key}: {value}" for key, value in report.machine.items()),
        f"- cores: {report.cores}",
        f"- load average (1 min) at start / end: {report.load[0]:.1f} / {report.load[1]:.1f}",
        *(f"- {key}: {value}" for key, value in report.versions.items()),
        "",
        "| model | shapes | tokens a run | ours (tokens/s) | mlx-lm (tokens/s) | ours / mlx-lm |",
        "|---|---|---|---|---|---|",
    ]
    by_model: dict[str, dict[str, Row]] = {}
    for row in report.rows:
        by_model.setdefault(row.model, {})[row.method] = row
    for model, rows in by_model.items():
        mine, theirs = rows["plain"], rows["mlx-lm plain"]
        ratio = tuple(
            a / b for a, b in zip(mine.tokens_per_s, theirs.tokens_per_s, strict=True)
        )
        counts = [n for row in (mine, theirs) for n in row.tokens or ()]
        cells = [
            model,
            report.described.get(model, ""),
            spread(counts, 0) if counts else "",
            spread(mine.tokens_per_s, 1),
            spread(theirs.tokens_per_s, 1),
            spread(ratio, 2, "x"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def serving_section(run: Serving) -> list[str]:
    """The Serving section: per client count, each server's aggregate tokens/s, then each
    server's time to first token p50 / p95, servers in the run's order."""
    servers = list(dict.fromkeys(row.server for row in run.rows))
    by = {(row.server, row.clients): row for row in run.rows}
    rounds = "1 round" if run.rounds == 1 else f"medians over {run.rounds} rounds"
    lines = [
        "## Serving",
        "",
        "Several clients at once, each sending one streamed greedy chat completion of "
        f"{run.max_tokens} tokens (its own prompt) through the `openai` client: aggregate "
        "tokens/s (every client's completion tokens over the wall time from the first request "
        "to the last stream's end) and time to first token (p50 / p95 over the clients), "
        f"{rounds}, the servers taking turns within each round. mlx_speculate.server runs "
        f"method `{run.method}`; mlx_lm.server (its listen backlog raised from socketserver's 5, "
        "which resets a burst of connections) batches plain decoding. Model: "
        f"{run.model}, the same folder for both.",
        "",
        f"Measured on {run.date} on {run.device}, {run.cores} cores, load average (1 min) at start "
        f"/ end: {run.load[0]:.1f} / {run.load[1]:.1f}"
        + (" (busy: more than its cores)" if max(run.load) > run.cores else "") + ":",
        "",
        "```",
        run.command,
        "```",
        "",
        "| clients | " + " | ".join(f"{s} tokens/s" for s in servers) + " | "
        + " | ".join(f"{s} TTFT p50 / p95 ms" for s in servers) + " |",
        "|---" * (1 + 2 * len(servers)) + "|",
    ]
    for clients in sorted({row.clients for row in run.rows}):
        mine = [by.get((s, clients)) for s in servers]
        cells = [str(clients)]
        cells += ["–" if r is None else f"{r.tokens_per_s:,.1f}" for r in mine]
        cells += ["–" if r is None else f"{r.ttft_p50_ms:,.0f} / {r.ttft_p95_ms:,.0f}"
                  for r in mine]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _busy(report: Report, tau: bool = True) -> list[str]:
    """A warning, when other processes wanted more cores than the machine has (`tau`: the
    table has a tau column, which the load does not move)."""
    if max(report.load) <= report.cores:
        return []
    exact = "; tau, exact under greedy decoding, is not." if tau else "."
    return [
        f"**The machine was busy**: its load average ({max(report.load):.1f}) exceeded its "
        f"{report.cores} cores, so other processes took CPU time from these runs. Their "
        f"tokens/s and ratios are noisy (see the ranges){exact}",
        "",
    ]


def draw(report: Report, path: Path) -> None:
    """A panel per model: each method's median ratio to plain decoding, its range as a bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(row.model for row in report.rows))
    fig, axes = plt.subplots(1, len(labels), figsize=(7 * len(labels), 4), squeeze=False)
    for ax, label in zip(axes[0], labels, strict=True):
        mine = [row for row in report.rows if row.model == label]
        per_round = [ratios(row, report.rows) for row in mine]
        mids = [statistics.median(r) for r in per_round]
        errors = [[m - min(r) for m, r in zip(mids, per_round, strict=True)],
                  [max(r) - m for m, r in zip(mids, per_round, strict=True)]]
        bars = ax.barh([row.method for row in mine], mids, xerr=errors, capsize=3)
        for bar, row, r in zip(bars, mine, per_round, strict=True):
            ax.text(max(r), bar.get_y() + bar.get_height() / 2,
                    f" {statistics.median(row.tokens_per_s):,.0f} tok/s, "
                    f"tau {statistics.median(row.tau):.2f}"
                    + (", never drafted" if note(row).startswith("the adaptive") else ""),
                    va="center", fontsize=7)
        ax.axvline(1.0, color="grey", linewidth=0.8)
        ax.set_xlim(0, 2.2 * max(max(r) for r in per_round))  # room for the labels
        ax.set_title(label)
        ax.set_xlabel("tokens/s relative to plain decoding")
        ax.invert_yaxis()
    fig.suptitle(f"{report.machine['CPU']}, {report.cores} cores, load "
                 f"{max(report.load):.1f}, {report.date}", fontsize=9)
    fig.tight_layout()
    _install(path, lambda staged: fig.savefig(staged, dpi=120))


def _install(path: Path, write) -> None:
    """Writes `path` through `write(staged)` in one rename: a re-run never leaves half a file."""
    from mlx_speculate.atomic import install_file, staging_folder

    path.parent.mkdir(parents=True, exist_ok=True)
    staged = staging_folder(path) / path.name
    write(staged)
    install_file(staged, path)


def _runs(text: str) -> int:
    value = int(text)
    if value < MIN_RUNS:
        raise argparse.ArgumentTypeError(f"at least {MIN_RUNS}: a median and its range need them")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"a positive number of tokens, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="stories,smollm2-f32,smollm2-4bit",
                        help=f"comma-separated, of {', '.join(MODEL_SETS)} (families: plain "
                        "decoding against mlx-lm on the 2026 families, a section of its own)")
    parser.add_argument("--runs", type=_runs, default=3, help="timed rounds (at least 3)")
    parser.add_argument("--max-tokens", type=_positive, default=None,
                        help=f"tokens a run (default {METHOD_TOKENS}; {FAMILY_TOKENS} for "
                        "families)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results.md",
                        help="the page; its chart goes beside it as .png")
    parser.add_argument("--render", action="store_true",
                        help="write the page and chart again from the saved results, no runs")
    add_blas_argument(parser)
    args = parser.parse_args(argv)
    saved, saved_families = args.out.with_suffix(".json"), families_file(args.out)
    if args.render:
        publish(load_saved(saved), load_families(saved_families), args.out)
        return
    names = args.models.split(",")
    if unknown := [n for n in names if n not in MODEL_SETS]:
        parser.error(f"unknown model set {unknown[0]!r} (known: {', '.join(MODEL_SETS)})")
    command = shlex.join(["python", "benchmarks/report.py", *sys.argv[1:]])
    preload = {k: os.environ[k] for k in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS") if k in os.environ}
    if preload:
        command = " ".join(f"{k}={shlex.quote(v)}" for k, v in preload.items()) + " " + command
    blas = setup_blas(args.openblas)
    header("Every method against plain decoding and mlx-lm (greedy, same weights)", blas)
    versions = describe_versions()  # the code that runs, before the checkout can change

    def run(measured, max_tokens: int, **fields) -> Report:
        """A Report of the rows `measured()` returns, with the load around it."""
        load_start = os.getloadavg()
        rows, prompts = measured()
        return Report(
            date=datetime.date.today().isoformat(),
            command=command,
            machine=describe_machine(blas),
            cores=os.cpu_count() or 1,
            load=(load_start[0], os.getloadavg()[0]),
            versions=versions,
            prompts=prompts,
            max_tokens=max_tokens,
            rows=tuple(rows),
            **fields,
        )

    methods = families = None
    method_sets = [n for n in names if n != "families"]
    if method_sets:
        tokens = args.max_tokens or METHOD_TOKENS

        def every_method():
            rows, prompts = [], {}
            for label, folder, prompt, methods in cases(method_sets):
                prompts[prompt.name] = prompt
                rows += measure(label, folder, prompt, methods, args.runs, tokens)
            return rows, tuple(prompts.values())

        methods = run(every_method, tokens)
        save(methods, saved)
    if "families" in names:
        from family_models import family_cases

        tokens, described = args.max_tokens or FAMILY_TOKENS, {}

        def plain_on_families():
            rows = []
            for label, folder, shapes in family_cases():
                described[label] = shapes
                rows += measure(label, folder, STORY, {}, args.runs, tokens, exact=True)
            return rows, (STORY,)

        families = run(plain_on_families, tokens, described=described)
        save(families, saved_families)
    publish(methods or load_saved(saved), families or load_families(saved_families), args.out)


def families_file(page: Path) -> Path:
    """Where the families set's run is saved, beside the page's own results."""
    return page.with_name(f"{page.stem}-families.json")


def load_families(path: Path) -> Report | None:
    return load_saved(path) if path.exists() else None


def publish(report: Report, families: Report | None, out: Path) -> None:
    """The page (with the recorded measurements and the newest serving run read now) and the
    chart of `report`."""
    report = dataclasses.replace(report, recorded=recorded(), serving=newest_serving())
    chart = out.with_suffix(".png")
    draw(report, chart)
    _install(out, lambda staged: staged.write_text(render(report, chart.name, families)))
    print(f"wrote {out} and {chart}")


if __name__ == "__main__":
    main()
