"""What the command lines and the API say when asked wrongly: one line naming the mistake
(no usage block, no errno), the nearest keyword, a flag that would do nothing refused, a GGUF
found by its magic bytes, and the names the README introduces importable from the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_speculate import Session, generate, make_drafter
from mlx_speculate.drafters import LookupSpec
from mlx_speculate.sampling import SamplingParams
from mlx_speculate.train.__main__ import main as train_main
from mlx_speculate.train.__main__ import parser as train_parser

from .helpers import MODELS, tiny_model
from .markov import StubTokenizer

ROOT = Path(__file__).resolve().parents[1]
STORIES = MODELS / "stories260K-llama"
CLIS = ("generate", "convert", "calibrate", "train", "server")


def cli(module: str, *args: str, cwd: Path = ROOT, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", f"mlx_speculate.{module}", *args], capture_output=True,
        text=True, cwd=cwd, env=env, timeout=600,
    )  # fmt: skip


def only_line(done: subprocess.CompletedProcess) -> str:
    """The one line a user error prints (status 2)."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr and "usage:" not in done.stderr
    return lines[0]


@pytest.mark.parametrize("module", CLIS)
def test_argparse_errors_are_one_line_in_every_cli(module):
    name = f"python -m mlx_speculate.{module}"
    bogus = only_line(cli(module, "--bogus", *(["eagle1"] if module == "train" else [])))
    assert bogus.startswith(f"{name}: error: ")  # the unknown flag, or the required ones
    assert "--bogus" in bogus or "the following arguments are required: " in bogus
    wrong = {"generate": ["-m", "0"], "convert": ["--hf-path", "x", "--mlx-path", "y",
             "--q-bits", "3"], "calibrate": ["--dtype", "x"], "train": ["eagle1", "--model",
             "m", "--out", "o", "--epochs", "0"], "server": ["--port", "70000"]}  # fmt: skip
    line = only_line(cli(module, *wrong[module]))
    assert line.startswith(f"{name}: error: argument "), line


def test_the_help_still_shows_the_usage():
    done = cli("generate", "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m")


def test_every_train_flag_is_described():
    undescribed = [a.option_strings or [a.dest] for a in train_parser()._actions if not a.help]
    assert undescribed == []
    out = cli("train", "--help").stdout
    for text in ("AdamW", "held out", "EAGLE-3: draft steps unrolled", "Medusa: heads"):
        assert text in " ".join(out.split()), text


def test_a_misspelt_keyword_suggests_the_nearest_of_all_keywords():
    model = tiny_model()
    for wrong, right in (("max_token", "max_tokens"), ("stops", "stop"),
                         ("sampling_params", "sampling"), ("num_draft_token", "num_draft_tokens"),
                         ("temprature", "temperature")):  # fmt: skip
        with pytest.raises(TypeError, match=rf"{wrong}' \(did you mean '{right}'\?\)"):
            generate(model, StubTokenizer(), [1, 2, 3], **{wrong: 5})


def test_session_and_make_drafter_work_as_the_readme_uses_them():
    model, tokenizer = tiny_model(seed=1), StubTokenizer()
    prompt = [5, 17, 3, 5, 17, 3, 44, 12, 5, 17, 3]
    drafter = make_drafter(LookupSpec(num_draft_tokens=3), model, tokenizer)
    session = Session(model, tokenizer, drafter)
    tokens = [r.token for r in session.stream(prompt, sampling=SamplingParams(), max_tokens=10)]
    plain = generate(model, tokenizer, prompt, max_tokens=10)
    assert " ".join(map(str, tokens)) == plain.strip()


def test_benchmarks_keep_their_files_where_mlx_speculate_cache_says(tmp_path):
    code = "import common; print(common.CACHE)"
    env = {k: v for k, v in os.environ.items() if k != "MLX_SPECULATE_BENCH_DIR"}
    env["MLX_SPECULATE_CACHE"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT / "benchmarks", env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "cache")
    env["MLX_SPECULATE_BENCH_DIR"] = str(tmp_path / "bench")  # still first where given
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT / "benchmarks", env=env, timeout=300)  # fmt: skip
    assert done.stdout.strip() == str(tmp_path / "bench")


def test_convert_knows_a_gguf_by_its_magic_whatever_its_name(tmp_path, smollm2_file):
    nameless = tmp_path / "smollm2-q4"
    nameless.symlink_to(smollm2_file)
    done = cli("convert", "--hf-path", str(nameless), "--mlx-path", str(tmp_path / "out"), "-q")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith(f"wrote {tmp_path / 'out'} (4-bit")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "llama"
    line = only_line(cli("generate", "--model", str(nameless), "--prompt", "hi"))
    assert "is a GGUF file, not a model folder: convert it first" in line


@pytest.mark.parametrize("flags", [["--q-bits", "8"], ["--q-group-size", "32"],
                                   ["--q-bits", "8", "--q-group-size", "32"]])  # fmt: skip
def test_convert_quantization_settings_need_q(tmp_path, flags):
    src = STORIES
    line = only_line(cli("convert", "--hf-path", str(src), "--mlx-path", str(tmp_path / "o"),
                         *flags))  # fmt: skip
    need = "needs" if len(flags) == 2 else "need"
    assert line.endswith(f"error: {' and '.join(flags[::2])} {need} -q"), line
    assert not (tmp_path / "o").exists()


def test_a_draft_vocabulary_larger_than_the_target_s_is_an_error(tmp_path, capsys):
    src = STORIES
    out = tmp_path / "head"
    code = train_main(["eagle3", "--model", str(src), "--self-samples", "2", "--out", str(out),
                       "--draft-vocab", "100000", "--quiet"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err == (
        "error: draft vocabulary 100000 is larger than the target's vocabulary of 512 tokens "
        "(it must be <= 512)\n"
    )
    assert list(tmp_path.iterdir()) == []  # nothing written, not even the stage cache
    with pytest.raises(SystemExit) as stopped:
        train_main(["eagle1", "--model", str(src), "--out", str(out), "--draft-vocab", "64"])
    assert stopped.value.code == 2
    assert "--draft-vocab applies to eagle3, not eagle1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        train_main(["medusa", "--model", str(src), "--out", str(out), "--taps", "1"])
    assert stopped.value.code == 2
    assert "--taps applies to eagle3 and dflash, not medusa" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        train_main(["eagle3", "--model", str(src), "--out", str(out), "--block-size", "4"])
    assert stopped.value.code == 2
    assert "--block-size applies to dflash, not eagle3" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        train_main(["medusa", "--model", str(src), "--out", str(out), "--anchors", "64"])
    assert stopped.value.code == 2
    assert "--anchors applies to dflash, not medusa" in capsys.readouterr().err


def test_file_system_errors_are_sentences_naming_the_path(tmp_path):
    src = STORIES
    afile = tmp_path / "afile"
    afile.write_text("")
    train = ["medusa", "--model", str(src), "--self-samples", "2", "--quiet"]
    cases = [
        (["--out", str(afile / "x")], f"{afile}/x.cache: {afile} is a file, not a folder"),
        (["--out", str(tmp_path / "o"), "--cache", str(afile)], f"{afile} is a file, not a folder"),
    ]
    for flags, words in cases:
        line = only_line(cli("train", *train, *flags))
        assert line == f"error: {words}" and "Errno" not in line
    prompts = ["medusa", "--model", str(src), "--prompts", str(tmp_path), "--out",
               str(tmp_path / "o2")]  # fmt: skip
    line = only_line(cli("train", *prompts))
    assert line == f"error: cannot read the prompt file: {tmp_path} is a folder, not a file"
