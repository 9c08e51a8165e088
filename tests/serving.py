"""A real server for tests: uvicorn on a free loopback port, in a thread of the test process,
so that tests share loaded models; the real `openai` client talks to it."""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import uvicorn

from mlx_speculate.loading import load
from mlx_speculate.server.app import create_app
from mlx_speculate.server.metrics import Metrics
from mlx_speculate.server.sessions import SessionPool
from mlx_speculate.server.worker import Worker

load_cached = functools.lru_cache(load)


@dataclass
class Running:
    url: str  # http://127.0.0.1:PORT
    worker: Worker
    metrics: Metrics

    def client(self, **kwargs) -> openai.OpenAI:
        kwargs = {"api_key": "unused", "max_retries": 0, "timeout": 120, **kwargs}
        return openai.OpenAI(base_url=f"{self.url}/v1", **kwargs)

    def metric(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels or None)
        return 0.0 if value is None else value

    def metric_reaching(self, name: str, value: float, **labels: str) -> float:
        """The metric once it reaches `value`, or after 5 s: a stream is counted right after
        its last chunk went out, so its client may have read the end before."""
        deadline = time.monotonic() + 5
        while self.metric(name, **labels) < value and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.metric(name, **labels)


@contextmanager
def serve(
    model, tokenizer, spec=None, *, model_id: str = "stories", load=None, **options
) -> Iterator[Running]:
    """Serves `model` (or what `load` returns) until the block ends; `options` go to
    `create_app` (api_key, max_body), `Worker` (max_queue, max_batch) and `SessionPool`
    (max_sessions)."""
    max_sessions = options.pop("max_sessions", 4)
    max_queue = options.pop("max_queue", 16)
    max_batch = options.pop("max_batch", 8)
    metrics = Metrics()
    worker = Worker(
        load or (lambda: SessionPool(model, tokenizer, spec, max_sessions)),
        metrics,
        max_queue,
        max_batch=max_batch,
    )
    app = create_app(worker, model_id, metrics, **options)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        if load is None:
            assert worker.loaded.wait(60) and worker.pool is not None
        yield Running(f"http://127.0.0.1:{port}", worker, metrics)
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "the server did not stop"


def sse_events(response: httpx.Response) -> list[dict | str]:
    """The `data:` payloads of a server-sent event stream: dicts, and "[DONE]" as is."""
    events: list[dict | str] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected line in the stream: {line!r}"
    return events


def sse_lines(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each event of a named-event stream (Anthropic's)."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            assert name is not None, f"data without an event name: {line!r}"
            events.append((name, json.loads(line.removeprefix("data: "))))
            name = None
        else:
            assert line == "", f"unexpected line in the stream: {line!r}"
    return events
