"""A model's first request in a fresh process, ours against mlx-lm's: seconds to the first token
and to the last of `stream_generate` right after `load`, and the whole process's seconds (import,
load, the request and exit: a first process on a machine finishes its kernel builds before it
exits, graphs.py), each run in its own Python process, the two libraries alternating, with
MLX's kernel disk cache as it is (warm, after any earlier run on the machine) or cold
(`--cold`: each process gets an empty TMPDIR, as the first run after installing MLX does).
`--eagle HEAD`: a method first used in a later process instead, ours alone: in each run a
process decodes a chat plainly, then the timed one decodes it with that EAGLE head on the same
kernel cache (with `--cold`, one empty TMPDIR for the two).

    python benchmarks/bench_first_request.py [--openblas] [--model FOLDER] [--cold]
        [--runs 3] [--max-tokens 32] [--eagle HEAD]

The model defaults to SmolLM2-135M in float32 (an MLX folder both load). Every run must emit
exactly --max-tokens tokens, else the script stops. Prints each run and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_blas_argument, smollm2_f32  # noqa: E402

PROMPT = "Once upon a time, in a small village"
CHAT = [{"role": "user", "content": "Write a long story about a robot who learns to paint."}]
RUN = """
import json, sys, time
from {library} import load, stream_generate
model, tokenizer = load(sys.argv[1])
prompt = {prompt}
method = {{"eagle": sys.argv[3]}} if len(sys.argv) > 3 else {{}}
start, first, count = time.perf_counter(), None, 0
for _ in stream_generate(model, tokenizer, prompt, max_tokens=int(sys.argv[2]), **method):
    count += 1
    first = time.perf_counter() - start if first is None else first
print(json.dumps({{"first": first, "whole": time.perf_counter() - start, "tokens": count}}))
"""
LIBRARIES = {"mlx_speculate": "mlx_speculate", "mlx-lm": "mlx_lm"}


def run(
    library: str,
    folder: Path,
    max_tokens: int,
    env: dict[str, str],
    eagle: Path | None = None,
    chat: bool = False,
) -> dict:
    """One fresh process's first request: its seconds to the first token and to the last
    (`chat`: a chat prompt, through our template)."""
    prompt = f"tokenizer.encode({PROMPT!r})"
    if chat:  # what the head was trained on, so that its drafts are taken
        prompt = f"__import__('mlx_speculate.chat').chat.apply_chat_template(tokenizer, {CHAT!r})"
    code = RUN.format(library=library, prompt=prompt)
    began = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", code, str(folder), str(max_tokens)]
        + ([] if eagle is None else [str(eagle)]),
        capture_output=True,
        text=True,
        env=env,
    )
    if out.returncode != 0:
        raise SystemExit(f"{library}: {out.stderr.strip().splitlines()[-1]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process"] = time.perf_counter() - began
    if result["tokens"] != max_tokens:
        raise SystemExit(f"{library}: {result['tokens']} tokens, not {max_tokens}")
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--cold", action="store_true", help="an empty TMPDIR for each process")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--eagle",
        type=Path,
        default=None,
        help="time ours with this EAGLE head, after a plain process",
    )
    add_blas_argument(parser)
    args = parser.parse_args(argv)
    folder = args.model or smollm2_f32()
    env = dict(os.environ)
    if args.openblas:  # both libraries' processes, preloaded (mlx-lm loads none itself)
        env["LD_PRELOAD"] = args.openblas
    libraries = {"mlx_speculate (EAGLE)": "mlx_speculate"} if args.eagle else LIBRARIES
    times: dict[str, list[dict]] = {name: [] for name in libraries}
    for r in range(args.runs):
        order = list(libraries.items())
        for name, library in order if r % 2 == 0 else order[::-1]:
            with tempfile.TemporaryDirectory() as cold:
                if args.cold:
                    env["TMPDIR"] = cold
                chat = args.eagle is not None
                if chat:  # the same chat decoded plainly first, as an earlier use would
                    run(library, folder, args.max_tokens, env, chat=True)
                result = run(library, folder, args.max_tokens, env, args.eagle, chat)
            times[name].append(result)
            print(
                f"run {r + 1}: {name:<14} first token {result['first']:.2f} s, "
                f"whole {result['whole']:.2f} s, process {result['process']:.2f} s",
                flush=True,
            )
    cache = "cold" if args.cold else "as it is"
    after = ", after a plain process" if args.eagle else ""
    print(f"# {folder.name}, {args.max_tokens} tokens, kernel cache {cache}{after}, medians:")
    for name, results in times.items():
        first = statistics.median(t["first"] for t in results)
        whole = statistics.median(t["whole"] for t in results)
        process = statistics.median(t["process"] for t in results)
        print(
            f"  {name:<14} first token {first:.2f} s, whole request {whole:.2f} s, "
            f"process {process:.2f} s"
        )


if __name__ == "__main__":
    main()
