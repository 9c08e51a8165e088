"""The server: mlx_speculate.server vs mlx_lm.server on the same model and requests, in one run.

    python benchmarks/bench_server.py [--openblas] [--setups stories,smollm2] [--runs 3]

A multi-turn conversation over HTTP (streamed, temperature 0): each turn's prompt is the last
one plus its answer plus a new user line, so a server with a prompt cache prefills only the
new part. Per server and method: time to first token of turn 1 (cold) and of the later turns
(cached prefix), and tokens/s while decoding, medians over runs; each (run, row) gets its own
conversation, so no turn 1 finds another's cache. Rows run in turn within a run, one request
at a time, every server on 127.0.0.1.

Setups:
  stories   stories260K + llama2xs281K draft (tests/data). Ours serves plain decoding, prompt
            lookup and the draft model from one process (the `speculative` request field);
            mlx_lm.server runs plain and with --draft-model (it has no prompt lookup).
  smollm2   SmolLM2-135M-Instruct (f32, converted from the cached GGUF) through the chat
            endpoint and its ChatML template: plain and prompt lookup vs mlx_lm plain. Slow on
            a CPU without OpenBLAS.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import CACHE, MODELS, add_blas_argument, median  # noqa: E402
from servers import Server, ours, server_env, started, theirs  # noqa: E402

from mlx_speculate.default_model import gguf_path  # noqa: E402

SMOLLM2_GGUF = gguf_path()  # where the package's own fetch keeps it

STORY = (
    "Lily and Tom went to the park. They saw a big dog with a red ball. The dog wanted to play "
    "with Lily and Tom. Lily threw the ball and the dog ran after it."
)
STORY_TURNS = ["Then Tom said", "The dog was happy and", "At the end of the day, Lily", "Mom said"]
CHAT_SYSTEM = "You are a careful editor. Answer with the corrected text only."
CHAT_TURNS = [
    "Fix the typos: The quick brown fox jumpd over the lazy dog, and the dog barkd at the fox.",
    "Now fix this one: The fox ran into the forrest, where it met an owl who said it was late.",
    "And this: The fox went home and slept untill the morning sun woke it up again.",
    "Last one: The owl flew over the forrest and saw the fox sleeping under a tree.",
]


def request(server: Server, body: dict, chat: bool) -> dict:
    """One streamed request: its text, time to first token, decode tokens/s, usage."""
    body = {
        **body,
        "model": server.model,
        "stream": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    path = "chat/completions" if chat else "completions"
    start = time.perf_counter()
    first = last = None
    text, usage = [], None
    with httpx.stream("POST", f"{server.url}/{path}", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if not chunk.get("choices"):
                continue
            choice = chunk["choices"][0]
            piece = choice["delta"].get("content") if chat else choice.get("text")
            if piece:
                now = time.perf_counter()
                first = first or now
                last = now
                text.append(piece)
    tokens = usage["completion_tokens"]
    return {
        "text": "".join(text),
        "ttft": first - start,
        "tps": (tokens - 1) / (last - first) if tokens > 1 and last > first else float("nan"),
        "usage": usage,
    }


def conversation(
    server: Server, row: dict, marker: str, answers: list[str] | None, chat: bool, max_tokens: int
) -> list[dict]:
    """The turns of one conversation; `answers` replays fixed assistant turns (same requests
    for every row), else the server's own answers build it."""
    results = []
    if chat:
        messages = [{"role": "system", "content": f"{marker} {CHAT_SYSTEM}"}]
        turns = CHAT_TURNS
    else:
        prompt, turns = f"{marker} {STORY}", STORY_TURNS
    for i, turn in enumerate(turns):
        body = {"max_tokens": max_tokens, **row.get("extra", {})}
        if chat:
            messages.append({"role": "user", "content": turn})
            body["messages"] = messages
        else:
            prompt = f"{prompt}\n{turn}"
            body["prompt"] = prompt
        result = request(server, body, chat)
        answer = result["text"] if answers is None else answers[i]
        if chat:
            messages.append({"role": "assistant", "content": answer})
        else:
            prompt += answer
        results.append(result)
    return results


def run_setup(
    title: str,
    servers: dict[str, Server],
    rows: list[dict],
    chat: bool,
    runs: int,
    max_tokens: int,
) -> None:
    """Rows of one `group` send the same requests (their own conversation each run, replaying
    the warm-up's answers), so their greedy answers must agree; a group holds one row per
    server and method, so that no row finds another's conversation in a prompt cache."""
    warm = conversation(servers[rows[0]["server"]], rows[0], "Story 0.", None, chat, max_tokens)
    answers = [r["text"] for r in warm]
    results: dict[str, list[list[dict]]] = {row["name"]: [] for row in rows}
    for run in range(1, runs + 1):
        for row in rows:
            marker = f"Story {run}{row['group']}."
            turns = conversation(servers[row["server"]], row, marker, answers, chat, max_tokens)
            results[row["name"]].append(turns)
    print(f"\n## {title}: {len(answers)} turns, {max_tokens} tokens each, {runs} runs")
    print(
        f"{'server / method':<30} {'TTFT t1 ms':>11} {'TTFT t2+ ms':>12} {'tok/s':>7} "
        f"{'tok/fwd':>8} {'cached t2+':>10}"
    )
    for name, conversations in results.items():
        first = [c[0]["ttft"] * 1e3 for c in conversations]
        later = [t["ttft"] * 1e3 for c in conversations for t in c[1:]]
        tps = [t["tps"] for c in conversations for t in c]
        speculative = [t["usage"].get("speculative") for c in conversations for t in c]
        per_forward = [s["tokens_per_target_forward"] for s in speculative if s]
        cached = [
            (t["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            for c in conversations
            for t in c[1:]
        ]
        forward = f"{median(per_forward):>8.2f}" if per_forward else f"{'-':>8}"
        print(
            f"{name:<30} {median(first):>11.1f} {median(later):>12.1f} {median(tps):>7.1f} "
            f"{forward} {median(cached):>10.0f}"
        )
    for group in sorted({row["group"] for row in rows}):
        names = [row["name"] for row in rows if row["group"] == group]
        texts = {name: [t["text"] for c in results[name] for t in c] for name in names}
        for name in names[1:]:
            same = sum(a == b for a, b in zip(texts[names[0]], texts[name], strict=True))
            print(f"answers equal to {names[0]}'s: {name}: {same}/{len(texts[name])}")


def bench_stories(env: dict[str, str], runs: int, max_tokens: int) -> None:
    target = MODELS / "stories260K-llama"
    draft = MODELS / "llama2xs281K-llama"
    commands = {
        "ours": (ours(target, "--draft-model", str(draft)), target.name),
        "mlx_lm": (theirs(target), str(target)),
        "mlx_lm draft": (
            theirs(target, "--draft-model", str(draft), "--num-draft-tokens", "3"),
            str(target),
        ),
    }

    def method(name: str, **speculative) -> dict:
        return {"extra": {"speculative": {"method": name, **speculative}}}

    rows = [
        {"name": "mlx_speculate plain", "server": "ours", "group": "a", **method("none")},
        {"name": "mlx_lm.server plain", "server": "mlx_lm", "group": "a"},
        {
            "name": "mlx_speculate prompt lookup",
            "server": "ours",
            "group": "a",
            **method("prompt_lookup"),
        },
        {
            "name": "mlx_speculate draft adaptive",
            "server": "ours",
            "group": "b",
            **method("draft_model"),
        },
        {
            "name": "mlx_speculate draft k=3",
            "server": "ours",
            "group": "a",
            **method("draft_model", num_draft_tokens=3),
        },
        {"name": "mlx_lm.server draft k=3", "server": "mlx_lm draft", "group": "a"},
    ]
    with started(env, **commands) as servers:
        title = "stories260K (+ llama2xs281K draft), /v1/completions"
        run_setup(title, servers, rows, False, runs, max_tokens)


def bench_smollm2(env: dict[str, str], runs: int, max_tokens: int) -> None:
    folder = CACHE / "smollm2-f32-mlx"
    if not folder.exists():
        if not SMOLLM2_GGUF.exists():
            raise SystemExit(f"{SMOLLM2_GGUF} missing: run benchmarks/fetch_smollm2.sh")
        from mlx_speculate.convert import convert

        convert(SMOLLM2_GGUF, folder, dtype="float32")
    commands = {
        "ours": (ours(folder, "--prompt-lookup"), folder.name),
        "mlx_lm": (theirs(folder), str(folder)),
    }
    rows = [
        {
            "name": "mlx_speculate plain",
            "server": "ours",
            "group": "a",
            "extra": {"speculative": {"method": "none"}},
        },
        {"name": "mlx_lm.server plain", "server": "mlx_lm", "group": "a"},
        {"name": "mlx_speculate prompt lookup", "server": "ours", "group": "a"},
    ]
    with started(env, **commands) as servers:
        title = "SmolLM2-135M-Instruct f32, /v1/chat/completions"
        run_setup(title, servers, rows, True, runs, max_tokens)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setups", default="stories")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    add_blas_argument(parser)
    args = parser.parse_args(argv)
    env = server_env()
    blas = "MLX wheel default"
    if args.openblas:
        env["LD_PRELOAD"] = args.openblas
        blas = f"OpenBLAS ({args.openblas}) in both servers"
    import mlx.core as mx
    import mlx_lm

    print("# server: mlx_speculate.server vs mlx_lm.server (same model and requests, one run)")
    print(
        f"device: {mx.default_device()}, BLAS: {blas}, mlx {mx.__version__}, "
        f"mlx_lm {mlx_lm.__version__}"
    )
    for setup in args.setups.split(","):
        if setup == "stories":
            bench_stories(env, args.runs, args.max_tokens)
        elif setup == "smollm2":
            bench_smollm2(env, args.runs, args.max_tokens)
        else:
            raise SystemExit(f"unknown setup {setup!r} (stories, smollm2)")


if __name__ == "__main__":
    main()
