"""Where a decoding step's time goes, per method: host graph building, waiting on the device,
and host syncs per step. Any device (the timings are what `mx.default_device()` gives).

    python benchmarks/bench_step.py [--openblas] [--target smollm2|stories] [--temperatures 0,0.7]

Methods on `smollm2` (SmolLM2-135M-Instruct float32, the official EAGLE prompts): plain, prompt
lookup (k = 4), Medusa (random heads: cost only, mc_sim_7b_63 first 20 nodes), EAGLE-1 chain
7/5/1 and the official EAGLE-1 tree 60/7/10 (../shared/eagle heads). On `stories`
(stories260K): plain, draft model (llama2xs281K, k = 4), lookup, Medusa.

mlx-lm's `stream_generate` on the same weights runs beside them: plain, and on `stories` its
speculative loop with the same draft model and k. The ratios at the end are the issue's goals:
ours over mlx-lm in tokens/s (plain; draft model), and on `smollm2` the EAGLE tree's sampled
step over its greedy step and its host time over a plain step's.

host: time spent queueing a step (drafting included) outside any evaluation; wait: time spent
in `mx.eval` (the host waiting for the device); syncs: `mx.eval` calls per step (mlx-lm's rows
give tokens/s only). Interleaved rounds, medians per step over the last rounds (the first
warms up and compiles).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DATA, MODELS, SHARED, add_blas_argument, header, setup_blas  # noqa: E402


class Probe:
    """Times the decode loop's queueing and every `mx.eval` (patched while it runs)."""

    def __init__(self):
        import mlx.core as mx

        from mlx_speculate import decode

        self.host = self.wait = 0.0
        self.syncs = self.steps = 0
        self._in_queue_wait = 0.0
        original_eval = mx.eval
        # A step is queued by `__call__`, or by `follow` on the step before's lazy count.
        original_queue, original_follow = decode._Queue.__call__, decode._Queue.follow

        def timed_eval(*args):
            start = time.perf_counter()
            original_eval(*args)
            spent = time.perf_counter() - start
            self.wait += spent
            self._in_queue_wait += spent
            self.syncs += 1

        def timed(original):
            def queue(*args):
                self._in_queue_wait = 0.0
                start = time.perf_counter()
                result = original(*args)
                self.host += time.perf_counter() - start - self._in_queue_wait
                self.steps += result is not None
                return result

            return queue

        mx.eval = timed_eval
        decode._Queue.__call__ = timed(original_queue)
        decode._Queue.follow = timed(original_follow)

    def measure(self, generate) -> tuple[float, ...]:
        """(host ms, wait ms, syncs, total ms, tokens) per step of one generation, and its
        tokens/s; the prompt's forward and first token excluded."""
        import mlx.core as mx

        # Each run starts from an empty allocator cache, not the buffers the last one left.
        mx.clear_cache()
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
            tokens / total,
        )


def methods(target: str):
    """(folder, draft folder or None, prompt ids, {label: stream_generate keywords})."""
    from mlx_speculate import load
    from mlx_speculate.drafters import EagleGrowth, EagleSpec
    from mlx_speculate.heads.medusa import MEDUSA_TREES, MedusaHeads
    from mlx_speculate.policy.adaptive import FixedPolicy

    if target == "stories":
        folder = MODELS / "stories260K-llama"
        draft_folder = MODELS / "llama2xs281K-llama"
        model, tokenizer = load(folder)
        draft, draft_tokenizer = load(draft_folder)
        prompt = tokenizer.encode("Once upon a time, there was a little girl named Lily. She")
        rows = {
            DRAFT: dict(draft_model=draft, draft_tokenizer=draft_tokenizer, num_draft_tokens=K),
        }
    else:
        from bench_eagle import smollm2_folder

        folder, draft_folder = smollm2_folder(), None
        model, tokenizer = load(folder)
        official = json.loads((DATA / "eagle" / "official-dev.json").read_text())["runs"]
        prompt = official["eagle1-dynamic-tree"]["prompts"][0]["prompt_ids"]
        heads = EagleSpec(heads=SHARED / "eagle" / "smollm2-eagle1").resolve(model).heads
        rows = {
            "EAGLE-1 chain 7/5/1": dict(
                drafter=EagleSpec(heads=heads, tree=EagleGrowth.chain(6)), policy=FixedPolicy(6)
            ),
            TREE: dict(drafter=EagleSpec(heads=heads, tree=EagleGrowth()), policy=FixedPolicy(59)),
        }
    medusa = MedusaHeads(model.args.hidden_size, model.args.vocab_size, num_heads=4)
    return (
        (model, tokenizer),
        (folder, draft_folder),
        prompt,
        {
            PLAIN: {},
            "lookup k=4": dict(prompt_lookup=True, num_draft_tokens=4),
            "Medusa 20 nodes (random heads)": dict(
                medusa=medusa, tree=MEDUSA_TREES["mc_sim_7b_63_prefix19"], num_draft_tokens=19
            ),
            **rows,
        },
    )


PLAIN, DRAFT, TREE, K = "plain", "draft model k=4", "EAGLE-1 tree 60/7/10", 4


def mlx_lm_rows(folders, prompt) -> dict:
    """mlx-lm's stream_generate on the same folders: plain, and its speculative loop with the
    draft model (same k) when there is one. Label -> generate(temperature)."""
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    folder, draft_folder = folders
    model, tokenizer = mlx_lm.load(str(folder))

    def run(temperature: float, **kwargs):
        sampler = make_sampler(temp=temperature)
        return mlx_lm.stream_generate(model, tokenizer, prompt, sampler=sampler, **kwargs)

    rows = {"mlx-lm plain": run}
    if draft_folder is not None:
        draft, _ = mlx_lm.load(str(draft_folder))
        rows[f"mlx-lm {DRAFT}"] = lambda t, **k: run(t, draft_model=draft, num_draft_tokens=K, **k)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=("smollm2", "stories"), default="smollm2")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--max-tokens", type=int, help="default: 256 on stories, 64 on smollm2")
    parser.add_argument("--runs", type=int, default=3)
    add_blas_argument(parser)
    args = parser.parse_args(argv)
    max_tokens = args.max_tokens or (256 if args.target == "stories" else 64)
    blas = setup_blas(args.openblas)
    header(f"time per decoding step: host, device wait, syncs ({args.target})", blas)

    from mlx_speculate import stream_generate

    (model, tokenizer), folders, prompt, rows = methods(args.target)
    theirs = mlx_lm_rows(folders, prompt)
    probe = Probe()
    temperatures = [float(t) for t in args.temperatures.split(",")]
    results = {(name, t): [] for t in temperatures for name in [*rows, *theirs]}
    for _ in range(args.runs + 1):  # round 0 warms up (and traces the compiled steps)
        for (name, temp), values in results.items():
            if name in theirs:
                generate = lambda n=name, t=temp: theirs[n](t, max_tokens=max_tokens)  # noqa: E731
            else:
                kwargs = dict(rows[name], max_tokens=max_tokens, temperature=temp, seed=0)
                generate = lambda k=kwargs: stream_generate(model, tokenizer, prompt, **k)  # noqa: E731
            values.append(probe.measure(generate))
    print(
        f"{'method':<32} {'T':>4} {'host ms':>8} {'wait ms':>8} {'syncs':>6} "
        f"{'step ms':>8} {'tok/step':>8} {'tok/s':>8}"
    )
    medians = {}
    for (name, temp), values in results.items():
        m = medians[name, temp] = [statistics.median(v[i] for v in values[1:]) for i in range(6)]
        if name in theirs:
            print(f"{name:<32} {temp:>4} {'-':>8} {'-':>8} {'-':>6} {'-':>8} {'-':>8} {m[5]:>8.1f}")
            continue
        print(
            f"{name:<32} {temp:>4} {m[0]:>8.2f} {m[1]:>8.2f} {m[2]:>6.2f} {m[3]:>8.2f} "
            f"{m[4]:>8.2f} {m[5]:>8.1f}",
            flush=True,
        )
    for temp in temperatures:
        for ours in (PLAIN, DRAFT):
            if (f"mlx-lm {ours}", temp) in medians:
                ratio = medians[ours, temp][5] / medians[f"mlx-lm {ours}", temp][5]
                print(f"T={temp}: {ours} / mlx-lm {ours}, tokens/s: {ratio:.2f}x")
        if (TREE, temp) in medians:
            host = medians[TREE, temp][0] / medians[PLAIN, temp][0]
            print(f"T={temp}: {TREE} host time / plain host time: {host:.2f}x")
    if (TREE, 0.0) in medians:
        for temp in (t for t in temperatures if t > 0):
            step = medians[TREE, temp][3] / medians[TREE, 0.0][3]
            print(f"T={temp}: {TREE} step / its greedy step: {step:.2f}x")


if __name__ == "__main__":
    main()
