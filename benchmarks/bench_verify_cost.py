"""The verify cost curve: time of one target forward over r draft rows (a tree's mask and
positions after a committed prompt) against r = 1; then whole decoding steps with an EAGLE-1
head (drafting, verifying and committing) against a plain decoding step.

    python benchmarks/bench_verify_cost.py [--openblas] [--models smollm2,qwen05b] [--bits 4]
        [--dtype float16] [--rows 1,2,4,8,16,32,64] [--prompt 512] [--runs 20]

Speculation pays only when the tokens a step yields (tau) exceed its cost in plain steps, the
"break-even tau" printed per setting: what the adaptive policy learns online and what a cost
model would start from. Random weights in the named models' shapes (speed only: a random head's
drafts are rejected, so each step costs what it would with a good head), built in memory on
the default device (CPU here, Metal on a Mac, CUDA where MLX has it).
"""

from __future__ import annotations

import argparse
import sys
import time
from itertools import islice
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    QWEN25_05B,
    add_blas_argument,
    header,
    median,
    random_model,
    setup_blas,
)

SMOLLM2_135M = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}
LLAMA31_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
}
MODELS = {"smollm2": SMOLLM2_135M, "qwen05b": QWEN25_05B, "llama8b": LLAMA31_8B}


def quantized_model(config: dict, dtype, bits: int | None):
    """Random weights in `config`'s shapes, quantized to `bits` when given, evaluated."""
    import mlx.core as mx
    import mlx.nn as nn

    model = random_model(config, dtype)
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
    mx.eval(model.parameters())
    return model


def curve(model, rows: list[int], prompt: int, runs: int) -> dict[int, float]:
    """Median seconds of one forward over r rows, per r, after a `prompt`-token prefix."""
    import mlx.core as mx

    from mlx_speculate.tree import Tree

    cache = model.make_cache()
    mx.eval(model(mx.zeros((1, prompt), dtype=mx.int32), cache).logits)
    seconds = {}
    for r in rows:
        tree = Tree.chain(r - 1)  # cost depends on the row count, not the tree's shape
        tokens = mx.ones((1, r), dtype=mx.int32)
        mask, positions = tree.attention_mask(prompt, model.compute_dtype), tree.positions(prompt)
        times = []
        for i in range(runs + 3):  # three warm-ups
            start = time.perf_counter()
            mx.eval(model(tokens, cache, positions=positions, mask=mask).logits)
            if i >= 3:
                times.append(time.perf_counter() - start)
            cache.truncate(prompt)
        seconds[r] = median(times)
    return seconds


def step_costs(model, prompt: int, runs: int) -> dict[str, float]:
    """Median seconds per decoding step: plain, and an EAGLE-1 head's chains and tree."""
    import mlx.core as mx

    from mlx_speculate.decode import Decoder
    from mlx_speculate.drafters import EagleGrowth, EagleSpec, make_drafter
    from mlx_speculate.heads.eagle import Eagle1Head, EagleConfig
    from mlx_speculate.policy.adaptive import FixedPolicy
    from mlx_speculate.sampling import SamplingParams
    from mlx_speculate.sequence import Sequence

    args = model.args
    layer = {
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.rms_norm_eps,
        "num_hidden_layers": 1,
    }
    head = Eagle1Head(EagleConfig(version=1, layer=layer))
    head.set_dtype(model.compute_dtype)
    settings = {
        "plain": None,
        "eagle chain 1": EagleGrowth.chain(1),
        "eagle chain 6": EagleGrowth.chain(6),
        "eagle tree 60/7/10": EagleGrowth(),
    }
    seconds = {}
    for name, tree in settings.items():
        drafter = None if tree is None else make_drafter(EagleSpec(heads=head, tree=tree), model)
        decoder = Decoder(Sequence(model, drafter))
        decoder.sequence.prefill(list(range(1, prompt + 1)))
        policy = FixedPolicy(0 if tree is None else tree.total - 1)
        steps = islice(decoder.steps(SamplingParams(), policy), runs + 3)
        times = [step.seconds for step in steps]
        seconds[name] = median(times[3:])  # three warm-ups
        del decoder, drafter
        mx.clear_cache()
    return seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,qwen05b", help=f"from {', '.join(MODELS)}")
    parser.add_argument("--dtype", default=None, help="float32 (default on CPU) or float16")
    parser.add_argument("--bits", type=int, default=None, help="quantize the weights (4 or 8)")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--runs", type=int, default=20)
    add_blas_argument(parser)
    args = parser.parse_args(argv)
    blas = setup_blas(args.openblas)
    header("Verify cost: one forward over r rows against a decoding step (r = 1)", blas)

    import mlx.core as mx

    cpu = mx.default_device() == mx.cpu
    dtype = getattr(mx, args.dtype or ("float32" if cpu else "float16"))
    rows = sorted({1, *(int(r) for r in args.rows.split(","))})
    for name in args.models.split(","):
        model = quantized_model(MODELS[name], dtype, args.bits)
        seconds = curve(model, rows, args.prompt, args.runs)
        weights = f"{args.bits}-bit" if args.bits else str(dtype).split(".")[-1]
        print(f"\n## {name} ({weights}), after a {args.prompt}-token prompt")
        print(f"{'rows':>5} {'ms':>9} {'x step':>8}")
        for r, t in seconds.items():
            print(f"{r:>5} {1e3 * t:>9.2f} {t / seconds[1]:>8.2f}")
        steps = step_costs(model, args.prompt, args.runs)
        print(f"\n{'step':<20} {'ms':>9} {'break-even tau':>15}")
        for label, t in steps.items():
            print(f"{label:<20} {1e3 * t:>9.2f} {t / steps['plain']:>15.2f}")
        del model
        mx.clear_cache()


if __name__ == "__main__":
    main()
