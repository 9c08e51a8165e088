"""The server under concurrent clients (the batch engine), with the real openai client on the
real stories models: concurrent greedy answers equal one-at-a-time ones for every method
served, requests join a running batch, clients that leave mid-stream leave the others
streaming, memory stays flat, and the batch metrics count what ran."""

from __future__ import annotations

import random
import threading
import time
from contextlib import contextmanager

import mlx.core as mx
import pytest

from mlx_speculate.drafters import DraftModelSpec
from mlx_speculate.loading import load

from .helpers import MODELS
from .serving import load_cached, serve
from .test_batch import prefill_members

METHODS = ["none", "prompt_lookup", "draft_model"]
OPENINGS = [
    "Once upon a time, there was a little girl named Lily.",
    "Tom had a big red ball. He liked to play with it in the park.",
    "The sun was hot. Sue and her mom went to the beach.",
    "One day, a little bird was sad. It could not fly.",
    "Ben and Mia found a box. The box was very big.",
    "There was a cat named Tim. Tim liked to nap in the sun.",
    "Lucy wanted to bake a cake for her friend.",
    "A dog named Max ran to the tree. He saw a squirrel.",
]


@pytest.fixture(scope="module")
def stories():
    return load_cached(MODELS / "stories260K-llama")


@pytest.fixture(scope="module")
def server(stories):
    draft, draft_tokenizer = load_cached(MODELS / "llama2xs281K-llama")
    spec = DraftModelSpec(model=draft, tokenizer=draft_tokenizer)
    with serve(*stories, spec, max_batch=8, max_queue=32) as running:
        yield running


def complete(running, prompt: str, method: str, max_tokens: int = 40) -> str:
    completion = running.client().completions.create(
        model="stories",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"speculative": {"method": method}},
    )
    return completion.choices[0].text


def at_once(fn, args: list) -> list:
    """fn(*a) for every a in `args`, each in its own thread, started together."""
    results: list = [None] * len(args)
    errors: list = []
    start = threading.Barrier(len(args))

    def one(i: int) -> None:
        try:
            start.wait(30)
            results[i] = fn(*args[i])
        except Exception as e:  # reported below, with the others' results
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return results


@pytest.mark.parametrize("method", METHODS)
def test_concurrent_greedy_answers_equal_one_at_a_time(server, method):
    alone = [complete(server, p, method) for p in OPENINGS]
    together = at_once(lambda p: complete(server, p, method), [(p,) for p in OPENINGS])
    assert together == alone
    assert server.metric("mlx_speculate_rows_per_forward_count") > 0


def test_a_request_joins_a_running_batch(server):
    """A short request sent while a long one streams ends first: it did not wait."""
    client = server.client()
    order: list[str] = []

    def long() -> None:
        for _ in client.completions.create(
            model="stories", prompt=OPENINGS[0], max_tokens=250, temperature=0, stream=True
        ):
            pass
        order.append("long")

    thread = threading.Thread(target=long)
    thread.start()
    deadline = time.monotonic() + 60
    while server.metric("mlx_speculate_batch_size") < 1:
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.01)
    complete(server, OPENINGS[1], "none", max_tokens=5)
    order.append("short")
    thread.join(120)
    assert order == ["short", "long"]


def test_sixteen_clients_with_disconnects_keep_streaming_and_memory_flat(server, stories):
    """Sixteen streaming clients at once, a random half leaving after a few chunks: every
    client that stays gets its whole answer (its one-at-a-time text) with no gap between
    chunks beyond a generous bound; a second such round holds no more memory than the first."""
    rng = random.Random(0)
    client = server.client()
    alone = {p: complete(server, p, "none", 30) for p in OPENINGS}

    def stream(prompt: str, leave: bool) -> tuple[str, float] | None:
        chunks, text, gap, last = 0, [], 0.0, time.monotonic()
        response = client.completions.create(
            model="stories", prompt=prompt, max_tokens=30, temperature=0, stream=True
        )
        for chunk in response:
            now = time.monotonic()
            gap, last = max(gap, now - last), now
            text.append(chunk.choices[0].text)
            chunks += 1
            if leave and chunks == 3:
                response.close()
                return None
        return "".join(text), gap

    def round_() -> None:
        args = [(OPENINGS[i % 8], rng.random() < 0.5) for i in range(16)]
        for (prompt, leave), result in zip(args, at_once(stream, args), strict=True):
            if not leave:
                text, gap = result
                assert text == alone[prompt]
                assert gap < 60  # a stall, not a measurement

    round_()
    mx.clear_cache()
    before = mx.get_active_memory()
    round_()
    mx.clear_cache()
    assert mx.get_active_memory() <= before * 1.1 + 2**20


@pytest.mark.parametrize("max_batch", [8, 1])
def test_no_request_waits_on_a_calibration(max_batch, monkeypatch, tmp_path):
    """On a machine with no calibration, a server calibrates every method it serves before it
    takes a request (batched too: a request decoding alone follows its method's policy, as one
    at a time); a prompt-lookup request then answers as plain decoding does and calibrates
    nothing itself."""
    monkeypatch.setenv("MLX_SPECULATE_CALIBRATION", str(tmp_path))
    model, tokenizer = load(MODELS / "stories260K-llama")

    def calibrations() -> list[str]:
        return sorted(str(p) for p in tmp_path.rglob("*") if p.is_file())

    with serve(model, tokenizer, max_batch=max_batch) as running:
        before = calibrations()
        assert before, "nothing was calibrated before the first request"
        prompt = OPENINGS[0] + " " + OPENINGS[0]
        assert complete(running, prompt, "prompt_lookup") == complete(running, prompt, "none")
        assert calibrations() == before


def test_a_burst_of_requests_prefills_together(stories, monkeypatch):
    """Requests sent at once reach an idle server a prompt at a time (the gateway prepares one
    after another): the engine waits for the ones still being prepared and prefills their
    prompts in one forward, rather than the first alone and the rest after it. (The first
    prompt's preparation waits until the others have reached the gateway, and the wait for
    the burst is not cut short, so that a loaded machine cannot split it.)"""
    from mlx_speculate.server import app, worker

    prepare, arriving, first = app._text_prompt, worker.Worker.arriving, threading.Event()
    entered: list[int] = []

    @contextmanager
    def counted(self):
        entered.append(1)
        with arriving(self):
            yield

    def slow(*args):
        if not first.is_set():
            first.set()
            deadline = time.monotonic() + 60
            while len(entered) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
        return prepare(*args)

    monkeypatch.setattr(worker.Worker, "arriving", counted)
    monkeypatch.setattr(worker, "GATHER_SECONDS", 60.0)
    monkeypatch.setattr(app, "_text_prompt", slow)
    members = prefill_members(monkeypatch)
    with serve(*stories, max_batch=8) as running:
        at_once(lambda p: complete(running, p, "none", 8), [(p,) for p in OPENINGS[:4]])
    assert members[0] == 4, members
