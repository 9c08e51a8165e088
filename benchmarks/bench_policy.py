"""The adaptive policy against plain decoding and the fixed settings, on SmolLM2-135M-Instruct
(float32), interleaved in one run: issue 15's "never slower than plain" goals.

    python benchmarks/bench_policy.py [--openblas] [--runs 3] [--max-tokens 64]
        [--cases useless,same,eagle,lookup] [--prompts edit,rewrite,summary,open]

  useless  a same-size draft model with random weights (accepts nothing)
  same     the target's own 4-bit copy as the draft (costs as much as the target)
  eagle    the EAGLE-1 heads of ../shared/eagle: adaptive against fixed tree sizes
  lookup   prompt lookup on edit, rewrite, summary and open prompts: adaptive against fixed
           k, trees of 3 matches (the default) and chains

Tokens/s are medians over interleaved rounds (the first round warms up and is dropped; the
adaptive policy's calibration is done once before), tau is tokens per verify forward.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import CACHE, SHARED, add_blas_argument, header, median, setup_blas  # noqa: E402

PROMPTS = {
    "edit": "Fix the typos in this text and return it unchanged otherwise:\n\n"
    "The quick brown fox jumpd over the lazy dog. The dog was not amused, and it barkd at the "
    "fox. The fox ran into the forest, where it met an owl. The owl said: it is late, little "
    "fox, go home. The fox went home and slept until the morning sun woke it up again.",
    "rewrite": "Add type hints to this Python function and return the whole function:\n\n"
    "def merge(left, right):\n    result = []\n    i = j = 0\n"
    "    while i < len(left) and j < len(right):\n        if left[i] <= right[j]:\n"
    "            result.append(left[i])\n            i += 1\n        else:\n"
    "            result.append(right[j])\n            j += 1\n"
    "    result.extend(left[i:])\n    result.extend(right[j:])\n    return result\n",
    "summary": "Summarise this paragraph in two sentences, reusing its wording:\n\n"
    "The library opened a new reading room on the second floor. The reading room has forty "
    "desks, each with a lamp and a power socket. The reading room is open from eight in the "
    "morning until ten at night, and the reading room is quiet: phones must be silent.",
    "open": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def timed(model, tokenizer, prompt, max_tokens, **kwargs) -> tuple[float, float]:
    from mlx_speculate import stream_generate

    start = time.perf_counter()
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs))
    seconds = time.perf_counter() - start
    n, stats = len(responses), responses[-1].stats
    tau = stats.generated / stats.target_forwards if stats and stats.target_forwards else 1.0
    return n / seconds, tau


def interleave(title: str, rows: dict, runs: int) -> None:
    results = {name: [] for name in rows}
    for _ in range(runs + 1):
        for name, run in rows.items():
            results[name].append(run())
    print(f"\n## {title}")
    print(f"{'method':<26} {'tok/s':>8} {'tau':>6} {'vs plain':>9}")
    plain = None
    for name, values in results.items():
        tps, tau = median([v[0] for v in values[1:]]), median([v[1] for v in values[1:]])
        plain = plain or tps
        print(f"{name:<26} {tps:>8.2f} {tau:>6.2f} {tps / plain:>8.2f}x", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="useless,same,eagle,lookup")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", default="edit,rewrite,summary,open", help="lookup's")
    add_blas_argument(parser)
    args = parser.parse_args(argv)
    blas = setup_blas(args.openblas)
    header("Adaptive policy vs plain and fixed settings, SmolLM2-135M f32 (under load)", blas)

    from common import random_model

    from mlx_speculate import load
    from mlx_speculate.chat import apply_chat_template
    from mlx_speculate.drafters import (
        DraftModelSpec,
        EagleGrowth,
        EagleSpec,
        LookupSpec,
        make_drafter,
    )
    from mlx_speculate.policy.adaptive import FixedPolicy
    from mlx_speculate.policy.measure import default_policy

    folder = CACHE / "smollm2-f32-mlx"
    model, tokenizer = load(folder)
    n = args.max_tokens

    def run(prompt, spec=None, k=None):
        """A closure timing one generation; the adaptive policy is built (calibrated) now. Each
        run gets a fresh drafter, as `stream_generate(..., eagle="folder")` does: over the same
        loaded head (memo.py), whose step prices it shares."""
        drafter = None if spec is None else make_drafter(spec, model, tokenizer)
        if drafter is not None and k is None:
            default_policy(drafter, model)  # calibrates once; fresh drafters per run below

        def go():
            fresh = None if spec is None else make_drafter(spec, model, tokenizer)
            policy = None if fresh is None else (
                FixedPolicy(k) if k is not None else default_policy(fresh, model)
            )
            return timed(model, tokenizer, prompt, n, drafter=fresh, policy=policy)

        return go

    chat = {name: apply_chat_template(tokenizer, text) for name, text in PROMPTS.items()}
    for case in args.cases.split(","):
        if case == "useless":
            config = json.loads((folder / "config.json").read_text())
            draft = random_model(config)
            spec = DraftModelSpec(model=draft, tokenizer=tokenizer)
            rows = {"plain": run(chat["open"]), "random draft adaptive": run(chat["open"], spec)}
            rows["random draft k=2"] = run(chat["open"], spec, 2)
            interleave("useless draft (random weights, same size)", rows, args.runs)
        elif case == "same":
            draft, _ = load(CACHE / "SmolLM2-135M-Instruct-Q4_1-mlx-v1")
            spec = DraftModelSpec(model=draft, tokenizer=tokenizer)
            rows = {"plain": run(chat["open"]), "4-bit copy adaptive": run(chat["open"], spec)}
            rows["4-bit copy k=3"] = run(chat["open"], spec, 3)
            interleave("same-cost draft (the target's 4-bit copy)", rows, args.runs)
        elif case == "eagle":
            heads = SHARED / "eagle" / "smollm2-eagle1"
            tree = EagleSpec(heads=heads, tree=EagleGrowth())
            rows = {"plain": run(chat["open"]), "eagle adaptive": run(chat["open"], tree)}
            for k in (2, 4):
                rows[f"eagle chain {k}"] = run(chat["open"], EagleSpec(
                    heads=heads, tree=EagleGrowth.chain(k)), k)
            for shape in ((8, 3, 2), (16, 4, 4), (60, 7, 10)):
                spec = EagleSpec(heads=heads, tree=EagleGrowth(*shape))
                rows["eagle tree {}/{}/{}".format(*shape)] = run(chat["open"], spec, shape[0] - 1)
            interleave("EAGLE-1 heads, open text (tree size)", rows, args.runs)
        elif case == "lookup":
            chains, trees = LookupSpec(branches=1), LookupSpec()  # trees: the default
            for name in args.prompts.split(","):
                rows = {"plain": run(chat[name]), "lookup tree adaptive": run(chat[name], trees)}
                rows["lookup chain adaptive"] = run(chat[name], chains)
                for k in (4, 8, 16):  # 16: an edit prompt's best chain can be long
                    rows[f"lookup chain k={k}"] = run(chat[name], chains, k)
                for k in (8, 16):
                    rows[f"lookup tree k={k}"] = run(chat[name], trees, k)
                interleave(f"prompt lookup, {name} prompt", rows, args.runs)
        else:
            raise SystemExit(f"unknown case {case!r}")


if __name__ == "__main__":
    main()
