"""Prefill tokens/s of the default model (4-bit SmolLM2-135M) on the CPU: quantized matmuls
(before) vs dequantized wide matmuls (after), interleaved, medians.

    python benchmarks/bench_prefill.py [--openblas] [--tokens 2000] [--before-tokens N]

"Before" is the same model with plain QuantizedLinear layers, as loaded until this change; its
time grows linearly with the prompt, so `--before-tokens` can time it on a shorter prompt
(tokens/s are reported, and each method's prompt length is printed).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_blas_argument, header, median, setup_blas  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--before-tokens", type=int, default=None, help="default: --tokens")
    parser.add_argument("--repeats", type=int, default=3)
    add_blas_argument(parser)
    args = parser.parse_args()
    blas = setup_blas(args.openblas)

    import mlx.core as mx
    import mlx.nn as nn

    from mlx_speculate.default_model import default_model_path
    from mlx_speculate.loading import load
    from mlx_speculate.models.quantized_prefill import PrefillQuantizedLinear
    from mlx_speculate.sequence import PREFILL_STEP, Sequence

    header("Prefill of the default model on the CPU", blas)
    model, tokenizer = load(default_model_path())
    text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(600))
    ids = tokenizer.encode(text)
    layers = [m for _, m in model.named_modules() if isinstance(m, PrefillQuantizedLinear)]

    def run(method: str, n: int) -> float:
        for layer in layers:  # before: the kernel the model used until now
            layer.__class__ = nn.QuantizedLinear if method == "before" else PrefillQuantizedLinear
        sequence = Sequence(model)
        start = time.perf_counter()
        sequence.prefill(ids[:n])
        mx.eval(sequence._prompt_logits)
        return n / (time.perf_counter() - start)

    lengths = {"before": args.before_tokens or args.tokens, "after": args.tokens}
    assert len(ids) >= max(lengths.values()), f"the text has only {len(ids)} tokens"
    print(f"chunk: {PREFILL_STEP} tokens; {len(layers)} quantized linear layers")
    rates: dict[str, list[float]] = {m: [] for m in lengths}
    for repeat in range(args.repeats):
        for method, n in lengths.items():
            rates[method].append(run(method, n))
            print(f"  run {repeat + 1} {method}: {n} tokens, {rates[method][-1]:.1f} tokens/s",
                  flush=True)
    before, after = median(rates["before"]), median(rates["after"])
    for method, n in lengths.items():
        print(f"{method:>6}: {n} tokens, median {median(rates[method]):.1f} tokens/s")
    print(f"speedup: {after / before:.1f}x")


if __name__ == "__main__":
    main()
