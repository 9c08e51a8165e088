"""Ours against mlx-lm on one target/draft pair (by default stories260K with the llama2xs281K
draft), interleaved in one process: tokens/s and CPU ms per token (process and main thread),
plain decoding and draft-model speculation at k = 4. Under a shared CPU the process's CPU time
per token swings less than its wall time.

    python benchmarks/bench_pair.py [--openblas] [--temperature 0] [--runs 3] [--max-tokens 256]
        [--target FOLDER --draft FOLDER | --make-mistral DIR] [--out FILE] [--profile]

`--target` / `--draft` take any pair both packages load. `--make-mistral DIR` writes (once) and
times a random float32 Mistral pair under DIR (mistral_pair.py: a mid-size target whose next
token follows mostly from the last one, and a small draft sharing its map, so drafts are partly
accepted). Per round (the first, shorter, warms up and traces the compiled steps, and is
dropped) each method runs ours and mlx-lm's back to back, which goes first alternating between
rounds; the first token (the prompt's forward) is not timed. Every run's emitted token count
is checked (the same for all four runs of a round), and at temperature 0 every run's tokens
against our plain decoding's (lossless, and the same model as mlx-lm's). The table gives
medians over the timed rounds; the JSON (benchmarks/results/pair-<date>-<device>.json, or
`--out`) holds every round. `--profile` then runs each of our methods once under cProfile and
prints where the time goes.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

# This checkout's package (not an installed one) and the benchmarks' helpers beside this file.
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from common import MODELS, add_blas_argument, describe_versions, header, setup_blas  # noqa: E402

K = 4
WARMUP_TOKENS = 32  # the warm-up round's length: enough to trace every step shape
PROMPT = "Once upon a time, there was a little girl named Lily. She"
METHODS = ("plain", "draft")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--target", type=Path, default=None)
    parser.add_argument("--draft", type=Path, default=None)
    parser.add_argument("--make-mistral", type=Path, default=None, metavar="DIR")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", action="store_true")
    add_blas_argument(parser)
    args = parser.parse_args(argv)
    if args.runs < 1 or args.max_tokens < 2:
        parser.error("--runs must be at least 1 and --max-tokens at least 2")
    if args.make_mistral and (args.target or args.draft):
        parser.error("give --make-mistral or --target/--draft, not both")
    if (args.target is None) != (args.draft is None):
        parser.error("give --target and --draft together")
    load_start = os.getloadavg()[0]
    blas = setup_blas(args.openblas)
    versions = describe_versions()  # the code that runs, before the checkout can change

    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    import mlx_speculate
    from mlx_speculate import load, stream_generate

    if args.make_mistral:
        from mistral_pair import write_mistral_pair

        folder, draft_folder = write_mistral_pair(args.make_mistral)
    else:
        folder = args.target or MODELS / "stories260K-llama"
        draft_folder = args.draft or MODELS / "llama2xs281K-llama"
    for f in (folder, draft_folder):
        if not (f / "config.json").exists():
            raise SystemExit(f"{f} is not a model folder (no config.json)")
    header(f"ours against mlx-lm, interleaved ({folder.name}, draft {draft_folder.name})", blas)
    print(f"mlx_speculate from {Path(mlx_speculate.__file__).parent}")
    print(f"load average at start: {load_start:.2f} on {os.cpu_count()} cores")

    model, tokenizer = load(folder)
    draft, draft_tokenizer = load(draft_folder)
    theirs, their_tokenizer = mlx_lm.load(str(folder))
    their_draft, _ = mlx_lm.load(str(draft_folder))
    prompt = tokenizer.encode(args.prompt)
    t = args.temperature

    def ours(**kw):
        def run(n):
            return stream_generate(
                model, tokenizer, prompt, max_tokens=n, temperature=t, seed=0, **kw
            )

        return run

    def mlx_lm_run(**kw):
        def run(n):
            sampler = make_sampler(temp=t)
            return mlx_lm.stream_generate(
                theirs, their_tokenizer, prompt, max_tokens=n, sampler=sampler, **kw
            )

        return run

    runs = {
        "plain": ours(),
        "mlx-lm plain": mlx_lm_run(),
        "draft": ours(draft_model=draft, draft_tokenizer=draft_tokenizer, num_draft_tokens=K),
        "mlx-lm draft": mlx_lm_run(draft_model=their_draft, num_draft_tokens=K),
    }
    rounds: list[dict] = []
    for round_ in range(args.runs + 1):  # round 0 warms up (and traces the compiled steps)
        n = min(args.max_tokens, WARMUP_TOKENS) if round_ == 0 else args.max_tokens
        order = [name for m in METHODS for name in _pair(m, flip=round_ % 2 == 1)]
        record = {}
        for name in order:
            mx.clear_cache()
            record[name] = _timed(runs[name](n))
        _check(record, t, round_)
        if round_:
            rounds.append(record)
            print(
                f"round {round_}: "
                + ", ".join(f"{k} {v['tokens_per_s']:.2f} tok/s" for k, v in record.items())
                + f" (load {os.getloadavg()[0]:.2f})"
            )
    medians = {
        name: {
            key: statistics.median(r[name][key] for r in rounds)
            for key in ("tokens_per_s", "cpu_ms_per_token", "main_cpu_ms_per_token")
        }
        for name in runs
    }
    print(f"{'method':<14} {'tok/s':>8} {'CPU ms/tok':>11} {'main ms/tok':>12} {'accepted':>9}")
    for name, m in medians.items():
        accepted = rounds[-1][name]["accepted"]
        print(
            f"{name:<14} {m['tokens_per_s']:>8.2f} {m['cpu_ms_per_token']:>11.2f} "
            f"{m['main_cpu_ms_per_token']:>12.2f} {accepted:>9}"
        )
    ratios = {}
    for method in METHODS:
        a, b = medians[method], medians[f"mlx-lm {method}"]
        ratios[method] = {
            "tokens_per_s": a["tokens_per_s"] / b["tokens_per_s"],
            "cpu_per_token": b["cpu_ms_per_token"] / a["cpu_ms_per_token"],
        }
        print(
            f"T={t}: {method} / mlx-lm {method}: tokens/s {ratios[method]['tokens_per_s']:.3f}x, "
            f"CPU per token {ratios[method]['cpu_per_token']:.3f}x"
        )
    from servers import write_result

    out = write_result(
        "pair",
        {
            "draft": draft_folder.name,
            "package": str(Path(mlx_speculate.__file__).parent),
            "folders": {"target": str(folder), "draft": str(draft_folder)},
            "num_draft_tokens": K,
            "temperature": t,
            "max_tokens": args.max_tokens,
            "warmup_tokens": min(args.max_tokens, WARMUP_TOKENS),
            "prompt": args.prompt,
            "prompt_tokens": len(prompt),
            "runs": args.runs,
            "medians": medians,
            "ratios": ratios,
            "rounds": rounds,
        },
        command="python " + shlex.join(sys.argv),
        blas=blas,
        load_start=load_start,
        versions=versions,
        model=folder,
        out=args.out,
    )
    print(f"wrote {out}")
    if args.profile:
        for method in METHODS:
            _profile(method, runs[method], args.max_tokens)


def _pair(method: str, flip: bool) -> list[str]:
    names = [method, f"mlx-lm {method}"]
    return names[::-1] if flip else names


def _timed(stream) -> dict:
    """Times a stream after its first response; its tokens and how many came from the draft."""
    first = next(stream)  # the prompt's forward is not timed
    wall, cpu, main_cpu = time.perf_counter(), time.process_time(), time.thread_time()
    rest = list(stream)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    main_cpu = time.thread_time() - main_cpu
    timed = len(rest)
    if timed == 0:
        raise SystemExit("a run emitted a single token: nothing to time (raise --max-tokens)")
    responses = [first, *rest]
    return {
        "tokens_per_s": timed / wall,
        "cpu_ms_per_token": 1e3 * cpu / timed,
        "main_cpu_ms_per_token": 1e3 * main_cpu / timed,
        "wall_s": wall,
        "emitted": len(responses),
        "accepted": sum(bool(r.from_draft) for r in responses),
        "tokens": [int(r.token) for r in responses],
    }


def _check(record: dict, temperature: float, round_: int) -> None:
    """Every run of a round emitted as many tokens; greedy, every run emitted ours' plain
    tokens. Stops the benchmark otherwise (a timing of different work means nothing)."""
    counts = {name: r["emitted"] for name, r in record.items()}
    if len(set(counts.values())) != 1:
        raise SystemExit(f"round {round_}: token counts differ: {counts}")
    if temperature == 0:
        reference = record["plain"]["tokens"]
        for name, r in record.items():
            if r["tokens"] != reference:
                pairs = enumerate(zip(r["tokens"], reference, strict=True))
                at = next(i for i, (a, b) in pairs if a != b)
                raise SystemExit(f"round {round_}: {name} differs from plain at token {at}")
    if round_:
        for r in record.values():
            del r["tokens"]


def _profile(method: str, run, max_tokens: int) -> None:
    import cProfile
    import pstats

    stream = run(max_tokens)
    next(stream)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in stream:
        pass
    profiler.disable()
    print(f"\n# cProfile, ours {method}, {max_tokens} tokens: by own time")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    print(f"# cProfile, ours {method}: by cumulative time")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
