"""Where a decoding step's time goes, per method: host graph building, waiting on the device,
and host syncs per step. Any device (the timings are what `mx.default_device()` gives).

    python benchmarks/bench_step.py [--openblas] [--target smollm2|stories] [--temperatures 0,0.7]

Methods on `smollm2` (SmolLM2-135M-Instruct float32, the official EAGLE prompts): plain, prompt
lookup (k = 4), Medusa (random heads: cost only, mc_sim_7b_63 first 20 nodes), EAGLE-1 chain
7/5/1 and the official EAGLE-1 tree 60/7/10 (../shared/eagle heads). On `stories`
(stories260K): plain, draft model (llama2xs281K, k = 4), lookup, Medusa.

host: time spent queueing a step (drafting included) outside any evaluation; wait: time spent
in `mx.eval` (the host waiting for the device); syncs: `mx.eval` calls per step. Interleaved
rounds, medians per step over the last rounds (the first warms up and compiles).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import SHARED, add_blas_argument, header, setup_blas  # noqa: E402


class Probe:
    """Times the decode loop's queueing and every `mx.eval` (patched while it runs)."""

    def __init__(self):
        import mlx.core as mx

        from mlx_speculate import decode

        self.host = self.wait = 0.0
        self.syncs = self.steps = 0
        self._in_queue_wait = 0.0
        original_eval, original_queue = mx.eval, decode._Queue.__call__

        def timed_eval(*args):
            start = time.perf_counter()
            original_eval(*args)
            spent = time.perf_counter() - start
            self.wait += spent
            self._in_queue_wait += spent
            self.syncs += 1

        def timed_queue(queue, *args):
            self._in_queue_wait = 0.0
            start = time.perf_counter()
            result = original_queue(queue, *args)
            self.host += time.perf_counter() - start - self._in_queue_wait
            self.steps += 1
            return result

        mx.eval = timed_eval
        decode._Queue.__call__ = timed_queue

    def measure(self, generate) -> tuple[float, float, float, float, float]:
        """(host ms, wait ms, syncs, total ms, tokens) per step of one generation."""
        tokens, start = 0, 0.0
        for _ in generate():
            if tokens == 0:  # the prompt's forward is not a step
                self.host = self.wait = 0.0
                self.syncs = self.steps = 0
                start = time.perf_counter()
            tokens += 1
        total = time.perf_counter() - start
        tokens -= 1
        steps = max(self.steps, 1)
        return (
            1e3 * self.host / steps,
            1e3 * self.wait / steps,
            self.syncs / steps,
            1e3 * total / steps,
            tokens / steps,
        )


def methods(target: str):
    """(model, tokenizer, prompt ids, {label: stream_generate keywords})."""
    from mlx_speculate import load
    from mlx_speculate.drafters import EagleSpec, EagleTree
    from mlx_speculate.heads.medusa import MEDUSA_TREES, MedusaHeads
    from mlx_speculate.policy import FixedPolicy

    if target == "stories":
        model, tokenizer = load(SHARED / "models" / "stories260K-llama")
        draft, draft_tokenizer = load(SHARED / "models" / "llama2xs281K-llama")
        prompt = tokenizer.encode("Once upon a time, there was a little girl named Lily. She")
        rows = {
            "draft model k=4": dict(
                draft_model=draft, draft_tokenizer=draft_tokenizer, num_draft_tokens=4
            ),
        }
    else:
        from bench_eagle import smollm2_folder

        model, tokenizer = load(smollm2_folder())
        official = json.loads((SHARED / "eagle" / "official-dev.json").read_text())["runs"]
        prompt = official["eagle1-dynamic-tree"]["prompts"][0]["prompt_ids"]
        heads = EagleSpec(heads=SHARED / "eagle" / "smollm2-eagle1").resolve(model).heads
        rows = {
            "EAGLE-1 chain 7/5/1": dict(
                drafter=EagleSpec(heads=heads, tree=EagleTree.chain(6)), policy=FixedPolicy(6)
            ),
            "EAGLE-1 tree 60/7/10": dict(
                drafter=EagleSpec(heads=heads, tree=EagleTree()), policy=FixedPolicy(59)
            ),
        }
    medusa = MedusaHeads(model.args.hidden_size, model.args.vocab_size, num_heads=4)
    return (
        model,
        tokenizer,
        prompt,
        {
            "plain": {},
            "lookup k=4": dict(prompt_lookup=True, num_draft_tokens=4),
            "Medusa 20 nodes (random heads)": dict(
                medusa=medusa, tree=MEDUSA_TREES["mc_sim_7b_63_prefix19"], num_draft_tokens=19
            ),
            **rows,
        },
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=("smollm2", "stories"), default="smollm2")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    add_blas_argument(parser)
    args = parser.parse_args(argv)
    blas = setup_blas(args.openblas)
    header(f"time per decoding step: host, device wait, syncs ({args.target})", blas)

    from mlx_speculate import stream_generate

    model, tokenizer, prompt, rows = methods(args.target)
    probe = Probe()
    temperatures = [float(t) for t in args.temperatures.split(",")]
    results = {(name, t): [] for t in temperatures for name in rows}
    for _ in range(args.runs + 1):  # round 0 warms up (and traces the compiled steps)
        for (name, temp), values in results.items():
            kwargs = dict(rows[name], max_tokens=args.max_tokens, temperature=temp, seed=0)
            values.append(
                probe.measure(lambda k=kwargs: stream_generate(model, tokenizer, prompt, **k))
            )
    print(
        f"{'method':<32} {'T':>4} {'host ms':>8} {'wait ms':>8} {'syncs':>6} "
        f"{'step ms':>8} {'tok/step':>8}"
    )
    for (name, temp), values in results.items():
        host, wait, syncs, total, tokens = (
            statistics.median(v[i] for v in values[1:]) for i in range(5)
        )
        print(
            f"{name:<32} {temp:>4} {host:>8.2f} {wait:>8.2f} {syncs:>6.2f} {total:>8.2f} "
            f"{tokens:>8.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
