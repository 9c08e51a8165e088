"""Medusa heads vs a draft model vs plain decoding on the stories260K target, in one run.

    python benchmarks/bench_medusa.py [--openblas] [--max-tokens 160] [--runs 3]

Heads are trained here by the staged pipeline (`mlx_speculate.train`, medusa) on the target's
own samples: 16 tokens drawn at T=1 after BOS, then greedy (the regime benchmarked). The draft
model is llama2xs281K (a separately trained TinyStories model with the same tokenizer).
Greedy decoding; per method the median over prompts (and runs) of tokens/s and mean tokens per
target forward. A first round warms up and is dropped.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MODELS, add_blas_argument, header, median, setup_blas  # noqa: E402

PROMPTS = (
    "Once upon a time",
    "Lily and Tom went to the park. They",
    "The little dog was sad because",
    "One day, a big bird",
    "Sam had a red ball.",
)


def run(stream_generate, *args, **kwargs) -> tuple[float, float]:
    """tokens/s and tokens per target forward of one generation."""
    start = time.perf_counter()
    responses = list(stream_generate(*args, **kwargs))
    seconds = time.perf_counter() - start
    stats = responses[-1].stats
    return stats.generated / seconds, stats.tokens_per_forward


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--runs", type=int, default=2, help="timed rounds over all prompts")
    parser.add_argument("--heads", type=int, default=4, help="Medusa heads to fit")
    parser.add_argument("--samples", type=int, default=128, help="self samples to train on")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--num-draft-tokens", type=int, default=4, help="draft-model k")
    add_blas_argument(parser)
    args = parser.parse_args(argv)
    blas = setup_blas(args.openblas)
    header("Medusa vs draft model vs plain: stories260K target, greedy", blas)

    import mlx.core as mx

    from mlx_speculate import load, stream_generate
    from mlx_speculate.heads.medusa import MEDUSA_TREES, load_medusa_heads
    from mlx_speculate.train.loop import TrainConfig
    from mlx_speculate.train.recipe import Recipe, train_head

    target, tokenizer = load(MODELS / "stories260K-llama")
    draft, draft_tokenizer = load(MODELS / "llama2xs281K-llama")

    recipe = Recipe("medusa", self_samples=args.samples, max_tokens=128, medusa_heads=args.heads,
                    train=TrainConfig(epochs=args.epochs, learning_rate=1e-2, warmup=10,
                                      batch_tokens=1024))  # fmt: skip
    with tempfile.TemporaryDirectory() as work:
        result = train_head("medusa", target, Path(work) / "heads", recipe=recipe, progress=False)
        heads = load_medusa_heads(result.out, target)
        mx.eval(heads.parameters())  # read before the folder goes
    print(
        f"trained {args.heads} heads in {sum(result.seconds.values()):.1f}s on {args.samples} "
        f"samples (16 tokens at T=1 after BOS, then 128 greedy); held-out top-1 "
        f"{result.held_out_top1:.1%}"
    )

    def medusa(tree: str, k: int | None):
        return dict(medusa=heads, tree=tree, num_draft_tokens=k)

    full = len(MEDUSA_TREES["mc_sim_7b_63"])
    methods = {
        "plain": {},
        f"draft model k={args.num_draft_tokens}": dict(
            draft_model=draft, draft_tokenizer=draft_tokenizer,
            num_draft_tokens=args.num_draft_tokens,
        ),
        "draft model adaptive": dict(draft_model=draft, draft_tokenizer=draft_tokenizer),
        f"medusa {full} nodes": medusa("mc_sim_7b_63", full),
        "medusa 19 nodes": medusa("mc_sim_7b_63", 19),
        "medusa 6 nodes": medusa("mc_sim_7b_63", 6),
        "medusa adaptive": medusa("mc_sim_7b_63", None),
    }  # fmt: skip
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in methods}
    for round_ in range(args.runs + 1):  # round 0 warms up and is dropped
        for prompt in prompts:
            for name, kwargs in methods.items():
                result = run(
                    stream_generate, target, tokenizer, prompt, max_tokens=args.max_tokens, **kwargs
                )
                if round_ > 0:
                    results[name].append(result)

    print(f"\n{len(PROMPTS)} prompts x {args.runs} runs, {args.max_tokens} tokens each; medians")
    print(f"{'method':<24} {'tok/s':>8} {'tok/fwd':>8} {'vs plain':>9}")
    plain = median([r[0] for r in results["plain"]])
    for name, values in results.items():
        tps, per_forward = median([v[0] for v in values]), median([v[1] for v in values])
        print(f"{name:<24} {tps:>8.1f} {per_forward:>8.2f} {tps / plain:>8.2f}x")


if __name__ == "__main__":
    main()
