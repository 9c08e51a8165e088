"""The whole training recipe, then the head at work: wall time per stage, held-out top-1, and
tau (tokens per verify forward) and tokens/s of the trained head against plain decoding.

    # SmolLM2 EAGLE-1 from the 450 shared training prompts, tau on official-dev's prompts:
    python benchmarks/bench_train.py eagle1 --openblas
    # stories260K EAGLE-3 from its own samples, tau on story openings, a chain and trees:
    python benchmarks/bench_train.py eagle3 --model tests/data/models/stories260K-llama \
        --self-samples 400 --max-tokens 256 --trees chain4 8,4,2 60,7,10 --eval-tokens 256
    # stories260K DFlash (block 8, one layer) from 600 of its own samples, chains and trees:
    python benchmarks/bench_train.py dflash --model tests/data/models/stories260K-llama \
        --self-samples 600 --max-tokens 256 --batch-tokens 1024 --lr 3e-3 \
        --trees chain7 chain5 top2,12 --eval-tokens 256 --runs 3

Stages are cached under --work (default ~/.cache/mlx_speculate/train-bench): run again to
resume, or delete it to start over. Tau per EAGLE tree (--trees: `total,depth,top_k` or
`chainK`; default the official 60/7/10) with a fixed draft size, interleaved with plain
decoding and mlx-lm's plain decoding on the same folder; outputs are checked equal to plain
greedy decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import CACHE, DATA, add_blas_argument, header, median, setup_blas  # noqa: E402


def measure(model, tokenizer, prompts, max_tokens: int, **kwargs) -> tuple[float, float, list]:
    """tokens/s and tau over all prompts, and the outputs."""
    from mlx_speculate import stream_generate

    tokens = forwards = generated = 0
    outputs = []
    start = time.perf_counter()
    for prompt in prompts:
        out, last = [], None
        for last in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs):
            out.append(last.token)
        if last is not None and last.stats is not None:
            forwards += last.stats.target_forwards
            generated += last.stats.generated
        tokens += len(out)
        outputs.append(out)
    seconds = time.perf_counter() - start
    return tokens / seconds, (generated / forwards if forwards else 1.0), outputs


def measure_mlx_lm(folder: str, prompts, max_tokens: int):
    """mlx-lm's greedy tokens/s over all prompts (a function of no arguments)."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(folder)

    def run() -> tuple[float, float, list]:
        tokens, start = 0, time.perf_counter()
        for prompt in prompts:
            tokens += sum(1 for _ in mlx_lm.stream_generate(model, tokenizer, prompt,
                                                            max_tokens=max_tokens))  # fmt: skip
        return tokens / (time.perf_counter() - start), 1.0, []

    return run


def parse_tree(text: str):
    from mlx_speculate.drafters import EagleGrowth

    if text.startswith("chain"):
        return EagleGrowth.chain(int(text.removeprefix("chain")))
    return EagleGrowth(*map(int, text.split(",")))


STORY_OPENINGS = ("Once upon a time", "Lily and Tom went to the park. They",
                  "The little dog was sad because", "One day, a big bird")  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("eagle1", "eagle3", "medusa", "dflash"))
    parser.add_argument("--model", help="default: SmolLM2-135M-Instruct float32")
    parser.add_argument("--prompts", default=str(DATA / "eagle" / "prompts-train.json"))
    parser.add_argument("--self-samples", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--batch-tokens", type=int, default=256)
    parser.add_argument("--draft-vocab", type=int, default=4096)
    parser.add_argument("--sample-prefix", type=int, default=16)
    parser.add_argument("--data-batch", type=int, default=32, help="prompts answered together")
    parser.add_argument("--intermediate-size", type=int, help="the draft layer's MLP width")
    parser.add_argument("--block-size", type=int, default=8, help="DFlash")
    parser.add_argument("--draft-layers", type=int, default=1, help="DFlash")
    parser.add_argument("--anchors", type=int, default=512, help="DFlash: blocks a conversation")
    parser.add_argument("--taps", type=int, nargs="+",
                        help="EAGLE-3: tapped layers; DFlash: the layers it reads")  # fmt: skip
    parser.add_argument("--work", type=Path, default=CACHE / "train-bench")
    parser.add_argument("--eval-prompts", type=int, default=10)
    parser.add_argument("--eval-tokens", type=int, default=128)
    parser.add_argument("--trees", nargs="+", default=["60,7,10"],
                        help="EAGLE trees: total,depth,top_k or chainK; DFlash: chainK or "
                        "topT,K (K nodes from each position's top T)")  # fmt: skip
    parser.add_argument("--runs", type=int, default=2,
                        help="timed rounds after a warm-up; 0: one pass, for tau and equality "
                        "only (no mlx-lm, tokens/s untimed)")  # fmt: skip
    add_blas_argument(parser)
    args = parser.parse_args(argv)
    blas = setup_blas(args.openblas)
    header(f"training recipe: {args.kind}", blas)

    from mlx_speculate import load
    from mlx_speculate.drafters import DFlashSpec, EagleSpec, MedusaSpec, make_drafter
    from mlx_speculate.policy.adaptive import FixedPolicy
    from mlx_speculate.train.loop import TrainConfig
    from mlx_speculate.train.recipe import Recipe, train_head

    if args.model is None:
        from bench_eagle import smollm2_folder

        args.model = str(smollm2_folder())
    name = f"{Path(args.model).name}-{args.kind}"
    if args.kind == "dflash":
        name += f"-b{args.block_size}-l{args.draft_layers}"
    out = args.work / name
    config = TrainConfig(epochs=args.epochs, learning_rate=args.lr, warmup=args.warmup,
                         max_steps=args.max_steps, batch_tokens=args.batch_tokens)  # fmt: skip
    recipe = Recipe(args.kind, max_tokens=args.max_tokens, self_samples=args.self_samples,
                    sample_prefix=args.sample_prefix, draft_vocab=args.draft_vocab,
                    data_batch=args.data_batch, intermediate_size=args.intermediate_size,
                    block_size=args.block_size, draft_layers=args.draft_layers,
                    anchors=args.anchors, taps=None if args.taps is None else tuple(args.taps),
                    train=config)  # fmt: skip
    if not out.exists():
        result = train_head(args.kind, args.model, out, recipe=recipe,
                            prompts=None if args.self_samples else args.prompts,
                            cache=args.work / f"{Path(args.model).name}.cache")  # fmt: skip
        for stage, seconds in result.seconds.items():
            print(f"{stage:<9} {seconds:8.1f} s")
        print(f"held-out top-1 {result.held_out_top1:.1%}; {result.tokens} tokens cached at "
              f"{result.bytes_per_token:.0f} bytes a token")  # fmt: skip
        # The CPU may be shared: the load says how far these times are from an idle machine's.
        print("load average (1, 5, 15 min) after training: "
              + ", ".join(f"{x:.1f}" for x in os.getloadavg()))  # fmt: skip
    else:
        print(f"{out} exists: measuring it (delete it to train again)")
        history = json.loads((out / "training.json").read_text())["history"]
        print(f"held-out top-1 per epoch: {[round(h['held_out_top1'], 3) for h in history]}")

    model, tokenizer = load(args.model)
    if args.self_samples:
        prompts = [tokenizer.encode(text) for text in STORY_OPENINGS][: args.eval_prompts]
    else:
        official = json.loads((DATA / "eagle" / "official-dev.json").read_text())["runs"]
        entries = official["eagle1-dynamic-tree"]["prompts"][: args.eval_prompts]
        prompts = [e["prompt_ids"] for e in entries]
    rows = {"plain": {}}
    if args.kind == "medusa":
        rows["medusa"] = {"drafter": make_drafter(MedusaSpec(heads=str(out)), model),
                          "policy": FixedPolicy(63)}  # fmt: skip
    for text in args.trees if args.kind == "dflash" else ():
        top_k, k = (1, int(text.removeprefix("chain"))) if text.startswith("chain") else (
            map(int, text.removeprefix("top").split(",")))  # fmt: skip
        rows[f"dflash {text}"] = {
            "drafter": make_drafter(DFlashSpec(drafter=str(out), top_k=top_k), model),
            "policy": FixedPolicy(k),
        }
    for text in args.trees if args.kind not in ("medusa", "dflash") else ():
        tree = parse_tree(text)
        rows[f"{args.kind} {text}"] = {
            "drafter": make_drafter(EagleSpec(heads=str(out), tree=tree), model),
            "policy": FixedPolicy(tree.total - 1),
        }
    timed = args.runs > 0
    theirs = measure_mlx_lm(args.model, prompts, args.eval_tokens) if timed else None
    keys = [*rows, "mlx-lm plain"] if timed else [*rows]
    results = {k: [] for k in keys}
    for round_ in range(args.runs + 1):  # round 0 warms up and is dropped (when timed)
        for key in results:
            if key == "mlx-lm plain":
                results[key].append(theirs())
            else:
                kwargs = rows[key]
                results[key].append(measure(model, tokenizer, prompts, args.eval_tokens, **kwargs))
            print(f"  round {round_} {key}: {results[key][-1][0]:.1f} tok/s", flush=True)
    first = 1 if timed else 0
    plain = median([r[0] for r in results["plain"][first:]])
    print(f"\n{'method':<22} {'tok/s':>8} {'tau':>6} {'vs plain':>9}  equal to plain")
    for key, values in results.items():
        kept = values[first:]
        tps, tau = median([v[0] for v in kept]), median([v[1] for v in kept])
        outputs = values[-1][2]
        same = "-" if not outputs or key == "plain" else outputs == results["plain"][-1][2]
        print(f"{key:<22} {tps:>8.1f} {tau:>6.2f} {tps / plain:>8.2f}x  {same}")
    print("load average (1, 5, 15 min): " + ", ".join(f"{x:.1f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
