"""How the server serves: concurrent clients, cancellation on disconnect, the bounded queue,
the prompt-prefix cache across turns, and a soak that keeps memory flat."""

from __future__ import annotations

import gc
import resource
import threading
import time

import httpx
import mlx.core as mx
import openai
import pytest

from mlx_speculate.chat import apply_chat_template
from mlx_speculate.drafters import DraftModelSpec
from mlx_speculate.generation import stream_generate
from mlx_speculate.loading import load

from .helpers import MODELS, assert_clear_argmax
from .serving import load_cached, serve

PROMPTS = [
    "Lily and Tom went to the park.",
    "Once upon a time, there was a little dog",
    "The sun was shining and the birds",
    "Ben had a red ball. He",
    "Mia liked to paint pictures of",
    "One day, a big bear came to",
    "Sam and his mom baked a cake",
    "The little cat was sad because",
]
LONG = 300  # tokens: a few seconds of plain decoding here


@pytest.fixture(scope="module")
def stories():
    return load_cached(MODELS / "stories260K-llama")


@pytest.fixture(scope="module")
def endless(stories):
    """The stories model with a tokenizer that knows no EOS: every generation runs to its
    max_tokens, so long ones can be cut short."""
    model, _ = stories
    _, tokenizer = load(MODELS / "stories260K-llama")
    tokenizer.eos_token_ids = set()
    return model, tokenizer


@pytest.fixture(scope="module")
def draft():
    return load_cached(MODELS / "llama2xs281K-llama")


def greedy(model, tokenizer, tokens: list[int], max_tokens: int) -> tuple[str, list[int]]:
    responses = list(stream_generate(model, tokenizer, tokens, max_tokens=max_tokens))
    generated = [r.token for r in responses]
    assert_clear_argmax(model, tokens, generated)
    return "".join(r.text for r in responses), generated


def test_concurrent_streams_each_get_their_own_answer(endless, draft):
    model, tokenizer = endless
    wanted = [greedy(model, tokenizer, list(tokenizer.encode(p)), 24)[0] for p in PROMPTS]
    methods = ["none", "prompt_lookup", "draft_model"]
    spec = DraftModelSpec(model=draft[0], tokenizer=draft[1])
    with serve(model, tokenizer, spec) as running:
        start = threading.Barrier(len(PROMPTS))
        results: dict[int, tuple[str, set[str], list]] = {}

        def client(i: int) -> None:
            start.wait()
            chunks = running.client().completions.create(
                model="stories",
                prompt=PROMPTS[i],
                max_tokens=24,
                temperature=0,
                stream=True,
                extra_body={"speculative": {"method": methods[i % 3]}},
            )
            chunks = list(chunks)
            text = "".join(c.choices[0].text for c in chunks)
            results[i] = text, {c.id for c in chunks}, [c.choices[0].finish_reason for c in chunks]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert sorted(results) == list(range(len(PROMPTS)))
        for i, (text, ids, finishes) in results.items():
            assert text == wanted[i], PROMPTS[i]
            assert len(ids) == 1 and finishes[-1] == "length" and set(finishes[:-1]) == {None}
        assert len({next(iter(ids)) for _, ids, _ in results.values()}) == len(PROMPTS)
        assert running.metric_reaching(
            "mlx_speculate_requests_total", len(PROMPTS), endpoint="/v1/completions",
            outcome="length",
        ) == len(PROMPTS)  # fmt: skip


def timed_request(running) -> float:
    start = time.perf_counter()
    completion = running.client().completions.create(
        model="stories", prompt="The end", max_tokens=1, temperature=0
    )
    assert completion.choices[0].finish_reason == "length"
    return time.perf_counter() - start


@pytest.fixture(scope="module")
def endless_server(endless):
    with serve(*endless) as running:
        yield running


@pytest.fixture(scope="module")
def long_generation(endless_server) -> float:
    """Seconds one uncancelled LONG-token generation takes here, now."""
    start = time.perf_counter()
    completion = endless_server.client().completions.create(
        model="stories", prompt="Once upon a time", max_tokens=LONG, temperature=0
    )
    assert completion.usage.completion_tokens == LONG
    return time.perf_counter() - start


def cancelled(running) -> float:
    return running.metric(
        "mlx_speculate_requests_total", endpoint="/v1/completions", outcome="cancelled"
    )


def test_killed_stream_stops_its_generation(endless_server, long_generation):
    running = endless_server
    before, generated = (
        cancelled(running),
        running.metric("mlx_speculate_generated_tokens_total", method="none"),
    )
    body = {
        "model": "stories",
        "prompt": "Once upon a time",
        "max_tokens": LONG,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{running.url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert sum(1 for _, line in zip(range(6), lines, strict=False) if line) == 3
    # Killed: the next request waits for at most a step of it, not for the rest of it.
    assert timed_request(running) < long_generation / 4
    assert cancelled(running) == before + 1
    spent = running.metric("mlx_speculate_generated_tokens_total", method="none") - generated
    assert 3 <= spent - 1 < LONG


def unavailable(running) -> float:
    return running.metric("mlx_speculate_requests_total", endpoint="/v1/completions", outcome="503")


def test_disconnect_cancels_a_whole_response(endless_server, long_generation):
    running = endless_server
    before, refused = cancelled(running), unavailable(running)
    body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": LONG, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{running.url}/v1/completions", json=body, timeout=long_generation / 8)
    assert timed_request(running) < long_generation / 4
    assert cancelled(running) == before + 1
    assert unavailable(running) == refused  # counted once: not as a 503 too


@pytest.mark.parametrize("max_batch", [1, 8])
def test_generations_ended_by_shutdown_say_so(endless, max_batch):
    """At the shutdown deadline the server cancels what still runs or waits (what SIGTERM
    leads to): each whole request gets a 503 with code server_shutdown, a stream an error
    event with that code, and each is counted once in /metrics. One at a time the two whole
    requests wait in the queue; in a batch they run beside the stream."""
    with serve(*endless, max_batch=max_batch) as running:
        client = running.client()
        args = dict(model="stories", prompt="Once upon a time", max_tokens=LONG, temperature=0)
        stream = client.completions.create(**args, stream=True)
        chunks = iter(stream)
        next(chunks)  # generating now
        errors: list = []

        def whole() -> None:
            with pytest.raises(openai.APIStatusError) as error:
                client.completions.create(**args)
            errors.append((error.value.status_code, error.value.response.json()["error"]))

        waiting = [threading.Thread(target=whole) for _ in range(2)]
        for thread in waiting:
            thread.start()
        deadline = time.monotonic() + 30
        metric = "mlx_speculate_queue_depth" if max_batch == 1 else "mlx_speculate_batch_size"
        while running.metric(metric) < (2 if max_batch == 1 else 3):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        running.worker.cancel_all()
        with pytest.raises(openai.APIError) as ended:
            for _ in chunks:
                pass
        assert "shutting down" in str(ended.value)
        for thread in waiting:
            thread.join(60)
        assert [(status, e["code"], e["type"]) for status, e in errors] == [
            (503, "server_shutdown", "server_error")
        ] * 2
        assert unavailable(running) == 2
        labels = {"endpoint": "/v1/completions", "outcome": "cancelled"}
        assert running.metric_reaching("mlx_speculate_requests_total", 1, **labels) == 1


@pytest.mark.parametrize("max_batch", [1, 2])
def test_full_queue_answers_429(endless, max_batch):
    """Past the requests decoding (one at a time: one; in a batch: the batch) and `max_queue`
    waiting (queued, or prefilled and waiting for a row), a request gets 429 with Retry-After;
    the waiting one is served once the running ones end."""
    with serve(*endless, max_queue=1, max_batch=max_batch) as running:
        client = running.client()
        args = dict(model="stories", prompt="Once upon a time", max_tokens=LONG, temperature=0)
        streams = [client.completions.create(**args, stream=True)]
        next(iter(streams[0]))  # generating now
        deadline = time.monotonic() + 60
        opened: list = []
        for n in range(2, max_batch + 1):
            # The batch's other rows, one at a time, each decoding before the next is sent.
            thread = threading.Thread(
                target=lambda: opened.append(client.completions.create(**args, stream=True))
            )
            thread.start()
            while running.worker.state.decoding < n:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        waiting: list = []
        thread = threading.Thread(
            target=lambda: waiting.append(
                client.chat.completions.create(
                    model="stories",
                    messages=[{"role": "user", "content": "Hi"}],
                    max_tokens=2,
                    temperature=0,
                )
            )
        )
        thread.start()
        while running.metric("mlx_speculate_queue_depth") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(**args)
        assert refused.value.status_code == 429
        assert refused.value.response.headers["retry-after"] == "1"
        error = refused.value.response.json()["error"]
        assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
        for stream in [*streams, *opened]:  # their clients leave
            stream.close()
        thread.join(60)
        assert waiting and waiting[0].choices[0].message.content  # served after all
        assert timed_request(running) < 30


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_next_turn_reuses_the_conversation_cache(stories):
    model, tokenizer = stories
    turn1 = [{"role": "user", "content": PROMPTS[0]}]
    with serve(model, tokenizer) as running:
        client = running.client()

        def ask(messages, **kwargs):
            completion = client.chat.completions.create(
                model="stories", messages=messages, max_tokens=20, temperature=0, **kwargs
            )
            return completion.choices[0].message.content, completion.usage

        answer1, usage1 = ask(turn1)
        assert usage1.prompt_tokens_details.cached_tokens == 0
        assert running.metric("mlx_speculate_prefix_cache_hits_total") == 0
        turn2 = [
            *turn1,
            {"role": "assistant", "content": answer1},
            {"role": "user", "content": "They saw a big dog."},
        ]
        tokens1, tokens2 = (apply_chat_template(tokenizer, m) for m in (turn1, turn2))
        _, generated1 = greedy(model, tokenizer, tokens1, 20)
        answer2, usage2 = ask(turn2)
        context1 = tokens1 + generated1
        # The cache held turn 1's prompt and its answer but the pending last token.
        reusable = min(common_prefix(context1, tokens2), len(tokens2) - 1, len(context1) - 1)
        assert reusable >= len(tokens1)
        assert usage2.prompt_tokens_details.cached_tokens == reusable
        assert running.metric("mlx_speculate_prefix_cache_hits_total") == 1
        assert running.metric("mlx_speculate_cached_prompt_tokens_total") == reusable
        assert answer2 == greedy(model, tokenizer, tokens2, 20)[0]

        # Another conversation takes a session of its own: turn 3 still finds turn 2's cache.
        other, _ = ask([{"role": "user", "content": PROMPTS[1]}])
        turn3 = [
            *turn2,
            {"role": "assistant", "content": answer2},
            {"role": "user", "content": "The dog ran."},
        ]
        _, usage3 = ask(turn3)
        assert usage3.prompt_tokens_details.cached_tokens > len(tokens2) - 2
        assert len(running.worker.pool) == 2


def test_one_session_keeps_one_conversation(stories):
    model, tokenizer = stories
    with serve(model, tokenizer, max_sessions=1) as running:
        client = running.client()

        def ask(prompt: str):
            completion = client.completions.create(
                model="stories", prompt=prompt, max_tokens=8, temperature=0
            )
            return completion.choices[0].text, completion.usage.prompt_tokens_details

        for prompt in (PROMPTS[2], PROMPTS[3], PROMPTS[2]):
            # Each one evicted the other's cache: only the first token (BOS) is ever shared.
            assert ask(prompt)[1].cached_tokens <= 1
        assert len(running.worker.pool) == 1
        # A prompt that is a prefix of what is cached reuses it, and gets the answer a fresh
        # model gives: nothing of the longer context leaks into it.
        shorter = PROMPTS[2][: PROMPTS[2].index(" and")]
        tokens = list(tokenizer.encode(shorter))
        text, details = ask(shorter)
        assert details.cached_tokens == len(tokens) - 1
        assert text == greedy(model, tokenizer, tokens, 8)[0]


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_soak_keeps_memory_flat_and_the_server_up(stories, draft):
    model, tokenizer = stories
    spec = DraftModelSpec(model=draft[0], tokenizer=draft[1])
    methods = ["none", "prompt_lookup", "draft_model"]
    with serve(model, tokenizer, spec) as running:
        client = running.client()

        def burst(first: int, count: int) -> None:
            for i in range(first, first + count):
                prompt = f"{PROMPTS[i % len(PROMPTS)]} {i}"
                extra = {"speculative": {"method": methods[i % 3]}}
                if i % 4 == 0:
                    chunks = client.chat.completions.create(
                        model="stories",
                        messages=[{"role": "user", "content": prompt}],
                        max_tokens=6,
                        temperature=0.7,
                        stream=True,
                        extra_body=extra,
                    )
                    assert [c.choices[0].finish_reason for c in chunks][-1] is not None
                elif i % 4 == 1:
                    with pytest.raises(openai.BadRequestError):  # bad input, now and then
                        client.completions.create(model="stories", prompt=prompt, top_p=0)
                else:
                    completion = client.completions.create(
                        model="stories",
                        prompt=prompt,
                        max_tokens=6,
                        temperature=0,
                        extra_body=extra,
                    )
                    assert completion.choices[0].finish_reason in ("stop", "length")

        burst(0, 60)  # warm: every method's sessions and the allocator's buffers
        gc.collect()
        active, peak_rss = mx.get_active_memory(), rss_mb()
        burst(60, 240)
        gc.collect()
        assert mx.get_active_memory() - active < 1e6  # bytes: the sessions' caches are bounded
        assert rss_mb() - peak_rss < 40
        assert len(running.worker.pool) <= 4
        assert httpx.get(f"{running.url}/health").status_code == 200


def health_latencies(url: str, busy: threading.Thread) -> list[float]:
    """Seconds each GET /health took, polled (a real client) for as long as `busy` runs."""
    latencies = []
    with httpx.Client(timeout=60) as client:
        while busy.is_alive():
            start = time.perf_counter()
            assert client.get(f"{url}/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.05)
    return latencies


def test_a_big_prompt_holds_up_neither_health_nor_streams(endless_server):
    """A megabyte of prompt takes seconds to tokenize (then a 400: past the context); it is
    tokenized off the event loop, so /health answers and a running stream keeps coming."""
    running = endless_server
    client = running.client()
    arrivals: list[float] = []
    stream = client.completions.create(
        model="stories", prompt="Once upon a time", max_tokens=LONG, temperature=0, stream=True
    )
    chunks = iter(stream)
    next(chunks)  # generating now

    def read_stream() -> None:
        for _ in chunks:
            arrivals.append(time.perf_counter())

    refused = []

    def big_request() -> None:
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model="stories", prompt=PROMPTS[1] * 25_000, max_tokens=1)
        refused.append(error.value.response.json()["error"]["code"])

    reader = threading.Thread(target=read_stream)
    big = threading.Thread(target=big_request)
    reader.start()
    big.start()
    latencies = health_latencies(running.url, big)
    reader.join(120)
    assert refused == ["context_length_exceeded"]
    assert len(latencies) >= 3 and max(latencies) < 2.0, latencies
    assert len(arrivals) == LONG  # the stream's own chunks after the first, and its finish
    assert max(b - a for a, b in zip(arrivals, arrivals[1:], strict=False)) < 2.0


def test_thousands_of_tools_hold_up_no_one(tokenizer_path):
    """3,000 tools under tool_choice "required": the template and the grammar of the calls
    take seconds, off the event loop (then a 400: the prompt is past the context)."""
    from .scripted import scripted

    model, tokenizer = scripted(tokenizer_path, "hermes")
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": f"Does thing number {i}",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
                    "required": ["a"],
                },
            },
        }
        for i in range(3000)
    ]
    with serve(model, tokenizer, model_id="scripted") as running:
        refused = []

        def many_tools() -> None:
            with pytest.raises(openai.BadRequestError) as error:
                running.client().chat.completions.create(
                    model="scripted",
                    messages=[{"role": "user", "content": "Hi"}],
                    tools=tools,
                    tool_choice="required",
                    max_tokens=4,
                )
            refused.append(error.value.response.json()["error"]["code"])

        busy = threading.Thread(target=many_tools)
        busy.start()
        latencies = health_latencies(running.url, busy)
        assert refused == ["context_length_exceeded"]
        assert len(latencies) >= 3 and max(latencies) < 2.0, latencies


@pytest.fixture(scope="module")
def tokenizer_path():
    return MODELS / "stories260K-llama"


class SlowPrefill:
    """The model with each prefill chunk slowed by `delay` seconds per token (a slow machine:
    the default model without a BLAS took 31.7 s over a 256-token chunk)."""

    def __init__(self, model, delay: float):
        self._model = model
        self.delay = delay
        self.started = threading.Event()  # a prefill chunk began

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, tokens, *args, **kwargs):
        if tokens.shape[1] > 1:
            self.started.set()
            time.sleep(self.delay * tokens.shape[1])
        return self._model(tokens, *args, **kwargs)


def test_a_client_leaving_during_prefill_frees_the_worker_within_a_short_chunk(stories):
    """20 ms a token: a 256-token chunk would hold the worker 5 s after its client left. The
    server's chunks are sized to about CANCEL_SECONDS, so the next request is served soon."""
    model, tokenizer = stories
    slow = SlowPrefill(model, 0.02)
    with serve(slow, tokenizer) as running:
        prompt = [1] + [tokenizer.encode("dog")[-1]] * 480
        body = {"model": "stories", "prompt": prompt, "max_tokens": 4, "stream": True}
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", f"{running.url}/v1/completions", json=body):
                assert slow.started.wait(60)  # the first chunk runs: leave now
        left = time.perf_counter()
        completion = running.client().completions.create(
            model="stories", prompt="Once", max_tokens=2, temperature=0
        )
        assert completion.choices[0].finish_reason in ("stop", "length")
        assert time.perf_counter() - left < 2.0
        labels = {"endpoint": "/v1/completions", "outcome": "cancelled"}
        assert running.metric_reaching("mlx_speculate_requests_total", 1, **labels) == 1
