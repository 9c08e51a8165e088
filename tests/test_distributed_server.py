"""The server with its target sharded over 2 ranks (`mlx.launch`, ring backend on loopback,
CPU): rank 0 serves the openai client and the ranks stay in step through plain, prompt lookup
and draft model requests, streamed or not, sampled, and cancelled; the answers are the
single-process server's. A rank that dies or hangs ends the server instead of hanging it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from mlx_speculate.drafters import DraftModelSpec

from .serving import load_cached, serve
from .test_cli import tiny_folder
from .test_distributed import LAUNCH, ROOT, free_port
from .test_server_cli import wait_for_url

METHODS = ("none", "prompt_lookup", "draft_model")
PROMPT = "w1 w2 w3 w4 w1 w2"
LINUX = pytest.mark.skipif(
    not Path("/proc/self/environ").exists(), reason="finds each rank's process through /proc"
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dist-server")
    return tiny_folder(root / "target", 128), tiny_folder(root / "draft", 128, seed=1)


def complete(client: openai.OpenAI, method: str, stream: bool = False, **options) -> str:
    options = {"max_tokens": 16, "temperature": 0, **options}
    extra = {"speculative": {"method": method}}
    answer = client.completions.create(
        model="target", prompt=PROMPT, stream=stream, extra_body=extra, **options
    )
    if not stream:
        return answer.choices[0].text
    return "".join(chunk.choices[0].text for chunk in answer)


@pytest.fixture(scope="module")
def reference(folders) -> dict[str, str]:
    """The single-process server's greedy answer per method."""
    target, draft = folders
    model, tokenizer = load_cached(target)
    spec = DraftModelSpec(model=draft)
    with serve(model, tokenizer, spec, model_id="target") as running:
        client = running.client()
        return {method: complete(client, method) for method in METHODS}


@contextmanager
def sharded_server(*flags: str) -> Iterator[tuple[subprocess.Popen, openai.OpenAI]]:
    """`mlx.launch` of the server over 2 ranks, in its own process group (killed at the end
    whatever happened); yields the launch process and a client of rank 0."""
    command = [
        str(LAUNCH), "--backend", "ring", "-n", "2", "--hosts", "127.0.0.1",
        "--starting-port", str(free_port(2)), "--cwd", str(ROOT), "--",
        sys.executable, "-m", "mlx_speculate.server", "--port", "0", "--rank-timeout", "120",
        *flags,
    ]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        start_new_session=True,
    )  # fmt: skip
    try:
        url = wait_for_url(process, timeout=300)
        yield process, openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def rank_pid(process: subprocess.Popen, rank: int) -> int:
    """The pid of `rank`'s server under the `mlx.launch` `process` (its session)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) != process.pid:
                continue
            command = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ProcessLookupError):
            continue
        if b"mlx_speculate.server" in command and f"MLX_RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no server process of rank {rank}")


def ended(process: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """The launch's exit status and stderr, once it ended by itself within `timeout`."""
    try:
        _, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the sharded server did not end within {timeout:g} s")
    return process.returncode, err


@LINUX
def test_tensor_parallel_server_answers_like_one_process(folders, reference):
    target, draft = folders
    with sharded_server("--model", str(target), "--draft-model", str(draft)) as (process, client):
        assert client.models.list().data[0].speculative_methods == list(METHODS)
        for method in METHODS:
            assert complete(client, method) == reference[method], method
            assert complete(client, method, stream=True) == reference[method], method
        # Unseeded sampling: rank 0 fixes the seed every rank samples with.
        assert complete(client, "draft_model", temperature=1.0)
        # A client that leaves mid-stream: every rank stops at the same token.
        extra = {"speculative": {"method": "draft_model"}}
        stream = client.completions.create(
            model="target", prompt=PROMPT, max_tokens=64, stream=True, extra_body=extra
        )
        next(iter(stream))
        stream.close()
        # Still in step: the same greedy answers as before.
        for method in METHODS:
            assert complete(client, method) == reference[method], method
        os.kill(rank_pid(process, 0), signal.SIGTERM)  # rank 0 stops the others
        status, err = ended(process, 60)
    assert status == 0, err
    assert "Sharded: tensor parallel over 2 ranks" in err


def test_pipeline_parallel_server_answers_like_one_process(folders, reference):
    target, draft = folders
    flags = ("--model", str(target), "--draft-model", str(draft), "--parallel", "pipeline")
    with sharded_server(*flags) as (_, client):
        for method in ("none", "draft_model"):
            assert complete(client, method, stream=True) == reference[method], method


@LINUX
def test_a_rank_that_dies_ends_the_server(folders):
    with sharded_server("--model", str(folders[0])) as (process, client):
        os.kill(rank_pid(process, 1), signal.SIGKILL)
        _, err = ended(process, 60)  # mlx.launch stops rank 0 (and exits 0 all the same)
    assert "rank 1" in err, err


@LINUX
def test_a_rank_that_hangs_ends_the_server_with_one_line(folders):
    flags = ("--model", str(folders[0]), "--rank-timeout", "10")
    with sharded_server(*flags) as (process, client):
        follower = rank_pid(process, 1)
        os.kill(follower, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(openai.APIError):  # rank 0 ends while sharing the request
            complete(client, "none")
        assert time.monotonic() - start < 60
        os.kill(follower, signal.SIGCONT)  # for mlx.launch to stop it
        _, err = ended(process, 60)
    assert "error: rank 0: no step finished in 10 s: another rank died or hangs" in err
