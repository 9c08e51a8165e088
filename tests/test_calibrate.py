"""The calibrated cost curve: interpolation, the on-disk cache (written atomically, measured
again when stale, forced or when its key changes) and the CLI."""

import json

import mlx.core as mx
import pytest

from mlx_speculate import calibrate
from mlx_speculate.drafters import LookupSpec, MedusaSpec, make_drafter
from mlx_speculate.heads.medusa import MedusaHeads
from mlx_speculate.policy import measure
from mlx_speculate.policy.costs import MAX_AGE, ROWS, StepCosts
from mlx_speculate.policy.measure import load_costs

from .helpers import tiny_model
from .test_cli import tiny_folder


@pytest.fixture(autouse=True)
def calibration_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_SPECULATE_CALIBRATION", str(tmp_path / "calibration"))
    return tmp_path / "calibration"


def test_step_costs_interpolate_and_extrapolate():
    costs = StepCosts({1: 1.0, 2: 1.5, 4: 2.0}, {1: 0.1, 3: 0.3})
    assert costs.verify_cost(3) == pytest.approx(1.75)
    assert costs.verify_cost(8) == pytest.approx(4.0)  # past the last point: in proportion
    assert costs.draft_cost(2) == pytest.approx(0.2)
    assert costs.draft_cost(0) == 0.0
    assert costs.step(3) == pytest.approx(0.3 + 2.0)
    assert StepCosts({1: 1.0}, {}).step(5) == 6.0  # six rows


def test_a_point_measured_slow_takes_the_next_larger_ones_cost():
    # Under load one forward over 1 row took longer than the one over 2.
    costs = StepCosts({1: 4.0, 2: 2.4, 4: 3.0}, {1: 0.5, 2: 0.2})
    assert costs.verify == {1: 2.4, 2: 2.4, 4: 3.0}
    assert costs.draft == {1: 0.2, 2: 0.2}
    assert costs.verify_cost(8) == pytest.approx(6.0)  # never below what was measured


class Counting:
    """Wraps measure.measure, counting the calls."""

    def __init__(self, monkeypatch):
        self.calls = 0
        self.measure = measure.measure
        monkeypatch.setattr(measure, "measure", self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.measure(*args, **kwargs)


def test_cached_until_stale_forced_or_keyed_otherwise(calibration_dir, monkeypatch):
    model = tiny_model()
    counting = Counting(monkeypatch)
    drafter = make_drafter(LookupSpec(), model)
    costs = load_costs(model, drafter, (1, 2, 4), progress=False)
    assert counting.calls == 1
    assert set(costs.verify) <= set(ROWS) and {1, 2} <= set(costs.verify)
    assert min(costs.verify.values()) > 0 and not costs.trees
    files = list(calibration_dir.iterdir())
    assert [f.suffix for f in files] == [".json"]  # atomic: no staging folder left behind
    record = json.loads(files[0].read_text())

    assert load_costs(model, drafter, (1, 2), progress=False) == costs
    assert load_costs(model, progress=False).verify == costs.verify
    assert counting.calls == 1

    load_costs(model, drafter, (1, 2, 8), progress=False)  # a length not measured yet
    assert counting.calls == 2
    later = record["created"] + MAX_AGE + 1
    load_costs(model, drafter, (1, 2), now=lambda: later, progress=False)
    assert counting.calls == 3
    load_costs(model, drafter, (1, 2), force=True, progress=False)
    assert counting.calls == 4

    files[0].write_text("{torn")
    load_costs(model, drafter, (1, 2), progress=False)
    assert counting.calls == 5

    model.set_dtype(mx.float16)  # another dtype: another key, another file
    load_costs(model, drafter, (1, 2), progress=False)
    assert counting.calls == 6 and len(list(calibration_dir.iterdir())) == 2


def test_a_drafter_is_left_fresh_and_its_trees_are_seen():
    model = tiny_model()
    heads = MedusaHeads(64, 97, num_heads=2)
    drafter = make_drafter(MedusaSpec(heads=heads), model)
    costs = load_costs(model, drafter, (1, 4, 8), progress=False)
    assert costs.trees and set(costs.draft) <= {1, 4, 8} and costs.catch_up == 0.0
    assert drafter.propose([1, 2, 3], 4, None) is None  # rewound: no state left


def test_cli_prints_the_curve(tmp_path, capsys):
    folder = tiny_folder(tmp_path / "tiny", 256)
    assert calibrate.main(["--model", str(folder), "--prompt-lookup"]) == 0
    out = capsys.readouterr().out
    assert " rows  verify ms" in out and "draft ms" in out and "catch-up after 32" in out
    with pytest.raises(SystemExit) as exit_info:
        calibrate.main(["--model", str(folder), "--eagle", "--medusa-tree", "mc_sim_7b_63"])
    assert exit_info.value.code == 2
    assert "--medusa-tree applies to --medusa only" in capsys.readouterr().err


@pytest.mark.parametrize("longest, rows", [((), [1, 2]), ((1, 8), [1, 2, 4, 8, 16])])
def test_the_longest_drafts_rows_are_measured_past_the_budget(monkeypatch, longest, rows):
    # A machine so slow that the budget is spent at once: the curve still reaches the rows a
    # step of the longest draft verifies (8 drafts: 9 rows, bucket 12), never carried on in
    # proportion below them.
    monkeypatch.setattr(measure, "BUDGET", 1e-9)  # each point timed once
    model = tiny_model()
    drafter = make_drafter(LookupSpec(), model) if longest else None
    verify, *_ = measure.measure(model, drafter, longest, progress=False)
    assert sorted(verify) == rows


def test_the_longest_draft_is_measured_past_the_budget(monkeypatch):
    # The draft curve, cut short by the budget, ends at the longest draft and is interpolated
    # below it: carried on in proportion it priced EAGLE's 60-node tree (drafted in as many
    # levels as an 8-node one) at ten times its cost.
    monkeypatch.setattr(measure, "BUDGET", 1e-9)
    model = tiny_model()
    drafter = make_drafter(LookupSpec(), model)
    _, draft, _, _ = measure.measure(model, drafter, (1, 2, 3, 4, 24), progress=False)
    assert sorted(draft) == [1, 2, 24]
    costs = StepCosts({1: 1.0}, {1: 1.0, 2: 2.0, 24: 2.0})
    assert costs.draft_cost(12) == 2.0 and costs.draft_cost(48) == 4.0


def test_eagle_drafts_are_timed_as_trees():
    # EAGLE proposes from the features of every committed position: timed on the prompt alone
    # it proposed nothing, and its drafts were priced as free chains.
    from mlx_speculate.drafters import EagleGrowth, EagleSpec

    from .helpers import random_eagle_head, tiny_config

    model = tiny_model("llama", num_hidden_layers=6)
    head = random_eagle_head(tiny_config("llama", num_hidden_layers=6), 1, 5)
    drafter = make_drafter(EagleSpec(heads=head, tree=EagleGrowth(16, 4, 4)), model)
    _, draft, _, trees = measure.measure(model, drafter, (1, 4, 8), progress=False)
    assert trees and all(t > 0 for t in draft.values())


def test_a_point_takes_its_least_time(monkeypatch):
    """Another process only ever adds time: a run it slowed does not set the point."""
    clock = iter([0.0, 0.05, 0.05, 0.06, 0.06, 0.09])  # runs of 0.05, 0.01, 0.03
    monkeypatch.setattr(measure.time, "perf_counter", lambda: next(clock))
    assert measure._time(lambda: None) == pytest.approx(0.01)


class Clock:
    """A fake `time.perf_counter` that forwards advance by what a cost curve says, slowed by
    `load(call)` (the n-th forward), as another process would; a row count's first forward
    (its warm-up) takes `compile` seconds more, as on an empty kernel cache. `warm`: the
    seconds the warm-ups took."""

    def __init__(self, cost, load=lambda call: 1.0, compile: float = 0.0):
        self.now, self.calls, self.cost, self.load = 0.0, 0, cost, load
        self.compile, self.seen, self.warm = compile, set(), 0.0

    def __call__(self) -> float:
        return self.now

    def forward(self, r: int):
        def run():
            self.calls += 1
            seconds = self.cost(r) * self.load(self.calls)
            if r not in self.seen:
                self.seen.add(r)
                seconds += self.compile
                self.warm += seconds
            self.now += seconds

        return run


def quick_rows(monkeypatch, clock: Clock, needed: int = 16) -> dict[int, float]:
    monkeypatch.setattr(measure.time, "perf_counter", clock)
    beside = measure._Beside(clock.forward(1))
    return measure._quick_rows(clock.forward, list(ROWS), needed, bool, lambda: None, beside)


def test_quick_rows_stop_where_the_curve_goes_on_in_proportion(monkeypatch):
    # Every row a forward (a 4-bit model on a CPU): 1 and 2 rows (twice), then in proportion.
    rows = quick_rows(monkeypatch, Clock(lambda r: 0.1 * r))
    assert rows == pytest.approx({1: 1.0, 2: 2.0})  # ratios to one row
    # Rows nearly free (float32 with BLAS): up to the rows the longest draft needs.
    assert sorted(quick_rows(monkeypatch, Clock(lambda r: 0.1 + 0.001 * r))) == [1, 2, 4, 8, 16]
    assert sorted(quick_rows(monkeypatch, Clock(lambda r: 0.1), needed=3)) == [1, 2, 4]
    # One slow run at 4 rows on a flat curve (another process took the CPU): timed again.
    clock = Clock(lambda r: 0.1, lambda call: 4.0 if call == 7 else 1.0)  # 4 rows' timed run
    rows = quick_rows(monkeypatch, clock)
    assert sorted(rows) == [1, 2, 4, 8, 16] and rows[4] == pytest.approx(1.0)


def test_quick_rows_keep_within_their_budget(monkeypatch):
    # Half a row's cost per row, so never in proportion: the budget of one-row forwards ends it.
    clock = Clock(lambda r: 0.1 * (1 + 0.5 * r))
    rows = quick_rows(monkeypatch, clock, needed=64)
    assert 4 <= max(rows) < 64
    # Within budget before the last point (a 32-row one: 2 runs of 17 one-row forwards and
    # a one-row one after them, in one-row forwards at 0.15 s); warm-ups are not counted.
    last = 2 * 0.1 * (1 + 0.5 * max(rows)) + 0.15
    assert clock.now - clock.warm - last <= measure.QUICK_FORWARDS * 0.15


def test_warm_ups_that_compile_do_not_end_the_quick_curve(monkeypatch):
    """On an empty kernel cache each row count's first forward compiles for seconds: the curve
    still reaches the rows the longest draft needs, as on a warm one (spent on the warm-ups,
    the budget ended it at 2 rows, and wider steps were priced in proportion to their rows)."""
    clock = Clock(lambda r: 0.1 + 0.001 * r, compile=5.0)
    rows = quick_rows(monkeypatch, clock)
    assert sorted(rows) == [1, 2, 4, 8, 16] and rows[16] < 1.2


def test_quick_rows_are_ratios_to_a_forward_beside_them(monkeypatch):
    # The machine four times slower from the 4th forward on (the 2-row point's timed run): the
    # points are priced against one-row forwards timed in the same phase.
    cost = lambda r: 0.1 * (1 + 0.1 * r)  # noqa: E731 (rows nearly free)
    rows = quick_rows(monkeypatch, Clock(cost, lambda call: 4.0 if call > 3 else 1))
    assert rows == pytest.approx({r: cost(r) / cost(1) for r in (1, 2, 4, 8, 16)})


def test_first_use_is_quick_says_so_and_calibrate_measures_again(
    calibration_dir, caplog, monkeypatch
):
    model = tiny_model()
    counting = Counting(monkeypatch)
    drafter = make_drafter(LookupSpec(), model)
    sizes = (1, 2, 3, 4, 5, 6, 7, 8, 12, 18, 24)
    with caplog.at_level("WARNING", logger="mlx_speculate.policy.measure"):
        quick = load_costs(model, drafter, sizes, progress=False, quick=True)
    notice = [r.getMessage() for r in caplog.records]
    assert len(notice) == 1 and str(calibration_dir) in notice[0]
    assert "python -m mlx_speculate.calibrate" in notice[0]
    assert sorted(quick.draft) == [1, 24]  # interpolated between
    caplog.clear()
    with caplog.at_level("WARNING", logger="mlx_speculate.policy.measure"):
        assert load_costs(model, drafter, sizes, progress=False, quick=True) == quick
        assert counting.calls == 1
        thorough = load_costs(model, drafter, sizes, progress=False)  # the CLI's plan
        assert counting.calls == 2 and sorted(thorough.draft) != [1, 24]
        assert load_costs(model, drafter, sizes, progress=False, quick=True) == thorough
        assert load_costs(model, drafter, sizes, progress=False) == thorough
    assert counting.calls == 2 and not caplog.records  # the thorough plan says nothing


def test_the_server_calibrates_before_requests_or_not_at_all(monkeypatch):
    """A pool calibrates nothing by itself (a batched server's planner needs no policy), nor
    does acquiring a session; `calibrate`, which a server decoding one request at a time runs
    before its first, calibrates each method it serves once (prompt lookup's too)."""
    from mlx_speculate.server.sessions import SessionPool

    counting = Counting(monkeypatch)
    pool = SessionPool(tiny_model(), None, LookupSpec())
    pool.acquire(LookupSpec.method, [1, 2, 3])
    assert counting.calls == 0 and pool.policies == {}
    pool.calibrate()
    assert counting.calls == 1 and set(pool.policies) == {LookupSpec.method}
    pool.acquire(LookupSpec.method, [1, 2, 3, 4])
    assert pool.policy(LookupSpec.method) is pool.policies[LookupSpec.method]
    assert counting.calls == 1
