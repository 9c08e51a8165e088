"""The target split over ranks on one machine (`mlx.launch`, ring backend on loopback) against
one process: time per token (plain and with a drafter), the all-reduce share of a target
step, and memory per rank. On one machine two ranks are slower (they share its cores and add
collectives); the point of splitting is memory per rank, and the all-reduce share is what a
network link multiplies.

    python benchmarks/bench_dist.py [--model stories|smollm2] [--mode single|tensor|pipeline]
        [--openblas] [--runs 3]

Per configuration (1 rank; 2 ranks tensor parallel; 2 ranks pipeline):
- ms/token, median of `--runs` greedy generations (prefill excluded), plain and with the
  drafter (stories: the llama2xs281K draft model; SmolLM2: prompt lookup), k = 4 fixed;
- the target's one-token step, timed with its all-sums and again with all-sum replaced by
  the identity (same compute, no communication): the difference is the collectives' share;
- one all-sum of a (1, 1, hidden) float32 vector, as a step of the tensor mode has 2 per layer;
- weights MB held by rank 0 and its peak memory after loading and after decoding.
SmolLM2 has 9 attention heads: tensor parallel over 2 ranks is refused (it needs whole heads
per rank), so it runs pipeline only.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import CACHE, MODELS, add_blas_argument, header, median, setup_blas  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
K = 4
MODELS = {
    "stories": {
        "target": MODELS / "stories260K-llama",
        "draft": MODELS / "llama2xs281K-llama",
        "prompt": "Once upon a time, there was a little girl named Lily. She",
        "tokens": 128,
        "steps": 50,
        "modes": ("single", "tensor", "pipeline"),
    },
    "smollm2": {
        "target": CACHE / "smollm2-f32-mlx",
        "draft": None,  # prompt lookup
        "prompt": "Repeat this list twice: apples, pears, plums, figs, dates, limes, kiwis.",
        "tokens": 16,  # f32 SmolLM2 on 2 shared cores: ~0.3 s a token at load 16
        "steps": 5,
        "modes": ("single", "pipeline"),
    },
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODELS), action="append")
    parser.add_argument("--mode", choices=["single", "tensor", "pipeline"], action="append")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    add_blas_argument(parser)
    args = parser.parse_args(argv)
    blas = setup_blas(args.openblas)
    if args.worker:
        return worker(*args.worker, args.runs)
    header("1 rank vs 2 ranks on loopback (ring backend)", blas)
    print(f"load average: {open('/proc/loadavg').read().split()[:3]}")
    print("| model | mode | ranks | plain ms/tok | drafter ms/tok | tok/forward | step ms "
          "| step ms, no all-sum | all-sum share | one all-sum us | weights MB/rank | "
          "peak MB/rank |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.model or list(MODELS):
        for mode in [m for m in MODELS[name]["modes"] if m in (args.mode or [m])]:
            r = launch(name, mode, args.runs, args.openblas)
            alone = r["ranks"] == 1
            share = "-" if alone else f"{r['share']:.0%}"
            one = "-" if alone else f"{r['all_sum_us']:.0f}"
            print(
                f"| {name} | {mode} | {r['ranks']} | {r['plain']:.2f} | {r['drafter']:.2f} | "
                f"{r['per_forward']:.2f} | {r['step']:.2f} | {r['step_alone']:.2f} | "
                f"{share} | {one} | {r['weights_mb']:.1f} | {r['peak_mb']:.1f} |",
                flush=True,
            )
    print(f"load average after: {open('/proc/loadavg').read().split()[:3]}")


def launch(name: str, mode: str, runs: int, openblas: str | None) -> dict:
    """Runs `worker` alone or under mlx.launch over 2 ranks; rank 0's result."""
    command = [__file__, "--worker", name, mode, "--runs", str(runs)]
    if openblas:
        command += ["--openblas", openblas]
    if mode != "single":
        command = [
            str(Path(sys.executable).with_name("mlx.launch")), "--backend", "ring", "-n", "2",
            "--hosts", "127.0.0.1", "--starting-port", str(free_port()), "--cwd", str(ROOT),
            "--python", sys.executable, *command,
        ]  # fmt: skip
    else:
        command = [sys.executable, *command]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    raise SystemExit(f"{name} {mode} gave no result: {done.stderr[-2000:]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(name: str, mode: str, runs: int) -> None:
    import mlx.core as mx

    from mlx_speculate.drafters import DraftModelSpec, LookupSpec
    from mlx_speculate.generation import stream_generate
    from mlx_speculate.loading import load
    from mlx_speculate.parallel.group import decoding_options, init_group
    from mlx_speculate.parallel.sharding import Split, weight_bytes

    spec_of = MODELS[name]
    group = init_group() if mode != "single" else None
    split = None if group is None else Split(group, mode)
    model, tokenizer = load(spec_of["target"], split=split)
    loaded_peak = mx.get_peak_memory()
    if spec_of["draft"] is None:
        spec = LookupSpec(num_draft_tokens=K)
    else:
        spec = DraftModelSpec(model=spec_of["draft"], num_draft_tokens=K)
    options = {"drafter": spec} if group is None else decoding_options(
        model, tokenizer, spec, group
    )
    prompt = tokenizer.encode(spec_of["prompt"])

    def ms_per_token(**kw) -> tuple[float, float]:
        times, per_forward = [], []
        for _ in range(runs + 1):  # the first run warms up (compiles)
            *_, r = stream_generate(model, tokenizer, prompt, max_tokens=spec_of["tokens"], **kw)
            times.append(1000 / r.generation_tps)
            per_forward.append(r.stats.tokens_per_forward if r.stats else 1.0)
        return median(times[1:]), median(per_forward[1:])

    plain, _ = ms_per_token()
    drafter, per_forward = ms_per_token(**options)
    step, step_alone = step_times(model, prompt, runs, spec_of["steps"])
    result = {
        "ranks": 1 if group is None else group.size(),
        "plain": plain,
        "drafter": drafter,
        "per_forward": per_forward,
        "step": step,
        "step_alone": step_alone,
        "share": 0.0 if group is None else max(0.0, 1 - step_alone / step),
        "all_sum_us": 0.0 if group is None else all_sum_us(model, group),
        "weights_mb": weight_bytes(model) / 1e6,
        "peak_mb": max(loaded_peak, mx.get_peak_memory()) / 1e6,
    }
    if group is None or group.rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def step_times(model, prompt: list[int], runs: int, steps: int) -> tuple[float, float]:
    """ms of one target step (one token in, its logits out) after the prompt, with the
    all-sums and with all-sum as the identity (median of `runs` rounds of `steps`)."""
    import mlx.core as mx

    cache = model.make_cache()
    mx.eval(model(mx.array([prompt]), cache).hidden)
    start = cache.offset
    token = mx.array([[prompt[-1]]])

    def round_ms() -> float:
        begin = time.perf_counter()
        for _ in range(steps):
            cache.truncate(start)
            mx.eval(model.project(model(token, cache).hidden[0, -1:]))
        return 1000 * (time.perf_counter() - begin) / steps

    with_collectives = median([round_ms() for _ in range(runs + 1)][1:])
    real = mx.distributed.all_sum
    mx.distributed.all_sum = lambda x, **_: x  # every rank computes its part alone
    try:
        alone = median([round_ms() for _ in range(runs + 1)][1:])
    finally:
        mx.distributed.all_sum = real
    return with_collectives, alone


def all_sum_us(model, group, count: int = 200) -> float:
    """Microseconds of one all-sum of a (1, 1, hidden) float32 vector, evaluated alone."""
    import mlx.core as mx

    x = mx.ones((1, 1, model.args.hidden_size))
    mx.eval(mx.distributed.all_sum(x, group=group))
    begin = time.perf_counter()
    for _ in range(count):
        mx.eval(mx.distributed.all_sum(x, group=group))
    return 1e6 * (time.perf_counter() - begin) / count


if __name__ == "__main__":
    main()
