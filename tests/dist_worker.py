"""Run by tests/test_distributed.py under `mlx.launch`: each rank builds the same tiny models,
records their single-process outputs, shards them over the group and records the sharded
ones, then writes `<out>/rank<r>.npz`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_speculate.drafters.eagle import EagleGrowth  # noqa: E402
from mlx_speculate.drafters.lookup import LookupSpec  # noqa: E402
from mlx_speculate.generation import stream_generate  # noqa: E402
from mlx_speculate.parallel.group import decoding_options, init_group, shared_seed  # noqa: E402
from mlx_speculate.parallel.ranks import guarded  # noqa: E402
from mlx_speculate.parallel.sharding import Split  # noqa: E402
from mlx_speculate.sampling import SamplingParams  # noqa: E402
from tests.helpers import random_eagle_head, tiny_model  # noqa: E402
from tests.markov import StubTokenizer  # noqa: E402
from tests.test_medusa import random_heads  # noqa: E402

PROMPT = [5, 17, 3, 5, 17, 3, 44, 12, 5, 17, 3, 9]
METHODS = {
    "plain": {},
    "lookup": {"prompt_lookup": True, "num_draft_tokens": 3},
    "draft": {"num_draft_tokens": 3},  # the draft model is added below
    "medusa": {"num_draft_tokens": 3},  # random heads of the family's sizes, added below
    "eagle": {"eagle_tree": EagleGrowth(8, 2, 3), "num_draft_tokens": 7},
}
# A hybrid target (recurrent layers) verifies chains only: EAGLE chains, no Medusa trees.
CHAIN_METHODS = {k: v for k, v in METHODS.items() if k != "medusa"} | {
    "eagle": {"eagle_tree": EagleGrowth.chain(3), "num_draft_tokens": 3},
}


def heads(model) -> dict:
    """Random Medusa and EAGLE-1 heads for `model`, the same on every rank (fixed seeds): they
    are not sharded, and read the target's features after its all-sums."""
    config = model.args
    medusa = random_heads(config.hidden_size, config.vocab_size, num_heads=2, seed=7)
    return {
        "medusa": {"medusa": medusa},
        "eagle": {"eagle": random_eagle_head(vars(config), 1, seed=5)},
    }


def tokens(model, tokenizer, **options) -> list[int]:
    return [r.token for r in stream_generate(model, tokenizer, PROMPT, max_tokens=12, **options)]


def record(model, prefix: str, out: dict, draft, generations: bool, group, beat) -> None:
    """Records the forward and, with `generations`, every method's tokens; `beat()` after each
    (the watchdog's step is one of them, not a whole family)."""
    output = model(mx.array([PROMPT]), taps=(0, model.args.num_hidden_layers - 1))
    out[f"{prefix}logits"] = np.array(output.logits)
    out[f"{prefix}taps"] = np.array(mx.stack(output.taps))
    beat()
    if not generations:
        return
    tokenizer = StubTokenizer()
    drafters = heads(model)
    drafters["draft"] = {"draft_model": draft}
    for name, options in (CHAIN_METHODS if model.recurrent else METHODS).items():
        options = {**options, **drafters.get(name, {})}
        out[f"{prefix}{name}"] = np.array(tokens(model, tokenizer, **options))
        beat()
    # No seed and no fixed draft length: rank 0's seed and rank 0's adaptive choices.
    sampling = SamplingParams(temperature=1.0, seed=shared_seed(None, group))
    options = decoding_options(model, tokenizer, LookupSpec(), group)
    out[f"{prefix}sampled"] = np.array(tokens(model, tokenizer, sampling=sampling, **options))


def main() -> None:
    out_dir, spec = Path(sys.argv[1]), json.loads(sys.argv[2])
    group = init_group()
    assert group is not None, "run under mlx.launch with more than one rank"
    split = Split(group, spec.get("parallel", "tensor"))
    out: dict[str, np.ndarray] = {}
    draft = tiny_model("llama", seed=11, **spec.get("overrides", {}))
    # A rank that hangs ends the run (and mlx.launch the rest) rather than the test's timeout;
    # the package's default limit a step, which a busy 2-core machine's compiles stay under.
    with guarded(group) as watchdog:
        for family in spec["families"]:
            model = tiny_model(family, seed=3, **spec.get("overrides", {}))
            if spec.get("quantize"):
                nn.quantize(model, group_size=32, bits=8)
            generations = family in spec.get("generate", ())
            record(model, f"{family}/single/", out, draft, generations, group, watchdog.beat)
            split.apply(model)
            record(model, f"{family}/sharded/", out, draft, generations, group, watchdog.beat)
    np.savez(out_dir / f"rank{group.rank()}.npz", **out)


if __name__ == "__main__":
    main()
