"""Concurrent serving: aggregate tokens/s and time to first token of mlx_speculate.server and
mlx_lm.server (which batches plain decoding) on the same weights, at 1 to 16 clients at once.

    python benchmarks/bench_serving.py [--openblas] [--quick] [--clients 1,2,4,8,16]
        [--rounds 3] [--max-tokens 32] [--method none|prompt_lookup|eagle] [--eagle DIR]
        [--model FOLDER] [--out FILE] [--against mlx-lm|max-batch-1] [--prompts stories|copy]

Both servers serve one MLX folder: SmolLM2-135M-Instruct in float32, converted once from the
package's default GGUF (`--model` for another). Each client sends one streamed greedy chat
completion through the `openai` client, every client its own prompt (a story on its own topic,
under a system line naming the round, client count and client, so that no request finds
another's prompt in a prefix cache; both servers get the same prompts). Every timed request
must come back with exactly --max-tokens completion tokens (usage), else the run stops.

A warm-up pass at the largest client count goes to each server first. Then, per round, each
client count runs on each server in turn, the servers' order alternating between rounds. Per
(server, clients, round): aggregate tokens/s (all completion tokens over the wall time from
sending the first request to the last stream's end) and the p50 / p95 of the requests' times to
first token; the table gives the median over rounds. `--method` picks our server's method per
request (the `speculative` field); mlx-lm always decodes plainly. `--against max-batch-1` puts
our own server with `--max-batch 1` (one request at a time, the single-stream loop) in mlx-lm's
place, with the same method: what batching costs or saves. `--prompts copy` sends each client
a paragraph to return with its typos fixed instead (copy-heavy: what prompt lookup speeds up).

Writes benchmarks/results/serving-<date>-<device>.json (`--out` for another path), which
benchmarks/report.py renders as the Serving section of docs/results.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    add_blas_argument,
    describe_versions,
    setup_blas,
    smollm2_f32,
)
from servers import (  # noqa: E402
    TOPICS,
    Server,
    blas_env,
    check_lengths,
    copy_heavy,
    ours,
    positive,
    send,
    started,
    stories,
    theirs,
    write_result,
)

CLIENTS = (1, 2, 4, 8, 16)
QUICK = {"clients": (1, 4, 16), "rounds": 1, "max_tokens": 24}
DEFAULTS = {"clients": CLIENTS, "rounds": 3, "max_tokens": 32}
def measure(
    server: Server, tag: str, clients: int, max_tokens: int, extra_body, prompts: str = "stories"
) -> dict:
    """One concurrent pass: aggregate tokens/s and TTFT percentiles, checked lengths."""
    conversations = (copy_heavy if prompts == "copy" else stories)(tag, clients)
    wall, replies = send(server, conversations, max_tokens, True, extra_body)
    check_lengths(server, replies, max_tokens, f"{clients} clients, pass {tag}")
    ttft = [1e3 * r.ttft for r in replies]
    tokens = sum(r.completion_tokens for r in replies)
    return {
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p95_ms": float(np.percentile(ttft, 95)),
        "completion_tokens": tokens,
        "wall_s": wall,
        "cached_tokens": sum(r.cached_tokens for r in replies),
    }


def run(servers: dict[str, Server], args, extras: dict[str, dict | None]) -> list[dict]:
    """Every (server, clients) row with its per-round figures and their medians."""
    names = list(servers)
    for name in names:
        measure(servers[name], "warm-up", max(args.clients), args.max_tokens, extras[name],
                args.prompts)
    rounds: dict[tuple[str, int], list[dict]] = {(n, c): [] for n in names for c in args.clients}
    for r in range(args.rounds):
        for clients in args.clients:
            for name in names if r % 2 == 0 else names[::-1]:
                figures = measure(servers[name], f"{r}.{clients}", clients, args.max_tokens,
                                  extras[name], args.prompts)
                rounds[name, clients].append(figures)
                print(f"round {r + 1}: {name:<14} {clients:>2} clients "
                      f"{figures['tokens_per_s']:8.1f} tok/s  TTFT p50 "
                      f"{figures['ttft_p50_ms']:7.0f} ms  p95 {figures['ttft_p95_ms']:7.0f} ms",
                      flush=True)
    rows = []
    for (name, clients), figures in rounds.items():
        row = {"server": name, "clients": clients}
        for key in ("tokens_per_s", "ttft_p50_ms", "ttft_p95_ms"):
            row[key] = statistics.median(f[key] for f in figures)
        rows.append({**row, "rounds": figures})
    return rows


def table(rows: list[dict]) -> str:
    """Clients down, each server's tokens/s and TTFT p50 / p95 across."""
    names = list(dict.fromkeys(row["server"] for row in rows))
    by = {(row["server"], row["clients"]): row for row in rows}
    header = f"{'clients':>7}" + "".join(f" | {n + ' tok/s':>20} {'TTFT p50/p95 ms':>16}"
                                         for n in names)
    lines = [header, "-" * len(header)]
    for clients in sorted({row["clients"] for row in rows}):
        cells = []
        for name in names:
            row = by[name, clients]
            ttft = f"{row['ttft_p50_ms']:.0f}/{row['ttft_p95_ms']:.0f}"
            cells.append(f" | {row['tokens_per_s']:>20.1f} {ttft:>16}")
        lines.append(f"{clients:>7}" + "".join(cells))
    return "\n".join(lines)


def client_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(c) for c in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers") from None
    if not counts or not all(1 <= c <= len(TOPICS) for c in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: each count in [1, {len(TOPICS)}]")
    return counts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"defaults for a short run: {QUICK} (flags given still win)")
    parser.add_argument("--clients", type=client_counts, default=None,
                        help=f"client counts (default {','.join(map(str, CLIENTS))})")
    parser.add_argument("--rounds", type=positive, default=None, help="timed rounds (default 3)")
    parser.add_argument("--max-tokens", type=positive, default=None, help="per request (32)")
    parser.add_argument("--method", default="none", choices=["none", "prompt_lookup", "eagle"],
                        help="our server's method per request (eagle: with --eagle)")
    parser.add_argument("--eagle", type=Path, default=None, metavar="DIR",
                        help="EAGLE heads our servers load (--method eagle)")
    parser.add_argument("--prompts", default="stories", choices=["stories", "copy"],
                        help="a story each, or a paragraph to return with its typos fixed")
    parser.add_argument("--model", type=Path, default=None,
                        help="an MLX folder both servers load (default: SmolLM2-135M f32)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--against", default="mlx-lm", choices=["mlx-lm", "max-batch-1"],
                        help="the server compared with ours (default mlx-lm)")
    add_blas_argument(parser)
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    command = shlex.join(["python", "benchmarks/bench_serving.py", *sys.argv[1:]])
    load_start = os.getloadavg()
    env, blas = blas_env(args.openblas, setup_blas(args.openblas))

    folder = args.model or smollm2_f32()
    if not (folder / "config.json").exists():
        raise SystemExit(f"{folder} is not an MLX model folder (no config.json)")
    if (args.method == "eagle") != (args.eagle is not None):
        raise SystemExit("--method eagle goes with --eagle DIR (the heads), and only with it")
    method = {"speculative": {"method": args.method}}
    flags = ("--max-queue", "64") + (("--eagle", str(args.eagle)) if args.eagle else ())
    commands = {"mlx_speculate": (ours(folder, *flags), folder.name)}
    extras = {"mlx_speculate": method}
    if args.against == "mlx-lm":
        commands["mlx-lm"] = (theirs(folder, "--log-level", "WARNING"), str(folder))
        extras["mlx-lm"] = None
    else:
        solo = ours(folder, *flags, "--max-batch", "1")
        commands["max-batch-1"], extras["max-batch-1"] = (solo, folder.name), method
    print(f"# serving: {folder.name}, clients {args.clients}, {args.rounds} rounds, "
          f"{args.max_tokens} tokens per request, our method {args.method}; BLAS: {blas}")
    versions = describe_versions()  # the code that runs, before the checkout can change
    with started(env, **commands) as servers:
        rows = run(servers, args, extras)
    fields = {
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "method": args.method,
        "servers": {name: shlex.join(c[0]) for name, c in commands.items()},
        "rows": rows,
    }
    out = write_result(
        "serving" if args.against == "mlx-lm" else "batching",  # report.py renders serving-*
        fields,
        command=command,
        blas=blas,
        load_start=load_start[0],
        versions=versions,
        model=folder,
        out=args.out,
    )
    print(table(rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
