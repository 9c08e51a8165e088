"""Speculative decoding: mlx_speculate vs mlx_lm's draft_model path, in one run.

    python benchmarks/bench_speculative.py [--openblas] [--pairs stories,self,random05b,lookup]

Pairs:
  stories     stories260K target + llama2xs281K draft (real TinyStories models, tests/data)
  self        stories260K as its own draft: acceptance ~1, measures the loop's own overhead
  random05b   random Qwen2.5-0.5B-shaped float32 target + a small random draft: a useless
              draft, where the adaptive policy should keep plain-decoding speed
  lookup      prompt lookup on a summarise/edit prompt with SmolLM2-135M (no mlx_lm equivalent;
              compared with plain decoding)
Reported per method: tokens/s, mean tokens per target forward, draft acceptance rate
(medians over runs; mlx_lm's counts come from its `from_draft` flags).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    CACHE,
    MODELS,
    QWEN25_05B,
    add_blas_argument,
    header,
    median,
    setup_blas,
    write_random_model,
)

STORY_PROMPT = "Once upon a time, there was a little girl named Lily. She"
EDIT_PROMPT = (
    "Fix the typos in this text and return it unchanged otherwise:\n\n"
    "The quick brown fox jumpd over the lazy dog. The dog was not amused, and it barkd at the "
    "fox. The fox ran into the forest, where it met an owl. The owl said: it is late, little fox, "
    "go home. The fox went home and slept until the morning sun woke it up again."
)
RANDOM_DRAFT = {
    **QWEN25_05B,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def run(generate, *args, **kwargs) -> tuple[float, float, float]:
    """tokens/s, tokens per target forward, acceptance rate of one generation."""
    start = time.perf_counter()
    tokens = forwards = from_draft = 0
    for r in generate(*args, **kwargs):
        tokens += 1
        from_draft += bool(r.from_draft)
        forwards += not r.from_draft
    seconds = time.perf_counter() - start
    k = kwargs.get("num_draft_tokens") or 0
    stats = getattr(r, "stats", None)
    if stats is not None:  # ours reports exact counts
        forwards = stats.target_forwards
        rate = stats.acceptance_rate
    else:
        rate = from_draft / (forwards * k) if forwards and k else 0.0
    return tokens / seconds, tokens / max(forwards, 1), rate


def mlx_lm_sampler(temp: float):
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(temp=temp)


def methods(pair: str, k: int):
    """(label, library, model folder, kwargs) per method of a pair."""
    stories = MODELS / "stories260K-llama"
    if pair in ("stories", "self"):
        draft = stories if pair == "self" else MODELS / "llama2xs281K-llama"
        return stories, draft, STORY_PROMPT
    if pair == "random05b":
        target = write_random_model(CACHE / "qwen05b-random-f32", QWEN25_05B)
        draft = write_random_model(CACHE / "qwen-draft-random-f32", RANDOM_DRAFT, seed=1)
        return target, draft, "Hello"
    raise ValueError(pair)


def bench_pair(pair: str, k: int, runs: int, max_tokens: int) -> None:
    import mlx_lm

    from mlx_speculate import load, stream_generate

    target_path, draft_path, text = methods(pair, k)
    target, tokenizer = load(target_path)
    draft, draft_tokenizer = load(draft_path)
    theirs, their_tok = mlx_lm.load(str(target_path))
    their_draft, _ = mlx_lm.load(str(draft_path))
    prompt = tokenizer.encode(text)
    for temp in (0.0, 1.0):
        rows = {
            "plain (ours)": lambda t=temp: run(
                stream_generate, target, tokenizer, prompt, max_tokens=max_tokens,
                temperature=t, seed=0,
            ),
            "plain (mlx_lm)": lambda t=temp: run(
                mlx_lm.stream_generate, theirs, their_tok, prompt, max_tokens=max_tokens,
                sampler=mlx_lm_sampler(t),
            ),
            f"draft k={k} (ours)": lambda t=temp: run(
                stream_generate, target, tokenizer, prompt, max_tokens=max_tokens,
                temperature=t, seed=0, draft_model=draft, draft_tokenizer=draft_tokenizer,
                num_draft_tokens=k,
            ),
            f"draft k={k} (mlx_lm)": lambda t=temp: run(
                mlx_lm.stream_generate, theirs, their_tok, prompt, max_tokens=max_tokens,
                sampler=mlx_lm_sampler(t), draft_model=their_draft, num_draft_tokens=k,
            ),
            "draft adaptive (ours)": lambda t=temp: run(
                stream_generate, target, tokenizer, prompt, max_tokens=max_tokens,
                temperature=t, seed=0, draft_model=draft, draft_tokenizer=draft_tokenizer,
            ),
        }
        report(f"{pair}, T={temp}", rows, runs)


def bench_lookup(runs: int, max_tokens: int) -> None:
    from mlx_speculate import load, stream_generate
    from mlx_speculate.chat import apply_chat_template
    from mlx_speculate.convert import convert
    from mlx_speculate.default_model import smollm2_gguf

    folder = CACHE / "smollm2-f32-mlx"
    if not folder.exists():
        convert(smollm2_gguf(), folder, dtype="float32")
    model, tokenizer = load(folder)
    prompt = apply_chat_template(tokenizer, EDIT_PROMPT)
    rows = {
        "plain": lambda: run(stream_generate, model, tokenizer, prompt, max_tokens=max_tokens),
        "lookup k=8": lambda: run(
            stream_generate, model, tokenizer, prompt, max_tokens=max_tokens,
            prompt_lookup=True, num_draft_tokens=8,
        ),
        "lookup adaptive": lambda: run(
            stream_generate, model, tokenizer, prompt, max_tokens=max_tokens, prompt_lookup=True
        ),
    }
    report("lookup, SmolLM2-135M f32, edit prompt, T=0", rows, runs)


def report(title: str, rows: dict, runs: int) -> None:
    results = {name: [] for name in rows}
    for _ in range(runs + 1):  # round 0 warms up and is dropped
        for name, fn in rows.items():
            results[name].append(fn())
    print(f"\n## {title}")
    print(f"{'method':<24} {'tok/s':>8} {'tok/fwd':>8} {'accept':>7} {'vs plain':>9}")
    plain = None
    for name, values in results.items():
        tps, per_fwd, rate = (median([v[i] for v in values[1:]]) for i in range(3))
        plain = plain or tps
        print(f"{name:<24} {tps:>8.1f} {per_fwd:>8.2f} {rate:>7.2f} {tps / plain:>8.2f}x")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default="stories,self,random05b,lookup")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    add_blas_argument(parser)
    args = parser.parse_args(argv)
    blas = setup_blas(args.openblas)
    header("speculative decoding: mlx_speculate vs mlx_lm (same weights, same run)", blas)
    for pair in args.pairs.split(","):
        if pair == "lookup":
            bench_lookup(args.runs, args.max_tokens)
        else:
            tokens = 24 if pair == "random05b" else args.max_tokens
            bench_pair(pair, args.num_draft_tokens, args.runs, tokens)


if __name__ == "__main__":
    main()
