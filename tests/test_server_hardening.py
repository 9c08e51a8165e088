"""The server under the peers' stress tests, with the real openai client on tiny models: a
burst the batch can take is taken at the default limits, a batch above 64 sequences runs,
a cancellation storm (vLLM's test_abort) leaves every survivor its whole answer, a drafter
that is almost always rejected (llama.cpp's forced-rejection soak) changes no output and grows
no state, and after traffic the server holds no sequence, no cache row beyond one empty one,
and no more sessions than --prompt-cache-size (SGLang's idle self-check), which its metrics
and GET /debug/state report."""

from __future__ import annotations

import random
import threading
import time

import httpx
import mlx.core as mx
import openai
import pytest

from mlx_speculate.batch import batch_generate
from mlx_speculate.batch.cache import BatchKVCache
from mlx_speculate.drafters import DraftModelSpec
from mlx_speculate.loading import build_model, load
from mlx_speculate.server.__main__ import build_parser

from .helpers import MODELS, greedy_reference, random_weights, tiny_config, tiny_model
from .markov import StubTokenizer
from .serving import load_cached, serve
from .test_batch import DEEP, clear
from .test_hybrid import save_hf
from .test_hybrid_methods import llama_draft
from .test_server_batch import OPENINGS, at_once


@pytest.fixture(scope="module")
def stories():
    return load_cached(MODELS / "stories260K-llama")


@pytest.fixture(scope="module")
def endless(stories):
    """The stories model with a tokenizer that knows no EOS: every generation runs to its
    max_tokens."""
    model, _ = stories
    _, tokenizer = load(MODELS / "stories260K-llama")
    tokenizer.eos_token_ids = set()
    return model, tokenizer


def state(running) -> dict:
    return httpx.get(f"{running.url}/debug/state").json()


def assert_idle(running, max_sessions: int) -> dict:
    """Once the last stream's end is counted: nothing decoding or waiting, the batch cache
    one row with no storage, at most `max_sessions` sessions and none busy, in GET
    /debug/state and in /metrics alike."""
    deadline = time.monotonic() + 10
    while (now := state(running))["decoding"] or now["waiting"] or now["busy_sessions"]:
        assert time.monotonic() < deadline, now
        time.sleep(0.02)
    assert now["batch_cache_rows"] <= 1 and now["batch_cache_slots"] == 0, now
    assert now["sessions"] <= max_sessions == now["max_sessions"], now
    assert running.metric("mlx_speculate_batch_size") == 0
    assert running.metric("mlx_speculate_queue_depth") == 0
    assert running.metric("mlx_speculate_batch_cache_rows") <= 1
    assert running.metric("mlx_speculate_sessions") <= max_sessions
    return now


def test_a_burst_the_default_batch_and_queue_hold_is_taken(stories):
    """At the command line's defaults, as many concurrent chats as the batch and the queue
    hold (64: --max-batch 32, and --max-queue, by default the batch's size) all get answers:
    none is refused while the batch has room, however fast they come."""
    defaults = build_parser().parse_args([])
    n = 2 * defaults.max_batch
    with serve(*stories, max_batch=defaults.max_batch, max_queue=defaults.max_queue) as running:
        client = running.client()

        def chat(i: int) -> str:
            reply = client.chat.completions.create(
                model="stories",
                messages=[{"role": "user", "content": OPENINGS[i % 8]}],
                max_tokens=3,
                temperature=0,
            )
            return reply.choices[0].finish_reason

        assert all(at_once(chat, [(i,) for i in range(n)]))
        assert (
            running.metric(
                "mlx_speculate_requests_total", endpoint="/v1/chat/completions", outcome="429"
            )
            == 0
        )
        assert_idle(running, 4)


def test_a_batch_above_64_sequences_runs():
    """`batch_generate(..., max_batch=100)`: 66 sequences decoding at once (rows past the
    powers of two up to 64), each the greedy tokens it gets alone."""
    model = tiny_model("llama", 0, **DEEP)
    prompt, n = [3, 1, 4, 1, 5, 9, 2, 6], 70
    assert clear(model, prompt, n)
    result = batch_generate(model, StubTokenizer(), [prompt] * 66, max_tokens=n, max_batch=100)
    assert result.tokens == [greedy_reference(model, prompt, n)] * 66


def test_a_leaving_sequence_keeps_no_slice_of_the_batch_cache():
    """A row copied out to a one-sequence cache, and a batch shrunk to fewer rows, hold their
    own storage: dropping the big batch gives its memory back."""
    model = tiny_model("llama")
    single = model.make_cache()
    model(mx.array([[1, 2, 3, 4, 5]]), single)
    mx.eval(single.keys, single.values)
    mx.clear_cache()
    before = mx.get_active_memory()
    batch = BatchKVCache(model.kv_shapes(), mx.float32, 64)
    batch.reserve(4096)
    mx.eval(batch.keys, batch.values)
    big = mx.get_active_memory() - before
    for row in (0, 5):
        batch.insert(row, single, 5)
    out = model.make_cache()
    batch.extract(5, out, 5)
    batch.resize(1)  # row 0 kept, its slots cut to what it holds
    mx.clear_cache()
    held = mx.get_active_memory() - before
    assert held < big / 16, (held, big)
    assert batch.offsets == [5] and batch.capacity == single.step
    for mine, theirs in zip(out.keys, single.keys, strict=True):
        assert mx.array_equal(mine[..., :5, :], theirs[..., :5, :])
    batch.extract(0, model.make_cache(), 5)  # no row held: no storage
    assert batch.capacity == 0


def test_a_cancellation_storm_leaves_every_survivor_whole(endless):
    """vLLM's test_abort: 100 concurrent streams (max_batch 80, so more than 64 decode at
    once), a random quarter closed after a few chunks: every other one gets exactly its
    max_tokens, its text the one it gets alone; then nothing is left running and no more
    sessions than the limit are kept."""
    rng = random.Random(0)
    longest = 130
    with serve(*endless, max_batch=80, max_queue=20, max_sessions=4) as running:
        client = running.client()

        def stream(prompt: str, max_tokens: int, leave: bool) -> tuple[str, int] | None:
            response = client.completions.create(
                model="stories",
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            text, usage = [], None
            for i, chunk in enumerate(response):
                if leave and i == 3:
                    response.close()
                    return None
                if chunk.choices:
                    text.append(chunk.choices[0].text)
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
            return "".join(text), usage

        alone = {p: stream(p, longest, False)[0] for p in OPENINGS}
        most, stop = [0], threading.Event()

        def watch() -> None:
            while not stop.is_set():
                most[0] = max(most[0], state(running)["decoding"])
                time.sleep(0.01)

        watcher = threading.Thread(target=watch)
        watcher.start()
        args = [
            (OPENINGS[i % 8], rng.randrange(110, longest), rng.random() < 0.25) for i in range(100)
        ]
        try:
            results = at_once(stream, args)
        finally:
            stop.set()
            watcher.join()
        for (prompt, max_tokens, leave), result in zip(args, results, strict=True):
            if not leave:
                text, tokens = result
                assert tokens == max_tokens
                assert alone[prompt].startswith(text) and text
        assert most[0] > 64
        assert_idle(running, 4)


def rejected_draft(vocab: int, seed: int = 5):
    """A tiny random Llama over `vocab`: it almost never agrees with a trained target."""
    config = tiny_config("llama", vocab_size=vocab)
    return build_model(config, random_weights(config, seed))


def soak(running, prompts: list, ask, max_sessions: int) -> None:
    """llama.cpp's forced-rejection soak: each prompt asked with the rejected drafter, in turn
    and then all at once, twice: every answer is the plain one, the drafts were almost all
    rejected, and the second round holds no more memory, sessions or cache than the first."""
    plain = [ask(p, "none")[0] for p in prompts]
    held = []
    for _ in range(2):
        drafted = accepted = 0
        for answers in (
            [ask(p, "draft_model") for p in prompts],
            at_once(lambda p: ask(p, "draft_model"), [(p,) for p in prompts]),
        ):
            assert [text for text, _ in answers] == plain
            drafted += sum(s["drafted_tokens"] for _, s in answers)
            accepted += sum(s["accepted_tokens"] for _, s in answers)
        assert drafted > 0 and accepted <= 0.25 * drafted, (accepted, drafted)
        held.append(assert_idle(running, max_sessions))
    first, second = held
    assert second["active_memory_bytes"] <= first["active_memory_bytes"] * 1.05 + 2**20, held


def test_forced_rejection_soak_on_an_attention_target(stories):
    model, tokenizer = stories
    spec = DraftModelSpec(model=rejected_draft(model.args.vocab_size), tokenizer=tokenizer)
    with serve(model, tokenizer, spec, max_batch=8, max_sessions=3) as running:
        client = running.client()

        def ask(prompt: str, method: str) -> tuple[str, dict]:
            completion = client.completions.create(
                model="stories",
                prompt=prompt,
                max_tokens=24,
                temperature=0,
                extra_body={
                    "speculative": {"method": method, "num_draft_tokens": 3}
                    if method != "none"
                    else {"method": method}
                },
            )
            return completion.choices[0].text, completion.usage.speculative

        soak(running, OPENINGS[:6], ask, 3)


@pytest.fixture(scope="module")
def hybrid_folder(tmp_path_factory):
    return save_hf(tmp_path_factory.mktemp("hybrid") / "hf", "qwen3_5_text")


def test_forced_rejection_soak_on_a_hybrid_target(hybrid_folder):
    """The same on a hybrid (recurrent layers: served one request at a time)."""
    model, tokenizer = load(hybrid_folder)
    spec = DraftModelSpec(model=llama_draft(), tokenizer=tokenizer)
    with serve(model, tokenizer, spec, model_id="hybrid", max_sessions=2) as running:
        client = running.client()

        def ask(words: str, method: str) -> tuple[str, dict]:
            options = (
                {"method": method}
                if method == "none"
                else {"method": method, "num_draft_tokens": 3}
            )
            completion = client.chat.completions.create(
                model="hybrid",
                messages=[{"role": "user", "content": words}],
                max_tokens=12,
                temperature=0,
                extra_body={"speculative": options},
            )
            return completion.choices[0].message.content, completion.usage.speculative

        prompts = [" ".join(f"w{(7 * i + j) % 50}" for j in range(6)) for i in range(4)]
        soak(running, prompts, ask, 2)


def test_after_traffic_the_server_holds_what_its_limits_say(stories):
    """SGLang's idle self-check, after rounds of mixed traffic (streamed and whole answers,
    clients leaving mid-stream, a bad request) from more clients than --prompt-cache-size:
    GET /debug/state and /metrics show nothing decoding or waiting, no batch cache storage
    and at most --prompt-cache-size sessions, and MLX's active memory is back to what one
    request left (the sessions kept: a few contexts of this tiny model)."""
    with serve(*stories, max_batch=8, max_sessions=2) as running:
        client = running.client()
        client.completions.create(model="stories", prompt=OPENINGS[0], max_tokens=40)
        start = assert_idle(running, 2)

        def one(i: int) -> None:
            prompt = f"{OPENINGS[i % 8]} {i}"
            if i % 4 == 3:  # a client that leaves after two chunks
                response = client.completions.create(
                    model="stories", prompt=prompt, max_tokens=40, stream=True
                )
                for j, _ in enumerate(response):
                    if j == 2:
                        response.close()
                        break
            elif i % 8 == 5:  # refused before it runs
                with pytest.raises(openai.BadRequestError):
                    client.completions.create(model="stories", prompt=prompt, n=2)
            else:
                client.completions.create(model="stories", prompt=prompt, max_tokens=40)

        held = []
        for _ in range(2):
            at_once(one, [(i,) for i in range(16)])
            held.append(assert_idle(running, 2))
        memory = [h["active_memory_bytes"] for h in held]
        assert memory[1] <= memory[0] * 1.05 + 2**20, memory
        # One session more than after the first request (each a few hundred KiB here).
        assert memory[1] <= start["active_memory_bytes"] + 2**19, (start, memory)
