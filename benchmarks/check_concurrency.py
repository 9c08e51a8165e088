"""Issue #38's acceptance checks for concurrent serving, through the `openai` client against
mlx_speculate.server.

    python benchmarks/check_concurrency.py [--openblas] [--model FOLDER] [--max-tokens 48]
        [--copy-max-tokens 96] [--rounds 1] [--fresh [--cold]] [--out FILE]

(a) Eight greedy chat requests (a story each, on eight topics) sent at once, then the same
    eight one after another: the ratio of their aggregate tokens/s (goal: at least 3; the
    median over --rounds rounds of the per-round ratio), and how many of the eight answers
    equal their one-at-a-time answers in every concurrent pass (goal: at least 7). The
    concurrent pass goes first in the first round, so whatever the prefix cache keeps from it
    helps the one-at-a-time baseline, never the concurrent side; the order alternates after.
(b) Two copy-heavy requests at once ("fix the typos in this paragraph"), with prompt lookup and
    with speculation off (the `speculative` request field): the ratio of their aggregate
    tokens/s (goal: at least 1.2), the median over --rounds rounds of the per-round ratio, the
    two methods' order alternating; greedy answers must be equal between the methods
    (lossless). A warm-up pass of each method first, so both find their prompts cached alike.
    `--fresh`: (b) alone, on a server with no calibration stored, whose first request asks for
    prompt lookup: no warm-up, and lookup goes first in every round; with `--cold`, also an
    empty TMPDIR (MLX's kernel cache and our graph markers empty), as on a fresh machine.

Aggregate tokens/s: all completion tokens (usage) over the wall time from sending the first
request to the last stream's end. Prints the figures and whether each goal is met, writes them
to benchmarks/results/concurrency-<date>-<device>.json (`--out` for another path), and exits
with status 1 when a goal is missed (a server that generates one request at a time misses the
speed goals).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    add_blas_argument,
    describe_versions,
    setup_blas,
    smollm2_f32,
)
from servers import (  # noqa: E402
    PARAGRAPHS,
    Server,
    blas_env,
    check_lengths,
    copy_heavy,
    ours,
    positive,
    send,
    started,
    stories,
    write_result,
)

GOALS = {"concurrent_speedup": 3.0, "equal_answers": 7, "lookup_speedup": 1.2}
def copy_requests() -> list[list[dict]]:
    return copy_heavy(None, len(PARAGRAPHS))


def rate(wall: float, replies) -> float:
    return sum(r.completion_tokens for r in replies) / wall


def check_concurrent(server: Server, max_tokens: int, rounds: int) -> dict:
    """(a): eight at once against the same eight one after another, in each of `rounds`
    rounds (the concurrent pass first in the first round, the order alternating after)."""
    requests = stories("a", 8)
    none = {"speculative": {"method": "none"}}
    send(server, stories("warm-up", 1), max_tokens, False, none)
    at_once, in_turn = [], []
    for r in range(rounds):
        for concurrent in (True, False) if r % 2 == 0 else (False, True):
            wall, replies = send(server, requests, max_tokens, concurrent, none)
            (at_once if concurrent else in_turn).append((wall, replies))
    check_lengths(server, in_turn[0][1], max_tokens, "one at a time")
    reference = [reply.text for reply in in_turn[0][1]]
    # An answer counts as equal when every concurrent pass gave its one-at-a-time text.
    equal = sum(all(replies[i].text == text for _, replies in at_once)
                for i, text in enumerate(reference))
    ratios = [rate(*a) / rate(*b) for a, b in zip(at_once, in_turn, strict=True)]
    return {
        "requests": len(requests),
        "max_tokens": max_tokens,
        "rounds": rounds,
        "concurrent_tokens_per_s": [rate(*a) for a in at_once],
        "one_at_a_time_tokens_per_s": [rate(*b) for b in in_turn],
        "concurrent_speedup": statistics.median(ratios),
        "equal_answers": equal,
        "concurrent_completion_tokens": [[r.completion_tokens for r in a[1]] for a in at_once],
        "one_at_a_time_cached_tokens": [[r.cached_tokens for r in b[1]] for b in in_turn],
    }


def check_lookup(server: Server, max_tokens: int, rounds: int, fresh: bool = False) -> dict:
    """(b): two copy-heavy requests at once, prompt lookup against no speculation (`fresh`:
    no warm-up, lookup first in every round: its first use is timed)."""
    methods = {m: {"speculative": {"method": m}} for m in ("prompt_lookup", "none")}
    requests = copy_requests()
    for extra in [] if fresh else methods.values():
        send(server, requests, max_tokens, True, extra)
    figures = {m: [] for m in methods}
    texts, lengths, per_forward = {}, {}, []
    for r in range(rounds):
        for method in list(methods) if r % 2 == 0 or fresh else list(methods)[::-1]:
            wall, replies = send(server, requests, max_tokens, True, methods[method])
            figures[method].append(rate(wall, replies))
            texts.setdefault(method, [reply.text for reply in replies])
            lengths.setdefault(method, [reply.completion_tokens for reply in replies])
            if method == "prompt_lookup":
                per_forward += [reply.speculative["tokens_per_target_forward"]
                                for reply in replies if reply.speculative]
    if texts["prompt_lookup"] != texts["none"]:
        raise SystemExit("prompt lookup's greedy answers differ from plain decoding's: not "
                         "lossless")
    ratios = [a / b for a, b in zip(figures["prompt_lookup"], figures["none"], strict=True)]
    return {
        "requests": len(requests),
        "max_tokens": max_tokens,
        "rounds": rounds,
        "lookup_tokens_per_s": figures["prompt_lookup"],
        "plain_tokens_per_s": figures["none"],
        "lookup_speedup": statistics.median(ratios),
        "completion_tokens": lengths["none"],
        "lookup_tokens_per_target_forward": per_forward,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="an MLX folder (default: SmolLM2-135M-Instruct f32)")
    parser.add_argument("--max-tokens", type=positive, default=48, help="per request in (a)")
    parser.add_argument("--copy-max-tokens", type=positive, default=96,
                        help="per request in (b)")
    parser.add_argument("--rounds", type=positive, default=1,
                        help="timed rounds of (a) and of (b); ratios are medians over them")
    parser.add_argument("--fresh", action="store_true",
                        help="(b) alone, its first use timed, nothing calibrated")
    parser.add_argument("--cold", action="store_true",
                        help="with --fresh: MLX's kernel cache empty too (an empty TMPDIR)")
    parser.add_argument("--out", type=Path, default=None)
    add_blas_argument(parser)
    args = parser.parse_args(argv)
    command = shlex.join(["python", "benchmarks/check_concurrency.py", *sys.argv[1:]])
    load_start = os.getloadavg()
    env, blas = blas_env(args.openblas, setup_blas(args.openblas))

    folder = args.model or smollm2_f32()
    if not (folder / "config.json").exists():
        raise SystemExit(f"{folder} is not an MLX model folder (no config.json)")
    versions = describe_versions()
    with tempfile.TemporaryDirectory() as empty:
        if args.fresh:  # no calibration (and, cold, no kernels or markers) from earlier runs
            env = {**env, "MLX_SPECULATE_CALIBRATION": f"{empty}/calibration"}
            env.update({"TMPDIR": empty} if args.cold else {})
        with started(env, ours=(ours(folder, "--max-queue", "64"), folder.name)) as servers:
            concurrent = None
            if not args.fresh:
                concurrent = check_concurrent(servers["ours"], args.max_tokens, args.rounds)
            lookup = check_lookup(servers["ours"], args.copy_max_tokens, args.rounds, args.fresh)
    met = {"lookup_speedup": lookup["lookup_speedup"] >= GOALS["lookup_speedup"]}
    if concurrent is not None:
        met["concurrent_speedup"] = (
            concurrent["concurrent_speedup"] >= GOALS["concurrent_speedup"]
        )
        met["equal_answers"] = concurrent["equal_answers"] >= GOALS["equal_answers"]
    fields = {"goals": GOALS, "met": met, "concurrent": concurrent, "lookup": lookup}
    fields["fresh"], fields["cold"] = args.fresh, args.fresh and args.cold
    out = write_result(
        "concurrency",
        fields,
        command=command,
        blas=blas,
        load_start=load_start[0],
        versions=versions,
        model=folder,
        out=args.out,
    )

    def verdict(key: str) -> str:
        return "met" if met[key] else "MISSED"

    if concurrent is not None:
        print(f"(a) 8 at once vs one at a time: "
              f"{statistics.median(concurrent['concurrent_tokens_per_s']):.1f} vs "
              f"{statistics.median(concurrent['one_at_a_time_tokens_per_s']):.1f} tok/s, "
              f"{concurrent['concurrent_speedup']:.2f}x (goal >= "
              f"{GOALS['concurrent_speedup']}: {verdict('concurrent_speedup')}); answers "
              f"equal: {concurrent['equal_answers']}/8 (goal >= {GOALS['equal_answers']}: "
              f"{verdict('equal_answers')})")
    first = ", lookup's first use, nothing calibrated" if args.fresh else ""
    first += " and MLX's kernel cache empty" if args.fresh and args.cold else ""
    print(f"(b) 2 copy-heavy at once, prompt lookup vs none{first}: "
          f"{statistics.median(lookup['lookup_tokens_per_s']):.1f} vs "
          f"{statistics.median(lookup['plain_tokens_per_s']):.1f} tok/s, "
          f"{lookup['lookup_speedup']:.2f}x (goal >= {GOALS['lookup_speedup']}: "
          f"{verdict('lookup_speedup')})")
    print(f"wrote {out}")
    if not all(met.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
