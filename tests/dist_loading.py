"""Run by tests/test_distributed_loading.py under `mlx.launch`: each rank loads its folder of
`spec["folders"]` split over the group, writes what it holds to `<out>/rank<r>.json`, builds
its draft model of `spec["drafts"]` if given, then decodes a few tokens, unless
`spec["fault"]` makes rank 1 exit or hang first. An error (a one-line ValueError / OSError, as
the CLI prints it) is written to the same file."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_speculate.cli import one_line  # noqa: E402
from mlx_speculate.drafters import DraftModelSpec  # noqa: E402
from mlx_speculate.generation import stream_generate  # noqa: E402
from mlx_speculate.loading import load  # noqa: E402
from mlx_speculate.parallel.group import decoding_options, init_group  # noqa: E402
from mlx_speculate.parallel.ranks import guarded  # noqa: E402
from mlx_speculate.parallel.sharding import Split, weight_bytes  # noqa: E402


def main() -> None:
    out_dir, spec = Path(sys.argv[1]), json.loads(sys.argv[2])
    group = init_group()
    assert group is not None, "run under mlx.launch with more than one rank"
    rank = group.rank()
    record: dict = {}
    try:
        with guarded(group, spec.get("timeout", 300)) as watchdog:
            if rank == 1 and spec.get("fault") == "hang":
                # Hangs where its own watchdog cannot see, from the start: a slow load on this
                # rank must not let its watchdog fire before rank 0's (the two would race).
                watchdog.pause()
            split = Split(group, spec.get("parallel", "tensor"))
            model, tokenizer = load(spec["folders"][rank], split=split)
            record |= {"bytes": weight_bytes(model), "peak": mx.get_peak_memory()}
            record["describe"] = split.describe(model)
            if "drafts" in spec:  # every rank checks its draft model against the others'
                draft = DraftModelSpec(model=spec["drafts"][rank])
                decoding_options(model, tokenizer, draft, group)
            if rank == 1 and spec.get("fault") == "exit":
                os._exit(0)  # a rank that stops without a word: its sockets close
            if rank == 1 and spec.get("fault") == "hang":
                time.sleep(600)
            tokens = []
            for response in stream_generate(model, tokenizer, [1, 2, 3], max_tokens=8):
                tokens.append(response.token)
                watchdog.beat()
            record["tokens"] = tokens
    except (ValueError, OSError) as e:
        record["error"] = one_line(e)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
