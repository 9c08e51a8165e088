"""benchmarks/report.py's results page, rendered from a made-up result set: no model runs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report():
    path = ROOT / "benchmarks" / "report.py"
    spec = importlib.util.spec_from_file_location("benchmark_report", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def made_up(report):
    rows = (
        report.Row("toy", "plain", "story", (100.0, 120.0, 80.0), (1.0, 1.0, 1.0), None),
        report.Row("toy", "mlx-lm plain", "story", (50.0, 60.0, 40.0), (1.0,) * 3, None),
        report.Row("toy", "lookup", "story", (150.0, 120.0, 160.0), (2.5, 2.0, 3.0), (9, 8, 7)),
        report.Row("toy", "EAGLE-1 adaptive", "story", (99.0, 118.0, 79.0), (1.0,) * 3, (0, 0, 0)),
        report.Row("toy", "EAGLE-3 adaptive", "story", (99.0, 130.0, 79.0), (1.0, 1.5, 1.0),
                   (0, 4, 0)),
    )
    return report.Report(
        date="2026-11-28",
        command="python benchmarks/report.py --openblas --models toy --runs 3",
        machine={"CPU": "AMD EPYC", "OS": "Linux-6", "BLAS": "OpenBLAS (x)"},
        cores=2,
        load=(1.5, 1.2),
        versions={"mlx": "0.32.4", "mlx-lm": "0.32.2", "Python": "3.11.7",
                  "mlx_speculate commit": "abc1234"},
        prompts=(report.Prompt("story", "Once upon a time, |there", chat=False),),
        max_tokens=96,
        rows=rows,
    )


def test_page_names_machine_versions_command_and_prompts(report):
    page = report.render(made_up(report), "results.png")
    for text in ("AMD EPYC", "cores: 2", "OpenBLAS (x)", "start / end: 1.5 / 1.2", "mlx: 0.32.4",
                 "mlx-lm: 0.32.2", "Python: 3.11.7", "abc1234", "2026-11-28",
                 "python benchmarks/report.py --openblas --models toy --runs 3",
                 "Once upon a time, |there", "as plain text after BOS", "Up to 96 tokens",
                 "![tokens/s relative to plain decoding, median and range](results.png)"):
        assert text in page, text
    assert "results.png" not in report.render(made_up(report), None)


def table(page: str) -> dict[str, list[str]]:
    lines = page.split("## Table\n", 1)[1].splitlines()
    rows = [[c.strip() for c in line[1:-1].split("|")] for line in lines if line.startswith("| ")]
    assert rows[0] == ["model", "method", "prompt", "tokens/s", "tau", "vs plain", "note"]
    return {cells[1]: cells for cells in rows[1:]}


def test_rows_give_medians_with_their_range(report):
    rows = table(report.render(made_up(report)))
    assert list(rows) == ["plain", "mlx-lm plain", "lookup", "EAGLE-1 adaptive",
                          "EAGLE-3 adaptive"]
    assert rows["plain"][3:6] == ["100.0 (80.0–120.0)", "1.00", "1.00x"]
    # A | in a prompt would break the table: the table names prompts, the text is above it.
    assert rows["lookup"][2] == "story"
    assert rows["lookup"][3] == "150.0 (120.0–160.0)"
    assert rows["lookup"][4] == "2.50 (2.00–3.00)"
    # Ratios are taken round by round against plain in the same round: 1.5, 1.0, 2.0.
    assert rows["lookup"][5] == "1.50x (1.00–2.00)"
    assert rows["mlx-lm plain"][5] == "0.50x"


def test_a_row_that_never_drafted_says_so(report):
    rows = table(report.render(made_up(report)))
    assert "never drafted" in rows["EAGLE-1 adaptive"][6]
    assert rows["EAGLE-3 adaptive"][6] == "drafted nothing in 2 of 3 rounds"
    for method in ("plain", "mlx-lm plain", "lookup"):
        assert rows[method][6] == "", method


def test_fewer_than_three_runs_is_refused(report, capsys):
    with pytest.raises(SystemExit) as exit_info:
        report.main(["--runs", "2"])
    assert exit_info.value.code == 2
    assert "at least 3" in capsys.readouterr().err


def test_a_busy_machine_is_flagged(report):
    quiet = made_up(report)
    assert "The machine was busy" not in report.render(quiet)
    busy = report.render(report.Report(**{**vars(quiet), "load": (1.5, 3.1)}))
    assert "The machine was busy**: its load average (3.1) exceeded its 2 cores" in busy


def test_earlier_measurements_name_device_date_and_command(report):
    entries = report.recorded()  # benchmarks/measurements.json, the file itself
    assert entries and all(m.what and m.result and m.date and m.command for m in entries)
    assert all(m.device in ("2-core AMD EPYC CPU (Linux, MLX CPU backend, OpenBLAS), shared "
                            "with other jobs", "NVIDIA H100 (Linux, mlx[cuda13] 0.32.4)")
               for m in entries)
    page = report.render(report.Report(**{**vars(made_up(report)), "recorded": entries[:2]}))
    section = page.split("## Earlier measurements\n", 1)[1]
    for n, m in enumerate(entries[:2], 1):
        assert f"| {m.what} | {m.result} | {m.device} | {m.date} | {m.conditions} | [{n}] |" in (
            section
        )
        assert f"{n}. `{m.command}`" in section
    assert "## Earlier measurements" not in report.render(made_up(report))


def test_a_saved_run_renders_the_same_page(report, tmp_path):
    run = made_up(report)
    report.save(run, tmp_path / "results.json")
    assert report.load_saved(tmp_path / "results.json") == run
    with pytest.raises(SystemExit, match="without --render first"):
        report.load_saved(tmp_path / "missing.json")


def serving_run(date: str, load=(1.0, 1.5)) -> dict:
    """A run in the shape benchmarks/bench_serving.py writes (its per-round lists included)."""
    rows = []
    for server, scale in (("mlx_speculate", 1.0), ("mlx-lm", 2.0)):
        for clients in (1, 4):
            row = {"server": server, "clients": clients, "tokens_per_s": 10.0 * clients * scale,
                   "ttft_p50_ms": 100.0 * clients, "ttft_p95_ms": 150.0 * clients + 0.4}
            rows.append({**row, "rounds": [row]})
    return {
        "benchmark": "serving", "date": date, "device": "cpu",
        "command": "python benchmarks/bench_serving.py --openblas --quick",
        "machine": {"CPU": "AMD EPYC", "OS": "Linux-6", "MLX device": "Device(cpu, 0)",
                    "BLAS": "OpenBLAS (x) in every server"},
        "cores": 2, "load": list(load), "versions": {"mlx": "0.32.4"},
        "model": "smollm2-f32-mlx", "max_tokens": 24, "rounds": 3, "method": "none",
        "servers": {"mlx_speculate": "python -m mlx_speculate.server", "mlx-lm": "mlx_lm"},
        "rows": rows,
    }


def test_serving_section_gives_each_client_count(report, tmp_path):
    (tmp_path / "serving-2026-11-28-cpu.json").write_text(json.dumps(serving_run("2026-11-28")))
    run = report.newest_serving(tmp_path)
    page = report.render(report.Report(**{**vars(made_up(report)), "serving": run}))
    section = page.split("## Serving\n", 1)[1]
    for text in ("2026-11-28", "AMD EPYC (Device(cpu, 0)), BLAS: OpenBLAS (x) in every server",
                 "2 cores", "start / end: 1.0 / 1.5", "smollm2-f32-mlx", "method `none`",
                 "of 24 tokens", "medians over 3 rounds",
                 "python benchmarks/bench_serving.py --openblas --quick"):
        assert text in section, text
    assert "busy" not in section
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    assert lines[0] == ("| clients | mlx_speculate tokens/s | mlx-lm tokens/s | mlx_speculate "
                        "TTFT p50 / p95 ms | mlx-lm TTFT p50 / p95 ms |")
    assert lines[1:] == ["| 1 | 10.0 | 20.0 | 100 / 150 | 100 / 150 |",
                         "| 4 | 40.0 | 80.0 | 400 / 600 | 400 / 600 |"]
    # It comes before the earlier measurements, and only when there is a run.
    entries = report.recorded()
    both = report.render(report.Report(**{**vars(made_up(report)), "serving": run,
                                          "recorded": entries[:1]}))
    assert both.index("## Serving") < both.index("## Earlier measurements")
    assert "## Serving" not in report.render(made_up(report))


def test_the_newest_serving_run_is_rendered(report, tmp_path):
    assert report.newest_serving(tmp_path) is None
    for date, load in (("2026-11-27", (1.0, 1.0)), ("2026-11-29", (2.5, 3.0)),
                       ("2026-11-28", (1.0, 1.0))):
        (tmp_path / f"serving-{date}-cpu.json").write_text(json.dumps(serving_run(date, load)))
    (tmp_path / "gpu-2026-11-30-h100.json").write_text("{}")  # another benchmark's file
    run = report.newest_serving(tmp_path)
    assert run.date == "2026-11-29" and run.load == (2.5, 3.0)
    assert "(busy: more than its cores)" in "\n".join(report.serving_section(run))
    # The saved run of the stories table does not carry it: it is read at each rendering.
    full = report.Report(**{**vars(made_up(report)), "serving": run})
    report.save(full, tmp_path / "results.json")
    assert report.load_saved(tmp_path / "results.json") == made_up(report)
    (tmp_path / "serving-2026-12-01-cpu.json").write_text(json.dumps({"date": "2026-12-01"}))
    with pytest.raises(SystemExit, match="serving-2026-12-01-cpu.json is not a bench_serving.py "
                                         "run: KeyError"):
        report.newest_serving(tmp_path)
