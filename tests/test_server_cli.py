"""`python -m mlx_speculate.server` as users run it: a subprocess that prints its URL once the
model is ready, serves the openai client, and exits 0 on SIGTERM, also mid-stream."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import httpx
import openai
import pytest

from mlx_speculate.chat import apply_chat_template
from mlx_speculate.generation import generate
from mlx_speculate.server.__main__ import main, model_id, model_source

from .helpers import MODELS
from .serving import load_cached


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "mlx_speculate.server", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_url(process: subprocess.Popen, timeout: float = 120) -> str:
    """The URL from the line the server prints once it is ready."""
    found: list[str] = []

    def read() -> None:
        for line in process.stdout:
            if line.startswith("serving "):
                found.append(line.split(" at ")[-1].strip())
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    assert found, f"no URL printed; stderr: {process.stderr.read() if process.poll() else ''}"
    return found[0]


def stop(process: subprocess.Popen, timeout: float = 30) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout)
    finally:
        if process.poll() is None:
            process.kill()


def test_serves_with_a_draft_model_and_stops_cleanly():
    target = MODELS / "stories260K-llama"
    draft = MODELS / "llama2xs281K-llama"
    process = start("--model", str(target), "--draft-model", str(draft), "--shutdown-timeout", "2")
    try:
        url = wait_for_url(process)
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        assert httpx.get(url.removesuffix("/v1") + "/health").json() == {"status": "ok"}
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        model = client.models.list().data[0]
        assert model.id == "stories260K-llama"
        assert model.speculative_methods == ["none", "prompt_lookup", "draft_model"]
        messages = [{"role": "user", "content": "Lily and Tom went to the park."}]
        completion = client.chat.completions.create(
            model=model.id, messages=messages, max_tokens=30, temperature=0
        )
        reference, tokenizer = load_cached(target)
        want = generate(
            reference, tokenizer, apply_chat_template(tokenizer, messages), max_tokens=30
        )
        assert completion.choices[0].message.content == want
        assert completion.usage.speculative["method"] == "draft_model"
        # SIGTERM mid-stream: the stream ends and the process exits 0.
        stream = client.completions.create(
            model=model.id,
            prompt="Once upon a time",
            max_tokens=400,
            temperature=0.8,
            stream=True,
        )
        next(iter(stream))
        started = time.monotonic()
        assert stop(process) == 0
        assert time.monotonic() - started < 20
        try:
            for _ in stream:
                pass
        except (openai.APIError, httpx.HTTPError):
            pass  # cut at the shutdown deadline rather than finished before it
    finally:
        if process.poll() is None:
            process.kill()
    assert "Traceback" not in process.stderr.read()


def test_requests_waiting_at_sigterm_get_a_503_that_says_why():
    """Once a 503 with `code: null`."""
    target = MODELS / "stories260K-llama"
    # One at a time, so that requests wait in the queue (a batch takes them all in; its
    # shutdown: test_server_serving.py's test_generations_ended_by_shutdown_say_so).
    process = start("--model", str(target), "--shutdown-timeout", "0", "--max-batch", "1")
    try:
        url = wait_for_url(process)
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        args = dict(model="stories260K-llama", prompt="Once upon a time", max_tokens=500)
        errors = []

        def ask() -> None:
            try:
                client.completions.create(**args)
            except openai.APIStatusError as error:
                errors.append((error.status_code, error.response.json()["error"]))

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for thread in threads:
            thread.start()
        metrics = url.removesuffix("/v1") + "/metrics"
        deadline = time.monotonic() + 60
        while "mlx_speculate_queue_depth 0.0" in httpx.get(metrics).text:  # none waits yet
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert stop(process) == 0
        for thread in threads:
            thread.join(30)
        assert errors  # at least the ones still waiting
        assert {(status, e["code"], e["type"]) for status, e in errors} == {
            (503, "server_shutdown", "server_error")
        }
    finally:
        if process.poll() is None:
            process.kill()


def test_idle_server_exits_0_on_sigterm():
    process = start("--model", str(MODELS / "stories260K-llama"))
    wait_for_url(process)
    assert stop(process) == 0


def test_a_model_that_does_not_load_exits_1(tmp_path):
    process = start("--model", str(tmp_path))
    try:
        assert process.wait(120) == 1
    finally:
        if process.poll() is None:
            process.kill()
    err = process.stderr.read()
    assert f"no config.json in {tmp_path}" in err and "Traceback" not in err
    assert [line for line in err.splitlines() if line.strip()] == [
        f"error: loading the model failed: no config.json in {tmp_path}"
    ]


def test_bad_flags_exit_2(capsys):
    target = str(MODELS / "stories260K-llama")
    assert main(["--model", target, "--prompt-lookup", "--draft-model", target]) == 2
    assert "error: choose one speculative method" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value, why",
    [
        ("--max-queue", "0", "must be >= 1, got 0"),
        ("--prompt-cache-size", "0", "must be >= 1, got 0"),
        ("--port", "-5", "must be in [0, 65535], got -5"),
        ("--port", "x", "expected a number, got 'x'"),
        ("--max-body-bytes", "-1", "must be >= 1, got -1"),
        ("--shutdown-timeout", "-1", "must be finite and >= 0, got -1"),
    ],
)
def test_bad_values_exit_2_before_loading(capsys, flag, value, why):
    """Each once ended in a traceback, or in a server that could not work, after loading."""
    with pytest.raises(SystemExit) as exit:
        main(["--model", "never/loaded", flag, value])
    assert exit.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith(f"error: argument {flag}: {why}")


def test_missing_chat_template_exits_2(capsys, tmp_path):
    assert main(["--model", "never/loaded", "--chat-template", str(tmp_path / "none.jinja")]) == 2
    assert "none.jinja" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, why",
    [
        ("{% for m in messages %}{{ m.content }}", "is not a Jinja template: line 1"),
        ("{{ messages[0].content }", "is not a Jinja template: line 1"),
        (b"\xff\xfe{{ x }}", "is not UTF-8 text: invalid start byte at byte 0"),
        (None, "is a folder, not a file"),
    ],
    ids=["unclosed-for", "unclosed-expression", "not-utf8", "directory"],
)
def test_a_chat_template_that_is_not_one_exits_2_before_loading(capsys, tmp_path, content, why):
    """Once every chat request got a 400 instead; now the server does not start."""
    path = tmp_path / "template.jinja"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert main(["--model", "never/loaded", "--chat-template", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and why in err and "Traceback" not in err


def test_a_chat_template_that_fails_on_a_conversation_exits_1(tmp_path):
    """A template that parses and raises on every conversation stops the server at load."""
    path = tmp_path / "refuses.jinja"
    path.write_text('{{ raise_exception("this template takes no conversation") }}')
    model = str(MODELS / "stories260K-llama")
    process = start("--model", model, "--chat-template", str(path))
    try:
        assert process.wait(120) == 1
    finally:
        if process.poll() is None:
            process.kill()
    err = process.stderr.read()
    assert "this template takes no conversation" in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.strip()]) == 1


@pytest.mark.parametrize("key", ["", "   "])
def test_an_empty_api_key_exits_2(capsys, key):
    with pytest.raises(SystemExit) as exit:
        main(["--model", "never/loaded", "--api-key", key])
    assert exit.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: argument --api-key: must not be empty" in last


def test_help_says_metrics_stay_open_under_an_api_key():
    from mlx_speculate.server.__main__ import build_parser

    assert "/metrics stay open" in " ".join(build_parser().format_help().split())


@pytest.mark.parametrize("missing", ["fastapi", "uvicorn"])
def test_without_the_server_extra_it_says_how_to_install_it(missing):
    """Without the [server] extra, one line that says what to install, not a traceback."""
    code = (
        f"import sys; sys.modules[{missing!r}] = None; import runpy; "
        "runpy.run_module('mlx_speculate.server', run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    stderr = done.stderr.decode()
    assert done.returncode == 1 and "Traceback" not in stderr
    assert stderr.strip().splitlines() == [
        f"error: the server needs {missing}, which is not installed: "
        'pip install -e ".[server]" (or "mlx_speculate[server]")'
    ]


def test_chat_template_gives_a_model_tools():
    """The stories model has no chat template; given one that takes tools, it takes them."""
    template = Path(__file__).resolve().parent / "templates" / "hermes.jinja"
    process = start(
        "--model", str(MODELS / "stories260K-llama"), "--chat-template", str(template)
    )
    try:
        url = wait_for_url(process)
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        completion = openai.OpenAI(base_url=url, api_key="unused").chat.completions.create(
            model="stories260K-llama",
            messages=[{"role": "user", "content": "Hi"}],
            tools=[tool],
            max_tokens=4,
            temperature=0,
        )
        assert completion.usage.prompt_tokens > 100  # the tools section of the template
    finally:
        assert stop(process) == 0


def test_no_model_serves_the_default_model(monkeypatch):
    folder = MODELS / "stories260K-llama"
    default = types.ModuleType("mlx_speculate.default_model")
    default.default_model_path = lambda: folder
    monkeypatch.setitem(sys.modules, "mlx_speculate.default_model", default)
    assert model_source(None) == str(folder)
    assert model_source("other/model") == "other/model"
    assert model_id(model_source(None)) == "stories260K-llama"
    assert model_id("mlx-community/Qwen2.5-0.5B-Instruct-4bit") == (
        "mlx-community/Qwen2.5-0.5B-Instruct-4bit"
    )
    assert Path(model_source(None)).is_dir()
