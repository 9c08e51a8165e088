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

That is the thorough plan, `python -m mlx_speculate.calibrate`'s. A generation that finds no
curve measures the quick one (`quick`) inside its request: a few points timed once each,
within `QUICK_FORWARDS` one-row forwards, every point as a ratio to a one-row forward timed
beside it, so that a busy moment skews no point against another; the policy's prices
(adaptive.Prices) correct the rest as decoding pays them.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import abc
from collections.abc import Callable

import mlx.core as mx

from ..drafters.base import Drafter
from ..graphs import synchronous
from ..memo import Table, per_model
from ..models.base import CausalLM
from ..sampling import SamplingParams
from ..sequence import Sequence
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
    calibration_dir,
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
QUICK_FORWARDS = 24  # the quick plan's budget for the verify curve, in one-row forwards
PROPORTIONAL = 0.9  # rows dearer than this share of the rows before: the curve goes on so
AGREE = 1.5  # one-row forwards before and after a quick point further apart: timed again
NEGLIGIBLE = 0.05  # a quick point cheaper than this share of a one-row forward: none after it

log = logging.getLogger(__name__)


def load_costs(
    model: CausalLM,
    drafter: Drafter | None = None,
    sizes: abc.Sequence[int] = (),
    *,
    force: bool = False,
    now: Callable[[], float] = time.time,
    progress: bool | None = None,
    decide: Callable[[bool], bool] = bool,
    quick: bool = False,
) -> StepCosts:
    """The cached costs of `model` (and `drafter` at draft lengths `sizes`), measured now when
    missing, stale or `force`d: by the thorough plan, or by the quick one where `quick` (a
    generation's first use, which says so on stderr) and none is cached; the thorough plan
    measures again what the quick one measured. `drafter` must be fresh: it is rewound to
    nothing after. `decide` makes each timing-dependent choice (cached or not, one more run): a
    sharded target's ranks take rank 0's, so that they run the same forwards."""
    path = cache_file(model)
    record = read_record(path)
    if record.get("key") != target_key(model):
        record = {"key": target_key(model)}
    fresh = not force and now() - record.get("created", -MAX_AGE) < MAX_AGE
    name = None if drafter is None else drafter_key(drafter)
    entry = (record.get("drafters", {}).get(name) if name else None) or {}
    wanted = sorted({k for k in sizes if 0 < k <= drafter.max_draft}) if drafter else []
    have = drafter is None or (bool(entry) and set(entry["sizes"]) >= set(wanted))
    # Files written before the quick plan was: thorough.
    thorough = record.get("thorough", True) and entry.get("thorough", True)
    if decide(fresh and "verify" in record and have and (quick or thorough)):
        return costs_of(record, name)
    if quick:
        log.warning(
            "calibrating step costs for this model and drafter once (cached in %s; "
            "`python -m mlx_speculate.calibrate` runs it ahead)",
            calibration_dir(),
        )
    measured = measure(model, drafter, wanted, progress=progress, decide=decide, quick=quick)
    verify, draft, catch_up, trees = measured
    if not fresh or "verify" not in record:
        record = {"key": target_key(model), "created": now(), "drafters": {}}
    # The verify curve measured beside this draft curve: the policy weighs one against the
    # other, so both come from the same conditions (a busy machine slows both).
    record["verify"], record["thorough"] = verify, not quick
    if name is not None:
        entry = {"sizes": wanted, "draft": draft, "catch_up": catch_up, "trees": trees}
        record.setdefault("drafters", {})[name] = {**entry, "thorough": not quick}
    write_record(path, record)
    return costs_of(json.loads(json.dumps(record)), name)


@synchronous()  # what is timed is the compiled steps a policy will choose between
def measure(
    model: CausalLM,
    drafter: Drafter | None = None,
    sizes: abc.Sequence[int] = (),
    *,
    progress: bool | None = None,
    decide: Callable[[bool], bool] = bool,
    quick: bool = False,
) -> tuple[dict[int, float], dict[int, float], float, bool]:
    """(verify seconds per row count, draft seconds per draft length, catch-up seconds, and
    whether the drafts were trees), by the thorough plan or the `quick` one. `decide`: as
    `load_costs`'s."""
    from tqdm import tqdm

    context = model.args.max_position_embeddings
    # Few distinct tokens, in an irregular order: n-grams recur with several continuations, so
    # a lookup drafter has matches (its trees show) as it would on text.
    alphabet = min(11, model.args.vocab_size - 1)
    prompt = [1 + (i * i + i // 3) % alphabet for i in range(min(PROMPT, context // 2))]
    rows = [r for r in ROWS if r <= context - len(prompt)] or [1]
    points = _quick_sizes(sizes) if quick else list(sizes)
    bar = tqdm(
        total=len(rows) + len(points) + (drafter is not None),
        desc="calibrating step costs",
        unit="point",
        file=sys.stderr,
        disable=None if progress is None else not progress,
        leave=False,
    )
    sequence = Sequence(model, drafter)
    sequence.prefill(prompt)
    offset = sequence.cache.offset
    # A hybrid's one-row step keeps no state to roll back to: its checkpoint takes it back.
    mark = sequence.cache.checkpoint(offset)
    pending = mx.ones((1,), dtype=mx.int32)

    def verifying(tree: Tree) -> Callable[[], None]:
        """The loop's own compiled verify step of `tree`, its cache rolled back after."""
        drafted = mx.ones((tree.num_nodes - 1,), dtype=mx.int32)

        def run():
            out = verify_step(model, sequence.cache, pending, tree, drafted, None, GREEDY)
            mx.eval(out.acceptance.tokens, out.logits)
            if mark is None:
                sequence.cache.truncate(offset)
            else:
                sequence.cache.return_to(mark)

        return run

    def forward(r: int) -> Callable[[], None]:
        """A verify step over r rows (a row bucket), of a chain: the cost depends on the row
        count, not the tree's shape."""
        return verifying(Tree.chain(r - 1))

    # The rows a step of the longest draft verifies are measured whatever the budget (up to
    # 16): a curve cut short and carried on in proportion would price long drafts far above
    # their cost where rows are cheap (float32 with BLAS), and the policy would draft short.
    needed = min(max(sizes, default=0) + 1, NEEDED_ROWS)
    beside = _Beside(forward(1), decide) if quick else None
    if beside is None:
        verify = _rows(forward, rows, needed, decide, bar.update)
    else:
        verify = _quick_rows(forward, rows, needed, decide, bar.update, beside)
    draft: dict[int, float] = {}
    catch_up, trees = 0.0, False
    if drafter is not None:
        # The prompt and the pending token (the verify's): a head drafter proposes from the
        # features of every committed position, so it drafts nothing on the prompt alone.
        context, greedy = [*sequence.context, 1], SamplingParams()
        start = time.perf_counter()
        # The longest draft is measured whatever the budget: the curve between it and the
        # last point within budget is then interpolated, never carried on in proportion,
        # which would price an EAGLE tree (whose draft cost stops growing once its levels
        # are all expanded) at many times its cost, and the policy would never grow one.
        for i, k in enumerate(points):
            last = i == len(points) - 1
            propose = lambda k=k: _propose(drafter, context, k, greedy)  # noqa: E731
            if beside is not None:
                draft[k] = beside.ratio(propose)
            elif len(draft) >= 2 and not last and decide(time.perf_counter() - start > BUDGET):
                continue
            else:
                draft[k] = _time(propose, decide)
            trees = trees or propose() == "tree"
            bar.update()
    if trees and sequence.cache.follows_trees:
        # A tree's step fuses kernels of its own (its mask): built here too, untimed, so that
        # the first request's tree compiles at once (graphs.py: a kind's marker).
        verifying(Tree.from_paths([(0,), (1,), (0, 0)]))()
    if beside is not None:  # ratios to one-row forwards, in seconds of the least of them
        verify = {r: q * beside.scale for r, q in verify.items()}
        draft = {k: q * beside.scale for k, q in draft.items()}
    if drafter is not None:
        runs = 1 if quick else RUNS
        catch_up = _catch_up(drafter, context, greedy, draft.get(1, 0.0), runs)
        bar.update()
        drafter.rewind(0)
    bar.close()
    return verify, draft, catch_up, trees


def _rows(forward, rows: list[int], needed: int, decide, done) -> dict[int, float]:
    """The thorough verify curve: rows smallest first within `BUDGET` seconds, and up to
    `needed` whatever the time."""
    verify: dict[int, float] = {}
    start = time.perf_counter()
    for r in rows:
        # decide() last: every rank reaches it on the same rows (the row counts are the same).
        enough = len(verify) >= 2 and max(verify) >= needed
        if enough and decide(time.perf_counter() - start > BUDGET):
            break
        verify[r] = _time(forward(r), decide)
        done()
    return verify


def _quick_rows(forward, rows, needed: int, decide, done, beside: _Beside) -> dict[int, float]:
    """The quick verify curve, as ratios to a one-row forward: up to the rows `needed`, within
    the budget, and no further once a doubling of the rows nearly doubles the cost, twice timed
    (past its last point the curve goes on in proportion, as it does then)."""
    verify: dict[int, float] = {}
    for r in rows:
        if len(verify) >= 2 and (max(verify) >= needed or decide(beside.spent())):
            break
        verify[r] = beside.ratio(forward(r)) if r > 1 else 1.0
        done()
        below = max((v for v in verify if v < r), default=r)
        proportional = PROPORTIONAL * r / below * verify[below]
        # One slow run must not end the curve (carried on in proportion from there, a flat
        # curve would price long drafts many times over): timed again first.
        if r >= 2 and decide(verify[r] >= proportional):
            verify[r] = min(verify[r], beside.ratio(forward(r), warm=False))
            if decide(verify[r] >= proportional):
                break
    return verify


def _quick_sizes(sizes: abc.Sequence[int]) -> list[int]:
    """The draft lengths the quick plan times: the shortest and the longest, interpolated
    between. Where that underprices the lengths between (an EAGLE tree's levels), decoding
    corrects it as it pays them (adaptive.Prices); a price too high it would never pay."""
    return sorted({sizes[0], sizes[-1]}) if sizes else []


class _Beside:
    """The quick plan's clock: one warm-up and one timed run per point, each point a ratio to
    a one-row forward timed right before and after it (a busy moment slows both; where the
    two disagree by more than `AGREE`, the load changed between them, and the point is timed
    once more), and the budget spent so far, in one-row forwards timed beside (warm-ups not
    counted). `decide`: as `load_costs`'s."""

    def __init__(self, one: Callable[[], object], decide: Callable[[bool], bool] = bool):
        self.one, self.decide = one, decide
        one()  # warm-up
        start = time.perf_counter()
        self.anchors = [_once(one)]
        self.forwards = (time.perf_counter() - start) / self.anchors[0]

    def ratio(self, run: Callable[[], object], warm: bool = True) -> float:
        if warm:
            # A new row bucket traces its graph, and on an empty kernel cache compiles its
            # kernels (seconds each): outside the budget, which would otherwise end the curve
            # at its second point and price wider steps in proportion to their rows.
            run()
        start = time.perf_counter()
        for _ in range(2):
            seconds = _once(run)
            # decide(): whether to time an anchor (a target forward) must be every rank's
            if self.decide(seconds < NEGLIGIBLE * self.anchors[-1]):  # a lookup's draft
                before = after = self.anchors[-1]
                break
            self.anchors.append(_once(self.one))
            before, after = self.anchors[-2:]
            if not self.decide(max(before, after) > AGREE * min(before, after)):
                break
        beside = (before + after) / 2
        self.forwards += (time.perf_counter() - start) / beside
        return seconds / beside

    @property
    def scale(self) -> float:
        """Seconds of a one-row forward: the least seen (others only ever add time)."""
        return min(self.anchors)

    def spent(self) -> bool:
        return self.forwards > QUICK_FORWARDS


def _once(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _propose(drafter: Drafter, context: list[int], k: int, sampling: SamplingParams) -> str:
    """What one proposal of k tokens was: "none", "chain" or "tree"."""
    draft = drafter.propose(context, k, sampling)
    if draft is None:
        return "none"
    mx.eval(draft.tokens)
    return "chain" if draft.tree.is_chain else "tree"


def _catch_up(
    drafter: Drafter, context: list[int], sampling, steady: float, runs: int = RUNS
) -> float:
    """Extra seconds of a one-token proposal after `CATCH_UP` skipped tokens, for drafters that
    re-read them (a draft model's forward over them); 0 for those that keep no such state."""
    length = len(context) - 1 - CATCH_UP
    if length < 1:
        return 0.0
    times = []
    for _ in range(runs):
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
    `drafter` on this machine (measured now by the quick plan if not cached, saying so;
    `decide` as `load_costs`'s), priced as the drafter's last generations paid, and going on
    from where its last generation left off (`AdaptivePolicy._carry`)."""
    if num_draft_tokens is not None:
        return FixedPolicy(num_draft_tokens)
    sizes = candidate_lengths(drafter.max_draft)
    costs = load_costs(target, drafter, sizes, decide=decide, quick=True)
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
