"""benchmarks/report.py's results page, rendered from a made-up result set: no model runs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from .helpers import MODELS

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
    lines = page.split("## Table\n", 1)[1].split("\n## ", 1)[0].splitlines()
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


def made_up_families(report, load=(1.5, 1.2)):
    shapes = {"qwen3_5 (tiny)": "hidden 64, 6 layers", "gpt_oss (tiny)": "hidden 64, experts"}
    rows = (
        report.Row("qwen3_5 (tiny)", "plain", "story", (60.0, 30.0, 90.0), (1.0,) * 3, None,
                   (24, 24, 24)),
        report.Row("qwen3_5 (tiny)", "mlx-lm plain", "story", (30.0, 30.0, 30.0), (1.0,) * 3,
                   None, (24, 24, 24)),
        report.Row("gpt_oss (tiny)", "plain", "story", (10.0, 12.0, 8.0), (1.0,) * 3, None,
                   (24, 24, 24)),
        report.Row("gpt_oss (tiny)", "mlx-lm plain", "story", (20.0, 12.0, 16.0), (1.0,) * 3,
                   None, (24, 24, 24)),
    )
    return report.Report(**{
        **vars(made_up(report)), "rows": rows, "described": shapes, "max_tokens": 24,
        "load": load, "date": "2026-11-29",
        "command": "python benchmarks/report.py --openblas --models families --runs 3",
    })  # fmt: skip


def family_table(page: str) -> dict[str, list[str]]:
    section = page.split("## Families\n", 1)[1]
    lines = section.split("\n## ", 1)[0].splitlines()
    rows = [[c.strip() for c in line[1:-1].split("|")] for line in lines if line.startswith("| ")]
    assert rows[0] == ["model", "shapes", "tokens a run", "ours (tokens/s)", "mlx-lm (tokens/s)",
                       "ours / mlx-lm"]
    return {cells[0]: cells for cells in rows[1:]}


def test_families_section_gives_shapes_tokens_and_ratio_to_mlx_lm(report):
    families = made_up_families(report)
    page = report.render(made_up(report), None, families)
    rows = family_table(page)
    assert list(rows) == ["qwen3_5 (tiny)", "gpt_oss (tiny)"]
    assert rows["qwen3_5 (tiny)"][1:] == [
        "hidden 64, 6 layers", "24", "60.0 (30.0–90.0)", "30.0", "2.00x (1.00–3.00)",
    ]
    # Ratios round by round: 0.5, 1.0, 0.5.
    assert rows["gpt_oss (tiny)"][5] == "0.50x (0.50–1.00)"
    section = page.split("## Families\n", 1)[1]
    for text in ("2026-11-29", "--models families", "exactly its 24 tokens (checked)",
                 "decoding only", "start / end: 1.5 / 1.2", "abc1234"):
        assert text in section, text
    # The method sets' table stays as it was, the families section sits before the recorded
    # measurements, and a busy families run is flagged in its own section.
    assert table(page) == table(report.render(made_up(report)))
    with_recorded = report.Report(**{**vars(made_up(report)), "recorded": report.recorded()[:1]})
    page = report.render(with_recorded, None, families)
    assert page.index("## Families") < page.index("## Earlier measurements")
    busy = report.render(made_up(report), None, made_up_families(report, load=(1.0, 5.0)))
    flagged = busy.split("## Families\n", 1)[1]
    assert "load average (5.0) exceeded" in flagged and "tau" not in flagged
    assert "## Families" not in report.render(made_up(report))


def test_a_saved_families_run_renders_the_same(report, tmp_path):
    run = made_up_families(report)
    path = report.families_file(tmp_path / "results.md")
    assert path.name == "results-families.json"
    report.save(run, path)
    assert report.load_families(path) == run
    assert report.load_families(tmp_path / "missing.json") is None
    # A run saved before token counts and shapes were recorded still loads.
    old = tmp_path / "old.json"
    report.save(made_up(report), old)
    fields = json.loads(old.read_text())
    del fields["described"]
    for row in fields["rows"]:
        del row["tokens"]
    old.write_text(json.dumps(fields))
    assert report.load_saved(old) == made_up(report)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--models", "stories,bogus"], "unknown model set 'bogus'"),
        (["--max-tokens", "0"], "a positive number of tokens"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(report, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        report.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_an_exact_run_checks_every_token_count(report, monkeypatch):
    """The families set ignores EOS and times decoding alone: every run emits its tokens (here
    stories260K's, 6 of them), and a run that emitted fewer ends the benchmark in one line."""
    folder = MODELS / "stories260K-llama"
    rows = report.measure("stories", folder, report.STORY, {}, 1, 6, exact=True)
    assert [(r.method, r.tokens) for r in rows] == [("plain", (6,)), ("mlx-lm plain", (6,))]
    assert all(r.tokens_per_s[0] > 0 for r in rows)
    monkeypatch.setattr(report, "theirs", lambda *args: (1.0, 1.0, 0, 5))
    with pytest.raises(SystemExit, match="stories, mlx-lm plain: 5 tokens in round 0"):
        report.measure("stories", folder, report.STORY, {}, 1, 6, exact=True)


def test_family_folders_load_alike_in_both(report, tmp_path):
    """The families set's premise: each tiny folder the converter writes loads here and in
    mlx-lm with the same logits, and its tokenizer has no EOS."""
    import family_models  # beside report.py, whose import put benchmarks/ on the path
    import mlx_lm

    from mlx_speculate import load

    seen = set()
    for label, folder, shapes in family_models.family_cases(("tiny",), tmp_path):
        seen.add(label.split()[0])
        ours, tokenizer = load(folder)
        theirs, their_tokenizer = mlx_lm.load(str(folder))
        assert not tokenizer.eos_token_ids and not their_tokenizer.eos_token_ids, label
        ids = mx.array([tokenizer.encode(report.STORY.text)])
        expected = theirs(ids)
        scale = max(mx.abs(expected).max().item(), 1.0)
        assert mx.abs(ours(ids).logits - expected).max().item() < 1e-4 * scale, label
        assert shapes.startswith("hidden 64, 6 layers"), shapes
    assert seen == set(family_models.FAMILIES)
    for family in family_models.FAMILIES:  # the larger configs are well formed too
        shapes = family_models.describe(family_models.family_config(family, "SmolLM2-sized"))
        assert shapes.startswith("hidden 576, 30 layers") and "49,152" in shapes, shapes


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


def test_render_shows_the_families_and_the_serving_sections(report, tmp_path, monkeypatch):
    """--render reads the saved method sets, the saved families run and the newest serving run
    again: the page has all three, each once, before the earlier measurements."""
    pytest.importorskip("matplotlib", reason="the chart needs matplotlib")
    out = tmp_path / "page" / "results.md"
    report.save(made_up(report), out.with_suffix(".json"))
    report.save(made_up_families(report), report.families_file(out))
    (tmp_path / "serving-2026-11-28-cpu.json").write_text(json.dumps(serving_run("2026-11-28")))
    newest = report.newest_serving
    monkeypatch.setattr(report, "newest_serving", lambda: newest(tmp_path))
    report.main(["--render", "--out", str(out)])
    page = out.read_text()
    assert table(page) == table(report.render(made_up(report)))
    assert list(family_table(page)) == ["qwen3_5 (tiny)", "gpt_oss (tiny)"]
    sections = ("## Families", "## Serving", "## Earlier measurements")
    assert [page.count(s) for s in sections] == [1, 1, 1]
    assert page.index(sections[0]) < page.index(sections[1]) < page.index(sections[2])
    assert out.with_suffix(".png").exists()
    # The saved runs carry neither the serving run nor the recorded measurements.
    assert report.load_saved(out.with_suffix(".json")) == made_up(report)
    assert report.load_families(report.families_file(out)) == made_up_families(report)


def test_mistral_pair_loads_alike_and_shares_the_last_token_map(report, tmp_path):
    """bench_pair.py --make-mistral's premise, at small shapes: both folders load here and in
    mlx-lm with the same logits and no EOS, and with the mixers silent the draft's next token
    after any token is the target's (the draft is partly right once they speak)."""
    import mistral_pair  # beside report.py, whose import put benchmarks/ on the path
    import mlx_lm

    from mlx_speculate import load

    small = {"vocab_size": 512, "intermediate_size": 128, "num_hidden_layers": 2}
    heads = {"num_attention_heads": 2, "num_key_value_heads": 1}
    target = mistral_pair.TARGET | small | heads | {"hidden_size": 128}
    draft = mistral_pair.DRAFT | small | {"hidden_size": 64, "num_attention_heads": 1}
    tokens = mx.arange(512)[:, None]  # every token alone
    for mix, agree in ((0.0, 0.99), (mistral_pair.MIX, 0.5)):
        pair = mistral_pair.write_mistral_pair(tmp_path / str(mix), mix, target, draft)
        predicted = []
        for folder in pair:
            ours, tokenizer = load(folder)
            theirs, their_tokenizer = mlx_lm.load(str(folder))
            assert not tokenizer.eos_token_ids and not their_tokenizer.eos_token_ids
            ids = mx.array([tokenizer.encode(report.STORY.text)])
            expected = theirs(ids)
            scale = max(mx.abs(expected).max().item(), 1.0)
            assert mx.abs(ours(ids).logits - expected).max().item() < 1e-4 * scale, folder
            predicted.append(theirs(tokens)[:, -1].argmax(-1))
        assert mx.mean(predicted[0] == predicted[1]).item() >= agree, mix
        assert len(set(predicted[0].tolist())) > 100  # not one token over and over
