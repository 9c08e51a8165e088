"""HTTP servers for the benchmarks: ours and mlx_lm.server as subprocesses on 127.0.0.1, and
streamed greedy chat requests sent to them through the `openai` client, one or many at once.

A server's stderr goes to a temporary file (a pipe nobody reads fills up and stalls a server
that logs every request); its tail is shown when the server fails to start or a request
fails. The servers import
this checkout's package (its root leads PYTHONPATH), so a run measures the code beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT = 900  # seconds: loading, converting nothing, and our server's calibration

TOPICS = (
    "a lighthouse keeper who finds a message in a bottle",
    "a robot learning to bake bread",
    "two friends crossing a desert on camels",
    "a dragon who is afraid of the dark",
    "a girl who builds a boat out of old doors",
    "a lost kitten in a big city",
    "an astronaut repairing a satellite",
    "a village that wakes up to find the river gone",
    "a musician whose violin plays by itself",
    "a fox and a crow sharing a winter",
    "a boy who can talk to trees",
    "a train that never stops",
    "a chef cooking for a king",
    "a library where the books rearrange themselves",
    "a turtle who wants to fly",
    "a storm over a fishing town",
)


def stories(tag: str, clients: int) -> list[list[dict]]:
    """`clients` distinct chat prompts, each asking for a story on its own topic; `tag` keeps
    them apart from every other request's, so that no prefix cache serves one from another."""
    if clients > len(TOPICS):
        raise SystemExit(f"at most {len(TOPICS)} clients (one topic each)")
    return [
        [
            {"role": "system", "content": f"Session {tag}.{i}. You are a helpful storyteller."},
            {"role": "user", "content": f"Write a long story about {topic}."},
        ]
        for i, topic in enumerate(TOPICS[:clients])
    ]


PARAGRAPHS = (
    "The comittee met on tuesday to discus the new librery budget. After a long debate, they "
    "agreed to by more books for the childrens section and to fix the leeking roof before the "
    "winter. The mayor thanked evryone for there hard work and promissed to visit the librery "
    "next month.",
    "Our familly went to the beach last sumer. We bilt a huge sand castle with towers and a "
    "moat, and my little brother found a crab hiding under a rock. In the evening we ate fish "
    "and chips and watched the sun go down behind the lighthouse untill it was compleetly dark.",
)


def copy_heavy(tag: str | None, clients: int) -> list[list[dict]]:
    """`clients` requests to return a paragraph with its typos fixed (copy-heavy: what prompt
    lookup speeds up), the paragraphs in turn; `tag` (a system line) keeps them apart from
    every other request's in a prefix cache."""
    system = [] if tag is None else [{"role": "system", "content": f"Session {tag}."}]
    return [
        system + [{"role": "user", "content": "Fix the typos in this paragraph and return it "
                   f"otherwise unchanged:\n\n{PARAGRAPHS[i % len(PARAGRAPHS)]}"}]
        for i in range(clients)
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ours(model: Path, *flags: str) -> list[str]:
    """The command line of our server on `model`."""
    return [sys.executable, "-m", "mlx_speculate.server", "--model", str(model), *flags]


# mlx_lm.server listens through socketserver, whose listen backlog of 5 resets the connections
# of a burst of more clients than that before its accept loop drains them; this launch raises
# the backlog, so that a burst measures its batching rather than the resets.
BACKLOG = 128
THEIR_LAUNCH = (
    f"import socketserver; socketserver.TCPServer.request_queue_size = {BACKLOG}; "
    "from mlx_lm.server import main; main()"
)


def theirs(model: Path, *flags: str) -> list[str]:
    """The command line of mlx-lm's server on `model` (it batches plain decoding), its listen
    backlog raised to BACKLOG."""
    return [sys.executable, "-c", THEIR_LAUNCH, "--model", str(model), *flags]


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with this checkout's root first on
    PYTHONPATH, so that `python -m mlx_speculate.server` runs the code beside the script."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def blas_env(openblas: str | None, ours_blas: str) -> tuple[dict[str, str], str]:
    """The servers' environment (server_env()), with the OpenBLAS at `openblas` preloaded in
    every server when given, and in words which BLAS each server multiplies with (`ours_blas`:
    what importing the package loads)."""
    env = server_env()
    if openblas:
        env["LD_PRELOAD"] = openblas
        return env, f"OpenBLAS ({openblas}) in every server"
    if "LD_PRELOAD" in env:
        return env, f"LD_PRELOAD={env['LD_PRELOAD']} in every server"
    return env, f"ours: {ours_blas}; mlx-lm: the MLX wheel's (--openblas loads OpenBLAS in both)"


class Server:
    """A server subprocess on 127.0.0.1, ready once GET /v1/models answers 200 (ours answers
    503 there until its model is loaded and calibrated)."""

    def __init__(self, name: str, command: list[str], model: str, env: dict[str, str]):
        self.name = name
        self.model = model  # the id requests name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.command = [*command, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            self.command, env=env, stdout=subprocess.DEVNULL, stderr=self.log, text=True
        )
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.process.poll() is not None:
                raise SystemExit(f"{name} exited with status {self.process.returncode}: "
                                 f"{self.tail()}")
            try:
                if httpx.get(f"{self.url}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                tail = self.tail()
                self.stop()
                raise SystemExit(f"{name} did not answer within {START_TIMEOUT} s: {tail}")
            time.sleep(0.2)

    def tail(self, size: int = 2000) -> str:
        self.log.seek(0)
        return self.log.read()[-size:]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


@contextmanager
def started(env: dict[str, str], **commands: tuple[list[str], str]) -> Iterator[dict[str, Server]]:
    """The servers `commands` name ((command, model id) each), stopped on the way out, also
    when a later one fails to start."""
    servers: dict[str, Server] = {}
    try:
        for name, (command, model) in commands.items():
            servers[name] = Server(name, command, model, env)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@dataclass(frozen=True)
class Reply:
    """One streamed chat completion as the client saw it."""

    text: str
    ttft: float  # seconds from sending the request to the first content delta
    seconds: float  # from sending the request to the stream's end
    completion_tokens: int  # as the server's usage reports them
    cached_tokens: int  # prompt tokens the server's prefix cache saved (0 when not reported)
    finish_reason: str | None
    speculative: dict | None  # our server's usage.speculative (None from mlx-lm)


def client(server: Server):
    """An async openai client for `server`: no retries (a failed request is a failed
    measurement), a timeout a loaded 2-core machine does not reach."""
    import openai

    return openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=1800)


async def chat(
    openai_client, server: Server, messages: list[dict], max_tokens: int, extra_body=None
) -> Reply:
    """One streamed greedy chat completion, with its usage."""
    start = time.perf_counter()
    stream = await openai_client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra_body,
    )
    first, pieces, usage, finish = None, [], None, None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.perf_counter()
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    end = time.perf_counter()
    if usage is None:
        raise SystemExit(f"{server.name} sent no usage (stream_options.include_usage)")
    details = usage.prompt_tokens_details
    return Reply(
        text="".join(pieces),
        ttft=(first or end) - start,
        seconds=end - start,
        completion_tokens=usage.completion_tokens,
        cached_tokens=(details.cached_tokens or 0) if details else 0,
        finish_reason=finish,
        speculative=(usage.model_extra or {}).get("speculative"),
    )


async def _at_once(server: Server, requests: Sequence[dict], max_tokens: int, extra_body):
    async with client(server) as openai_client:
        start = time.perf_counter()
        replies = await asyncio.gather(
            *(chat(openai_client, server, r, max_tokens, extra_body) for r in requests)
        )
        return time.perf_counter() - start, list(replies)


async def _in_turn(server: Server, requests: Sequence[dict], max_tokens: int, extra_body):
    async with client(server) as openai_client:
        start = time.perf_counter()
        replies = [await chat(openai_client, server, r, max_tokens, extra_body) for r in requests]
        return time.perf_counter() - start, replies


def send(
    server: Server,
    conversations: Sequence[list[dict]],
    max_tokens: int,
    concurrent: bool,
    extra_body: dict | None = None,
) -> tuple[float, list[Reply]]:
    """The wall time of sending every conversation (all at once, or each after the previous
    one ended) and the replies in the same order."""
    import openai

    run = _at_once if concurrent else _in_turn
    try:
        return asyncio.run(run(server, conversations, max_tokens, extra_body))
    except openai.APIError as e:
        log = server.tail(600).strip() or "(empty)"
        raise SystemExit(f"{server.name}: {type(e).__name__}: {e}; its log ends: {log}") from None


def check_lengths(server: Server, replies: Sequence[Reply], max_tokens: int, what: str) -> None:
    """Every reply has `max_tokens` completion tokens (a shorter one did less work, and the
    tokens/s of its batch would not compare), else a one-line SystemExit."""
    for i, reply in enumerate(replies):
        if reply.completion_tokens != max_tokens:
            raise SystemExit(
                f"{server.name}, {what}, request {i}: {reply.completion_tokens} completion "
                f"tokens, not {max_tokens} (finish_reason {reply.finish_reason!r}); choose "
                "prompts that run longer, or a smaller --max-tokens"
            )


RESULTS = Path(__file__).resolve().parent / "results"


def write_result(
    benchmark: str,
    fields: dict,
    *,
    command: str,
    blas: str,
    load_start: float,
    versions: dict[str, str],
    model: Path,
    out: Path | None,
) -> Path:
    """Writes a run's JSON (what every HTTP benchmark records about its run, then `fields`)
    to `out`, by default benchmarks/results/<benchmark>-<date>-<device>.json; returns where."""
    import datetime
    import json

    import mlx.core as mx
    from common import describe_machine

    device = "gpu" if mx.default_device().type == mx.gpu else "cpu"
    date = datetime.date.today().isoformat()
    result = {
        "benchmark": benchmark,
        "date": date,
        "command": command,
        "device": device,
        "machine": describe_machine(blas),
        "cores": os.cpu_count() or 1,
        "load": [load_start, os.getloadavg()[0]],
        "versions": versions,
        "model": model.name,
        **fields,
    }
    out = out or RESULTS / f"{benchmark}-{date}-{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return out


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value
