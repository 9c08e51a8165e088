"""Concurrent generations in the batch engine against the same generations one after another,
in one process: aggregate tokens/s of `batch_generate` over N prompts (each decoding greedily,
with or without a method) and of `stream_generate` run over them in turn, every answer compared.

    python benchmarks/bench_batch.py [--openblas] [--family qwen3_5] [--size "SmolLM2-sized"]
        [--prompts 8] [--max-tokens 32] [--method none|prompt_lookup|eagle] [--rounds 3]
        [--model FOLDER] [--eagle HEADS]

The model is report.py's families set's random folder of that family and size (family_models.py;
stories260K's tokenizer grown to the vocabulary, no EOS, so every run lasts its token count), or
--model's folder, prompted with story openings (SmolLM2-135M-Instruct with --eagle
../shared/eagle/smollm2-eagle1 for EAGLE rows in the batch).
Rounds alternate which side goes first; the table gives medians over rounds. Every timed run
must emit exactly --max-tokens tokens for every prompt and the batch's answers must equal the
one-at-a-time ones token for token, else the run stops. Writes
benchmarks/results/batch-<family or model>-<method>-<date>-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_blas_argument, describe_versions, header, setup_blas  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# Story openings for --model (a real model's prompts)
STORIES = (
    "Once upon a time, there was a little",
    "The cat sat on the mat and",
    "In a small village by the sea,",
    "Tom wanted to play with his red ball, but",
    "The sun was shining and the birds",
    "Lily found a shiny key in the garden.",
    "Max the dog loved to run",
    "One day, a little girl named Sue",
)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen3_5")
    parser.add_argument("--size", default="SmolLM2-sized")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--method", default="none", choices=["none", "prompt_lookup", "eagle"])
    parser.add_argument("--model", default=None, help="a real model's folder, story prompts")
    parser.add_argument("--eagle", default=None, help="EAGLE heads (--method eagle)")
    parser.add_argument("--rounds", type=int, default=3)
    add_blas_argument(parser)
    args = parser.parse_args(argv)
    blas = setup_blas(args.openblas)

    from family_models import describe, family_config, family_folder

    from mlx_speculate import load, stream_generate
    from mlx_speculate.batch import batch_generate

    if args.method == "eagle" and args.eagle is None:
        parser.error("--method eagle needs --eagle HEADS")
    if args.model is None:
        config = family_config(args.family, args.size)
        model, tokenizer = load(family_folder(config))
        described = f"{args.family} ({args.size}), {describe(config)}"
        prompts = [
            [1] + [(17 * i + 5 * j * j) % 400 + 3 for j in range(24 + 3 * i)]
            for i in range(args.prompts)
        ]
    else:
        model, tokenizer = load(args.model)
        described = args.model
        openings = [
            STORIES[i % len(STORIES)] + " " * (i // len(STORIES)) for i in range(args.prompts)
        ]
        prompts = [tokenizer.encode(t) for t in openings]
    header(f"Batch vs one at a time: {described}", blas)
    options = {
        "none": {},
        "prompt_lookup": {"prompt_lookup": True},
        "eagle": {"eagle": args.eagle},
    }[args.method]
    n = args.max_tokens

    def batched() -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        result = batch_generate(model, tokenizer, prompts, max_tokens=n, **options)
        return time.perf_counter() - start, result.tokens

    def in_turn() -> tuple[float, list[list[int]]]:
        start, out = time.perf_counter(), []
        for prompt in prompts:
            stream = stream_generate(model, tokenizer, prompt, max_tokens=n, **options)
            out.append([r.token for r in stream])
        return time.perf_counter() - start, out

    batched(), in_turn()  # warm-up: graphs traced, calibration cached
    times: dict[str, list[float]] = {"batch": [], "in turn": []}
    for r in range(args.rounds):
        order = [("batch", batched), ("in turn", in_turn)]
        for name, run in order if r % 2 == 0 else order[::-1]:
            seconds, tokens = run()
            if any(len(t) != n for t in tokens):
                sys.exit(f"{name}: a run emitted {[len(t) for t in tokens]} tokens, not {n} each")
            times[name].append(seconds)
            if name == "batch":
                batch_tokens = tokens
            else:
                turn_tokens = tokens
        if batch_tokens != turn_tokens:
            sys.exit("the batch's answers differ from the one-at-a-time ones")
    total = n * len(prompts)
    tps = {k: total / statistics.median(v) for k, v in times.items()}
    ratio = tps["batch"] / tps["in turn"]
    print(f"{len(prompts)} prompts x {n} tokens, method {args.method}, {args.rounds} rounds")
    print(f"  batch    {tps['batch']:8.1f} tok/s")
    print(f"  in turn  {tps['in turn']:8.1f} tok/s")
    print(f"  ratio    {ratio:8.2f}x   answers equal: yes")
    RESULTS.mkdir(exist_ok=True)
    name = args.family if args.model is None else Path(args.model).name
    out = RESULTS / f"batch-{name}-{args.method}-{date.today()}-cpu.json"
    record = {
        "command": "python benchmarks/" + " ".join([Path(__file__).name, *(argv or sys.argv[1:])]),
        "model": described,
        "prompts": len(prompts),
        "max_tokens": n,
        "method": args.method,
        "seconds": times,
        "tokens_per_second": tps,
        "ratio": ratio,
        "blas": blas,
        "versions": describe_versions(),
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
