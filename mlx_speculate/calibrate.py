"""The calibration command: measure (or show the cached) step costs of a model on this machine.

    python -m mlx_speculate.calibrate --model M [--draft-model D | --prompt-lookup | --medusa |
        --eagle ...] [--force]

What is measured and how is policy/measure.py's; where it is kept, policy/costs.py's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import mlx.core as mx

from . import cli
from .default_model import load_or_default
from .drafters import cli as drafter_cli
from .drafters import make_drafter
from .loading import DTYPES
from .policy.adaptive import candidate_lengths
from .policy.costs import CATCH_UP, blas_name, cache_file
from .policy.measure import load_costs


def main(argv: Sequence[str] | None = None) -> int:

    parser = cli.ArgumentParser(
        prog=cli.prog("mlx_speculate.calibrate"),
        description="Measure (or show the cached) verify and draft costs of a model on this "
        "machine: what the adaptive policy chooses draft lengths with.",
    )
    parser.add_argument(
        "--model", default=None, help="model folder or hub id (default: the default model)"
    )
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        help="compute dtype, as generate's (default: float32 on the CPU, the checkpoint's on "
        "Metal)",
    )
    parser.add_argument("--force", action="store_true", help="measure again even if cached")
    drafter_cli.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        spec = drafter_cli.spec_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    try:
        model, tokenizer = load_or_default(args.model, args.dtype)
        drafter = None if spec is None else make_drafter(spec, model, tokenizer)
        sizes = candidate_lengths(drafter.max_draft) if drafter else ()
        costs = load_costs(model, drafter, sizes, force=args.force, progress=True)
    except (ValueError, OSError, ImportError) as e:
        return cli.fail(e)
    print(f"# {cache_file(model)}")
    print(f"device {mx.default_device()}, BLAS {blas_name()}, mlx {mx.__version__}")
    print(f"{'rows':>5} {'verify ms':>10} {'x one row':>10}")
    for r, t in sorted(costs.verify.items()):
        print(f"{r:>5} {1e3 * t:>10.2f} {t / costs.verify[1]:>10.2f}")
    if costs.draft:
        print(f"\n{'k':>5} {'draft ms':>10} {'step ms':>10}")
        for k, t in sorted(costs.draft.items()):
            print(f"{k:>5} {1e3 * t:>10.2f} {1e3 * costs.step(k):>10.2f}")
        print(f"catch-up after {CATCH_UP} skipped tokens: {1e3 * costs.catch_up:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
