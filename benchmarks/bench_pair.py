"""Ours against mlx-lm on stories260K (llama2xs281K draft, k = 4), interleaved in one process:
tokens/s and CPU ms per token (process and main thread), plain and draft model. Under a
shared CPU the process's CPU time per token swings less than its wall time.

    python benchmarks/bench_pair.py [--openblas] [--temperature 0] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MODELS, add_blas_argument, header, setup_blas  # noqa: E402

K = 4


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    add_blas_argument(parser)
    args = parser.parse_args(argv)
    blas = setup_blas(args.openblas)
    header("ours against mlx-lm, interleaved (stories)", blas)

    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from mlx_speculate import load, stream_generate

    folder = MODELS / "stories260K-llama"
    draft_folder = MODELS / "llama2xs281K-llama"
    model, tokenizer = load(folder)
    draft, draft_tokenizer = load(draft_folder)
    theirs, their_tokenizer = mlx_lm.load(str(folder))
    their_draft, _ = mlx_lm.load(str(draft_folder))
    prompt = tokenizer.encode("Once upon a time, there was a little girl named Lily. She")
    t, n = args.temperature, args.max_tokens

    def ours(**kw):
        kw.update(max_tokens=n, temperature=t, seed=0)
        return lambda: stream_generate(model, tokenizer, prompt, **kw)

    def mlx_lm_run(**kw):
        sampler = make_sampler(temp=t)
        return lambda: mlx_lm.stream_generate(
            theirs, their_tokenizer, prompt, max_tokens=n, sampler=sampler, **kw
        )

    runs = {
        "plain": ours(),
        "draft": ours(draft_model=draft, draft_tokenizer=draft_tokenizer, num_draft_tokens=K),
        "mlx-lm plain": mlx_lm_run(),
        "mlx-lm draft": mlx_lm_run(draft_model=their_draft, num_draft_tokens=K),
    }
    results = {name: [] for name in runs}
    for round_ in range(args.runs + 1):  # round 0 warms up (and traces the compiled steps)
        for name, generate in runs.items():
            mx.clear_cache()
            stream = generate()
            next(stream)  # the prompt's forward is not timed
            wall, cpu, main_cpu = time.perf_counter(), time.process_time(), time.thread_time()
            tokens = sum(1 for _ in stream)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            main_cpu = time.thread_time() - main_cpu
            if round_:
                results[name].append((tokens / wall, 1e3 * cpu / tokens, 1e3 * main_cpu / tokens))
    medians = {
        k: [statistics.median(r[i] for r in v) for i in range(3)] for k, v in results.items()
    }
    print(f"{'method':<14} {'tok/s':>8} {'CPU ms/tok':>11} {'main ms/tok':>12}")
    for name, (rate, cpu, main_cpu) in medians.items():
        print(f"{name:<14} {rate:>8.1f} {cpu:>11.3f} {main_cpu:>12.3f}")
    for ours_name in ("plain", "draft"):
        a, b = medians[ours_name], medians[f"mlx-lm {ours_name}"]
        print(
            f"T={t}: {ours_name} / mlx-lm {ours_name}: tokens/s {a[0] / b[0]:.2f}x, "
            f"CPU per token {b[1] / a[1]:.2f}x"
        )


if __name__ == "__main__":
    main()
