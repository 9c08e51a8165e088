"""Measuring step costs on this machine, and the policy built on them for a drafter.

It times one target forward over r rows (`costs.ROWS`, the verify buckets: 1 to 64) after a
short prompt, and for a drafter one proposal per draft length the policy weighs
(`adaptive.candidate_lengths`) and, for drafters that keep a cache, catching up on
`costs.CATCH_UP` skipped tokens. Points are measured smallest first within `BUDGET` seconds each
for the verify and the draft curve (the verify rows of the longest draft, up to `NEEDED_ROWS`,
and the longest draft itself, whatever the time; draft costs between are interpolated); where
the budget runs out (a slow CPU) the verify curve goes on in proportion to the rows, as it does
on such a machine. Measured curves are cached (costs.py) and measured again when older than
`costs.MAX_AGE` or when the key changes. This module sits above the decoding loop: it runs it.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence

import mlx.core as mx

from ..decode import Decoder
from ..drafters.base import Drafter
from ..memo import Table, per_model
from ..models.base import CausalLM
from ..sampling import SamplingParams
from ..step import verify as verify_step
from ..tree import Tree
from ..verify import AcceptanceRule
from .adaptive import AdaptivePolicy, FixedPolicy, Policy, Prices, candidate_lengths
from .costs import (
    CATCH_UP,
    MAX_AGE,
    PROMPT,
    ROWS,
    StepCosts,
    cache_file,
    costs_of,
    drafter_key,
    read_record,
    target_key,
    write_record,
)

RUNS = 3  # timed runs per point (after one warm-up); the least is kept
BUDGET = 3.0  # seconds for the verify curve, and again for the draft curve
GREEDY = AcceptanceRule(SamplingParams())  # the timed verify's rule: the cost is the forward's
NEEDED_ROWS = 16  # verify rows measured past the budget where the longest draft needs them


def load_costs(
    model: CausalLM,
    drafter: Drafter | None = None,
    sizes: Sequence[int] = (),
    *,
    force: bool = False,
    now: Callable[[], float] = time.time,
    progress: bool | None = None,
    decide: Callable[[bool], bool] = bool,
) -> StepCosts:
    """The cached costs of `model` (and `drafter` at draft lengths `sizes`), measured now when
    missing, stale or `force`d. `drafter` must be fresh: it is rewound to nothing after.
    `decide` makes each timing-dependent choice (cached or not, one more run): a sharded target's
    ranks take rank 0's, so that they run the same forwards."""
    path = cache_file(model)
    record = read_record(path)
    if record.get("key") != target_key(model):
        record = {"key": target_key(model)}
    fresh = not force and now() - record.get("created", -MAX_AGE) < MAX_AGE
    name = None if drafter is None else drafter_key(drafter)
    entry = record.get("drafters", {}).get(name) if name else None
    wanted = sorted({k for k in sizes if 0 < k <= drafter.max_draft}) if drafter else []
    have = entry is not None and set(entry["sizes"]) >= set(wanted)
    if decide(fresh and "verify" in record and (drafter is None or have)):
        return costs_of(record, name)
    measured = measure(model, drafter, wanted, progress=progress, decide=decide)
    verify, draft, catch_up, trees = measured
    if not fresh or "verify" not in record:
        record = {"key": target_key(model), "created": now(), "drafters": {}}
    # The verify curve measured beside this draft curve: the policy weighs one against the
    # other, so both come from the same conditions (a busy machine slows both).
    record["verify"] = verify
    if name is not None:
        entry = {"sizes": wanted, "draft": draft, "catch_up": catch_up, "trees": trees}
        record.setdefault("drafters", {})[name] = entry
    write_record(path, record)
    return costs_of(json.loads(json.dumps(record)), name)


def measure(
    model: CausalLM,
    drafter: Drafter | None = None,
    sizes: Sequence[int] = (),
    *,
    progress: bool | None = None,
    decide: Callable[[bool], bool] = bool,
) -> tuple[dict[int, float], dict[int, float], float, bool]:
    """(verify seconds per row count, draft seconds per draft length, catch-up seconds, and
    whether the drafts were trees). `decide`: as `load_costs`'s."""
    from tqdm import tqdm

    context = model.args.max_position_embeddings
    # Few distinct tokens, in an irregular order: n-grams recur with several continuations, so
    # a lookup drafter has matches (its trees show) as it would on text.
    alphabet = min(11, model.args.vocab_size - 1)
    prompt = [1 + (i * i + i // 3) % alphabet for i in range(min(PROMPT, context // 2))]
    rows = [r for r in ROWS if r <= context - len(prompt)] or [1]
    bar = tqdm(
        total=len(rows) + len(sizes) + (drafter is not None),
        desc="calibrating step costs",
        unit="point",
        file=sys.stderr,
        disable=None if progress is None else not progress,
        leave=False,
    )
    decoder = Decoder(model, drafter)
    decoder.prefill(prompt)
    offset = decoder.cache.offset
    pending = mx.ones((1,), dtype=mx.int32)
    verify: dict[int, float] = {}
    # The rows a step of the longest draft verifies are measured whatever the budget (up to
    # 16): a curve cut short and carried on in proportion would price long drafts far above
    # their cost where rows are cheap (float32 with BLAS), and the policy would draft short.
    needed = min(max(sizes, default=0) + 1, NEEDED_ROWS)
    start = time.perf_counter()
    for r in rows:
        # decide() last: every rank reaches it on the same rows (the row counts are the same).
        enough = len(verify) >= 2 and max(verify) >= needed
        if enough and decide(time.perf_counter() - start > BUDGET):
            break
        # The loop's own compiled verify step over r rows (a row bucket): the cost depends on
        # the row count, not the tree's shape.
        tree, drafted = Tree.chain(r - 1), mx.ones((r - 1,), dtype=mx.int32)

        def forward(tree=tree, drafted=drafted):
            out = verify_step(model, decoder.cache, pending, tree, drafted, None, GREEDY)
            mx.eval(out.acceptance.tokens, out.logits)
            decoder.cache.truncate(offset)

        verify[r] = _time(forward, decide)
        bar.update()
    draft: dict[int, float] = {}
    catch_up, trees = 0.0, False
    if drafter is not None:
        # The prompt and the pending token (the verify's): a head drafter proposes from the
        # features of every committed position, so it drafts nothing on the prompt alone.
        context, greedy = [*decoder.context, 1], SamplingParams()
        start = time.perf_counter()
        # The longest draft is measured whatever the budget: the curve between it and the
        # last point within budget is then interpolated, never carried on in proportion,
        # which would price an EAGLE tree (whose draft cost stops growing once its levels
        # are all expanded) at many times its cost, and the policy would never grow one.
        for i, k in enumerate(sizes):
            last = i == len(sizes) - 1
            if len(draft) >= 2 and not last and decide(time.perf_counter() - start > BUDGET):
                continue
            draft[k] = _time(lambda k=k: _propose(drafter, context, k, greedy), decide)
            trees = trees or _propose(drafter, context, k, greedy) == "tree"
            bar.update()
        catch_up = _catch_up(drafter, context, greedy, draft.get(1, 0.0))
        bar.update()
        drafter.rewind(0)
    bar.close()
    return verify, draft, catch_up, trees


def _propose(drafter: Drafter, context: list[int], k: int, sampling: SamplingParams) -> str:
    """What one proposal of k tokens was: "none", "chain" or "tree"."""
    draft = drafter.propose(context, k, sampling)
    if draft is None:
        return "none"
    mx.eval(draft.tokens)
    return "chain" if draft.tree.is_chain else "tree"


def _catch_up(drafter: Drafter, context: list[int], sampling, steady: float) -> float:
    """Extra seconds of a one-token proposal after `CATCH_UP` skipped tokens, for drafters that
    re-read them (a draft model's forward over them); 0 for those that keep no such state."""
    length = len(context) - 1 - CATCH_UP
    if length < 1:
        return 0.0
    times = []
    for _ in range(RUNS):
        drafter.rewind(length)
        start = time.perf_counter()
        if _propose(drafter, context, 1, sampling) == "none":
            return 0.0  # its state went with the rewind: nothing to catch up on
        times.append(time.perf_counter() - start)
    return max(min(times) - steady, 0.0)


def _time(run: Callable[[], object], decide: Callable[[bool], bool] = bool) -> float:
    """Least seconds of `run` after a warm-up (allocation, kernel set-up); a single timed run
    where one takes a tenth of the budget. The least, not the median: other processes on a
    shared machine only ever add time, and a point slowed by them would skew the draft curve
    against the verify curve for as long as the cache lives."""
    run()
    times: list[float] = []
    while len(times) < RUNS and decide(sum(times) < BUDGET / 10):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def default_policy(
    drafter: Drafter,
    target: CausalLM,
    num_draft_tokens: int | None = None,
    decide: Callable[[bool], bool] = bool,
) -> Policy:
    """A fixed draft length when one is asked for, else the adaptive policy up to the
    drafter's own cap (`Drafter.max_draft`), on the costs calibrated for `target` and
    `drafter` on this machine (measured now if not cached, within `BUDGET` a curve; `decide` as
    `load_costs`'s), priced as the drafter's last generations paid, and going on
    from where its last generation left off (`AdaptivePolicy._carry`)."""
    if num_draft_tokens is not None:
        return FixedPolicy(num_draft_tokens)
    sizes = candidate_lengths(drafter.max_draft)
    costs = load_costs(target, drafter, sizes, decide=decide)
    # Drafters over the same weights share prices: `stream_generate(eagle="folder")` makes a
    # drafter per call over the head the folder loaded once (memo.py). Lookup has no weights.
    owner = next(iter(drafter.weights()), drafter)
    held = per_model(_PRICES, owner, (type(drafter).__name__, drafter.max_draft), lambda: [])
    if not held or held[0].costs != costs:
        held[:] = [Prices(costs, sizes), None]
    held[1] = AdaptivePolicy(costs, drafter.max_draft, prices=held[0], before=held[1])
    return held[1]


# What the steps of each drafter (or its weights) have cost so far, and its last generation's
# policy, carried from one generation to the next.
_PRICES: Table = {}
