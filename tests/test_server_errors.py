"""Every bad request gets its status and an OpenAI-shaped error body, and the server lives on:
bad JSON and values, unknown model, prompts past the context, oversized bodies, API keys,
requests while loading, a failed load, and a generation that raises."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from mlx_speculate.sequence import Sequence

from .helpers import MODELS
from .serving import load_cached, serve

CHAT = {"model": "stories", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
TEXT = {"model": "stories", "prompt": "Once", "max_tokens": 2}


@pytest.fixture(scope="module")
def stories():
    return load_cached(MODELS / "stories260K-llama")


@pytest.fixture(scope="module")
def server(stories):
    with serve(*stories, api_key="sesame", max_body=4096) as running:
        yield running


def post(running, path: str, body=None, *, key: str | None = "sesame", **kwargs):
    headers = kwargs.pop("headers", {})
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(f"{running.url}{path}", json=body, headers=headers, timeout=60, **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None = None, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


@pytest.mark.parametrize(
    ("path", "change", "param"),
    [
        ("/v1/chat/completions", {"temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {"temperature": -0.5}, "temperature"),
        ("/v1/chat/completions", {"temperature": 2.5}, "temperature"),
        ("/v1/chat/completions", {"top_p": 0}, "top_p"),
        ("/v1/chat/completions", {"top_p": 1.5}, "top_p"),
        ("/v1/chat/completions", {"top_k": -1}, "top_k"),
        ("/v1/chat/completions", {"min_p": 1.0}, "min_p"),
        ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"max_tokens": "9"}, "max_tokens"),
        ("/v1/chat/completions", {"max_completion_tokens": -3}, "max_completion_tokens"),
        ("/v1/chat/completions", {"n": 2}, "n"),
        ("/v1/chat/completions", {"seed": -1}, "seed"),
        ("/v1/chat/completions", {"stream": "yes"}, "stream"),
        ("/v1/chat/completions", {"stop": ""}, "stop"),
        ("/v1/chat/completions", {"stop": ["a"] * 17}, "stop"),
        ("/v1/chat/completions", {"stop": 3}, "stop"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": "Hi"}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "robot", "content": "x"}]},
            "messages.0.role",
        ),
        ("/v1/chat/completions", {"top_logprobs": 2}, None),  # needs logprobs: true
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"presence_penalty": 0.5}, "presence_penalty"),
        ("/v1/chat/completions", {"logit_bias": {"5": 1.0}}, "logit_bias"),
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools.0.function"),
        # The stories model has no chat template, so no way to be told about tools.
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function", "function": {"name": "f"}}]},
            "tools",
        ),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
        ("/v1/chat/completions", {"model": None}, "model"),
        (
            "/v1/chat/completions",
            {"speculative": {"num_draft_tokens": 0}},
            "speculative.num_draft_tokens",
        ),
        ("/v1/chat/completions", {"speculative": {"method": "medusa"}}, "speculative.method"),
        (
            "/v1/chat/completions",
            {"speculative": {"method": "none", "num_draft_tokens": 2}},
            "speculative.num_draft_tokens",
        ),
        (
            "/v1/chat/completions",
            {"speculative": {"method": "prompt_lookup", "num_draft_tokens": 99}},
            "speculative.num_draft_tokens",
        ),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [1, 9999]}, "prompt"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"echo": True}, "echo"),
    ],
)
def test_bad_values_are_400_naming_the_field(server, path, change, param):
    body = {**(CHAT if "chat" in path else TEXT), **change}
    assert_error(post(server, path, body), 400, param)


def test_malformed_and_missing_bodies_are_400(server):
    for content in (b'{"model": "stories", "messages": [', b"not json", b"[1, 2]"):
        response = httpx.post(
            f"{server.url}/v1/chat/completions",
            content=content,
            headers={"Authorization": "Bearer sesame", "Content-Type": "application/json"},
        )
        assert_error(response, 400)
    assert_error(post(server, "/v1/completions"), 400, code="invalid_json")


def test_unknown_model_is_404(server):
    client = server.client(api_key="sesame")
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(**{**CHAT, "model": "gpt-4o"})
    assert error.value.body["code"] == "model_not_found" and error.value.body["param"] == "model"


def test_prompt_past_the_context_is_400(server, stories):
    model, _ = stories
    tokens = [1] + [300] * model.args.max_position_embeddings
    with pytest.raises(openai.BadRequestError) as error:
        server.client(api_key="sesame").completions.create(model="stories", prompt=tokens)
    assert error.value.body["code"] == "context_length_exceeded"
    assert "context of 512" in error.value.body["message"]


def test_body_over_the_limit_is_413(server):
    big = {**TEXT, "prompt": "word " * 2000}
    assert_error(post(server, "/v1/completions", big), 413, code="request_too_large")

    def chunked():  # no Content-Length: counted as it arrives
        yield b'{"model": "stories", "prompt": "'
        for _ in range(100):
            yield b"x" * 100
        yield b'"}'

    response = httpx.post(
        f"{server.url}/v1/completions",
        content=chunked(),
        headers={"Authorization": "Bearer sesame", "Content-Type": "application/json"},
    )
    assert_error(response, 413, code="request_too_large")


def test_api_key(server):
    for key in (None, "wrong", "sesame2"):
        assert_error(
            post(server, "/v1/chat/completions", CHAT, key=key), 401, code="invalid_api_key"
        )
    assert_error(httpx.get(f"{server.url}/v1/models"), 401)
    basic = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Basic c2VzYW1l"})
    assert_error(basic, 401)
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    assert server.client(api_key="sesame").models.list().data[0].id == "stories"
    assert post(server, "/v1/chat/completions", CHAT).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key
    # /metrics stays open too, as vLLM leaves it (the --api-key help says so).
    metrics = httpx.get(f"{server.url}/metrics")
    assert metrics.status_code == 200 and "mlx_speculate_requests_total" in metrics.text


def test_unknown_route_and_method(server):
    assert_error(httpx.get(f"{server.url}/v2/nothing"), 404)
    assert_error(httpx.get(f"{server.url}/v1/chat/completions"), 405)


def test_health_is_503_while_loading(stories):
    release = threading.Event()

    def slow_load():
        from mlx_speculate.server.sessions import SessionPool

        release.wait(30)
        return SessionPool(*stories)

    with serve(*stories, load=slow_load) as running:
        health = httpx.get(f"{running.url}/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        assert_error(post(running, "/v1/chat/completions", CHAT), 503, code="model_not_ready")
        assert_error(httpx.get(f"{running.url}/v1/models"), 503)
        release.set()
        assert running.worker.loaded.wait(30)
        assert httpx.get(f"{running.url}/health").json() == {"status": "ok"}
        assert post(running, "/v1/chat/completions", CHAT).status_code == 200


def test_health_is_503_until_calibrated(stories):
    """A loaded model whose calibration (or first steps' build) is under way takes no request
    yet: one accepted then would wait behind it, past a client's timeout on a fresh machine."""
    from mlx_speculate.server.sessions import SessionPool

    release = threading.Event()

    def load():
        pool = SessionPool(*stories)
        pool.calibrate = lambda: release.wait(30)
        return pool

    with serve(*stories, load=load) as running:
        deadline = time.monotonic() + 30
        while running.worker.pool is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert running.worker.pool is not None  # loaded, calibrating
        assert httpx.get(f"{running.url}/health").status_code == 503
        assert_error(post(running, "/v1/chat/completions", CHAT), 503, code="model_not_ready")
        release.set()
        assert running.worker.loaded.wait(30)
        assert httpx.get(f"{running.url}/health").json() == {"status": "ok"}
        assert post(running, "/v1/chat/completions", CHAT).status_code == 200


def test_failed_load_is_reported(stories):
    def broken():
        raise FileNotFoundError("no config.json in /nowhere")

    with serve(*stories, load=broken) as running:
        assert running.worker.loaded.wait(30)
        health = httpx.get(f"{running.url}/health")
        assert health.status_code == 503 and "no config.json" in health.json()["error"]
        error = assert_error(post(running, "/v1/completions", TEXT), 503)
        assert "no config.json" in error["message"]


@pytest.mark.parametrize("max_batch", [1, 8])
def test_a_failing_generation_leaves_the_server_up(stories, monkeypatch, max_batch):
    """A generation that raises (one at a time, or in the batch engine) fails alone."""
    calls = []
    original = Sequence.begin_prefill

    def flaky(self, *args, **kwargs):
        calls.append(1)
        if len(calls) <= 2:
            raise RuntimeError("boom")
        return original(self, *args, **kwargs)

    with serve(*stories, max_batch=max_batch) as running:
        # Patched once loaded: one at a time, the server calibrates its steps before it serves
        # (prefills of its own, which must not take the failures meant for the requests).
        monkeypatch.setattr(Sequence, "begin_prefill", flaky)
        error = assert_error(post(running, "/v1/completions", TEXT, key=None), 500)
        assert "boom" in error["message"] and error["type"] == "server_error"
        with pytest.raises(openai.APIError, match="boom"):
            list(running.client().completions.create(**TEXT, stream=True))
        assert running.client().completions.create(**TEXT).choices[0].finish_reason


def test_a_failure_delivering_a_token_keeps_the_session(stories, monkeypatch):
    """Log-probabilities (the worker's own work after a token) that raise: the request fails,
    the generation stops at that token, and the cache it wrote stays for the next request
    (a sharded server's ranks must keep the same sessions: only rank 0 delivers)."""
    from mlx_speculate.server.worker import Worker

    def broken(self, response, top):
        raise RuntimeError("no log-probabilities")

    monkeypatch.setattr(Worker, "_logprob", broken)
    prompt = {**TEXT, "prompt": "Once upon a time, there was a little girl named Lily."}
    with serve(*stories) as running:
        error = assert_error(post(running, "/v1/completions", {**prompt, "logprobs": 1}), 500)
        assert "no log-probabilities" in error["message"]
        assert len(running.worker.pool) == 1
        usage = running.client().completions.create(**prompt).usage
        assert usage.prompt_tokens_details.cached_tokens > 0
