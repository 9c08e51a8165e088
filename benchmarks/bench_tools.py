"""A tool loop through the server: 10 turns, the whole conversation re-sent each turn.

    python benchmarks/bench_tools.py [--openblas] [--turns 10] [--runs 2] [--max-tokens 48]

An agent asks SmolLM2-135M-Instruct (the default model's GGUF, converted to float32 as
bench_server.py does: the 4-bit form prefills slowly on the CPU) to find a bug with two tools
(read_file, search); each turn the history holds every earlier call and its result (a
~100-token file excerpt), as a coding agent re-sends it. The history is fixed (the same
requests in every row; the model's answer is timed, then the scripted call is appended), so
rows are comparable:
  cache   prefix cache on: a turn prefills only the last call and result
  nocache the system prompt starts with a new nonce each turn, so nothing is reused
per method (plain decoding, prompt lookup). Time to first token comes from the server's own
histogram (queueing to first token, read from /metrics around each request); decode tokens/s
is (completion tokens - 1) / (request time - TTFT). The model's chat template has no tools, so
the server runs with --chat-template tests/templates/hermes.jinja (a Qwen2.5-style template).
Rows run in turn within a run, one request at a time; medians over runs.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_server import started  # noqa: E402
from common import CACHE, add_blas_argument, median  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "tests" / "templates" / "hermes.jinja"
SYSTEM = "You are a coding agent. Use the tools to inspect the repository, then fix the bug."
TASK = "The tests fail with a KeyError in the config loader. Find the cause."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Reads a file of the repository",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Searches the repository for a regular expression",
            "parameters": {
                "type": "object",
                "properties": {"pattern": {"type": "string"}},
                "required": ["pattern"],
            },
        },
    },
]


def excerpt(turn: int) -> str:
    """A tool result: ~100 tokens of code that mention what the next call reads."""
    lines = [f"# src/config_{turn}.py"]
    for i in range(4):
        lines.append(f"def load_{turn}_{i}(settings):")
        lines.append(f"    return settings['section_{i}'].get('key_{turn}', None)")
    lines.append(f"# see src/config_{turn + 1}.py for the loader")
    return "\n".join(lines)


def history(turns: int) -> list[dict]:
    """The fixed calls and results after the task, turn by turn."""
    messages = []
    for turn in range(turns):
        name, arguments = (
            ("read_file", f'{{"path": "src/config_{turn}.py"}}')
            if turn % 2 == 0
            else ("search", f'{{"pattern": "key_{turn}"}}')
        )
        call_id = f"call_{turn}"
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": arguments},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": excerpt(turn)})
    return messages


def ttft_sum(url: str) -> tuple[float, float]:
    """The time-to-first-token histogram's sum and count, from /metrics."""
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).text
    found = {}
    for name in ("sum", "count"):
        match = re.search(rf"^mlx_speculate_time_to_first_token_seconds_{name} (\S+)$", text, re.M)
        found[name] = float(match.group(1)) if match else 0.0
    return found["sum"], found["count"]


def one_turn(server, messages: list[dict], method: str, max_tokens: int) -> dict:
    before, count = ttft_sum(server.url)
    body = {
        "model": server.model,
        "messages": messages,
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": max_tokens,
        "speculative": {"method": method},
    }
    start = time.perf_counter()
    response = httpx.post(f"{server.url}/chat/completions", json=body, timeout=600)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    after, count_after = ttft_sum(server.url)
    assert count_after == count + 1, "another request ran meanwhile"
    usage = response.json()["usage"]
    ttft = after - before
    tokens = usage["completion_tokens"]
    return {
        "ttft": ttft,
        "tps": (tokens - 1) / (elapsed - ttft) if tokens > 1 else float("nan"),
        "prompt": usage["prompt_tokens"],
        "cached": usage["prompt_tokens_details"]["cached_tokens"],
        "tpf": usage["speculative"]["tokens_per_target_forward"],
        "message": response.json()["choices"][0]["message"],
    }


def loop(server, turns: int, method: str, cache: bool, max_tokens: int, run: int) -> list[dict]:
    steps = history(turns)
    results = []
    for turn in range(turns):
        nonce = uuid.uuid4().hex[:8] if not cache else f"run {run}"
        messages = [
            {"role": "system", "content": f"[{nonce}] {SYSTEM}"},
            {"role": "user", "content": TASK},
            *steps[: 2 * turn],
        ]
        result = one_turn(server, messages, method, max_tokens)
        results.append(result)
        print(
            f"{method} cache={cache} turn {turn + 1}: prompt {result['prompt']}, cached "
            f"{result['cached']}, TTFT {result['ttft'] * 1e3:.0f} ms, {result['tps']:.1f} tok/s",
            file=sys.stderr,
            flush=True,
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--rows",
        default="none/cache,prompt_lookup/cache,none/nocache,prompt_lookup/nocache",
        help="method/cache pairs to run, in this order",
    )
    add_blas_argument(parser)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    blas = "the MLX wheel's"
    if args.openblas:
        env["LD_PRELOAD"] = args.openblas
        blas = f"OpenBLAS ({args.openblas})"
    command = [sys.executable, "-m", "mlx_speculate.server", "--chat-template", str(TEMPLATE)]
    from mlx_speculate.default_model import gguf_path

    model = CACHE / "smollm2-f32-mlx"
    if not model.exists():
        if not gguf_path().exists():
            raise SystemExit(f"{gguf_path()} missing: run benchmarks/fetch_smollm2.sh")
        from mlx_speculate.convert import convert

        convert(gguf_path(), model, dtype="float32")
    command += ["--model", str(model), "--prompt-cache-size", "4"]
    rows = [(m, c == "cache") for m, c in (r.split("/") for r in args.rows.split(","))]
    results: dict[tuple[str, bool], list[list[dict]]] = {row: [] for row in rows}
    with started(env, ours=(command, model.name)) as servers:
        server = servers["ours"]
        loop(server, 2, "none", True, 8, 0)  # warm-up: code paths, allocator
        for run in range(1, args.runs + 1):
            for method, cache in rows:
                results[(method, cache)].append(
                    loop(server, args.turns, method, cache, args.max_tokens, run)
                )
    print(f"\n## Tool loop on {model.name}: {args.turns} turns, {args.runs} runs (blas: {blas})")
    print("TTFT ms per turn (median over runs), prompt tokens, cached tokens (cache rows)")
    header = f"{'turn':>4} {'prompt':>7}" + "".join(
        f" {m.removeprefix('prompt_') + ('/cache' if c else '/nocache'):>17}" for m, c in rows
    )
    print(header)
    for turn in range(args.turns):
        cells = []
        for row in rows:
            ttft = median([r[turn]["ttft"] * 1e3 for r in results[row]])
            cached = results[row][0][turn]["cached"]
            cells.append(f" {ttft:>9.0f} ({cached:>4})")
        print(f"{turn + 1:>4} {results[rows[0]][0][turn]['prompt']:>7}" + "".join(cells))
    print(f"\n{'row':<24} {'TTFT t1 ms':>11} {'TTFT t2+ ms':>12} {'tok/s':>7} {'tok/fwd':>8}")
    for row in rows:
        first = median([r[0]["ttft"] * 1e3 for r in results[row]])
        later = median([t["ttft"] * 1e3 for r in results[row] for t in r[1:]])
        tps = median([t["tps"] for r in results[row] for t in r])
        tpf = median([t["tpf"] for r in results[row] for t in r])
        name = f"{row[0]} / {'cache' if row[1] else 'nocache'}"
        print(f"{name:<24} {first:>11.0f} {later:>12.0f} {tps:>7.1f} {tpf:>8.2f}")


if __name__ == "__main__":
    main()
