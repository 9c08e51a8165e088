"""The server's OpenAI API with the real openai client: chat and text completions, streamed and
whole, SSE conformance, logprobs, and greedy output equal to `generate`'s for every method
served (plain, prompt lookup, draft model, Medusa, EAGLE), on the real stories models."""

from __future__ import annotations

import json

import httpx
import mlx.core as mx
import pytest

from mlx_speculate.chat import apply_chat_template
from mlx_speculate.drafters import DraftModelSpec, EagleGrowth, EagleSpec, MedusaSpec
from mlx_speculate.generation import stream_generate

from .helpers import MODELS, assert_clear_argmax, random_eagle_head
from .serving import load_cached, serve, sse_events

CHAT = [
    {"role": "system", "content": "Lily and Tom went to the park."},
    {"role": "user", "content": "They saw a big dog."},
]
METHODS = ["none", "prompt_lookup", "draft_model"]


@pytest.fixture(scope="module")
def stories():
    return load_cached(MODELS / "stories260K-llama")


@pytest.fixture(scope="module")
def server(stories):
    draft, draft_tokenizer = load_cached(MODELS / "llama2xs281K-llama")
    with serve(*stories, DraftModelSpec(model=draft, tokenizer=draft_tokenizer)) as running:
        yield running


def expected(model, tokenizer, tokens: list[int], max_tokens: int, **kwargs) -> str:
    """Plain greedy `stream_generate`'s text, whose tokens are checked to be clear argmaxes."""
    responses = list(stream_generate(model, tokenizer, tokens, max_tokens=max_tokens, **kwargs))
    assert_clear_argmax(model, tokens, [r.token for r in responses])
    return "".join(r.text for r in responses)


def test_models_lists_the_model_and_its_methods(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == ["stories"]
    assert models[0].speculative_methods == METHODS


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_greedy_equals_generate(server, stories, method, stream):
    model, tokenizer = stories
    want = expected(model, tokenizer, apply_chat_template(tokenizer, CHAT), 40)
    extra = {"speculative": {"method": method}}
    if method != "none":
        extra["speculative"]["num_draft_tokens"] = 3  # drafting every step, not maybe
    client = server.client()
    args = dict(model="stories", messages=CHAT, max_tokens=40, temperature=0, extra_body=extra)
    if stream:
        chunks = list(
            client.chat.completions.create(
                **args, stream=True, stream_options={"include_usage": True}
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        finish = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finish[-1] == "length" and set(finish[:-1]) == {None}
    else:
        completion = client.chat.completions.create(**args)
        text, usage = completion.choices[0].message.content, completion.usage
        assert completion.choices[0].finish_reason == "length"
        assert completion.choices[0].message.role == "assistant"
    assert text == want
    assert usage.completion_tokens == 40
    assert usage.prompt_tokens == len(apply_chat_template(tokenizer, CHAT))
    assert usage.total_tokens == usage.prompt_tokens + 40
    spec = usage.speculative
    assert spec["method"] == method
    if method == "none":
        # The prompt's forward gave the first token, a verify forward each of the other 39.
        assert spec["drafted_tokens"] == 0 and spec["target_forwards"] == 39
    else:
        assert spec["drafted_tokens"] > 0
        assert spec["tokens_per_target_forward"] == pytest.approx(
            (spec["accepted_tokens"] + spec["target_forwards"]) / spec["target_forwards"]
        )
    if method == "draft_model":
        assert spec["tokens_per_target_forward"] > 1.2  # the stories pair agrees often


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_greedy_equals_generate(server, stories, stream):
    model, tokenizer = stories
    prompt = "Once upon a time, there was a little dog"
    tokens = list(tokenizer.encode(prompt))
    want = expected(model, tokenizer, tokens, 30)
    client = server.client()
    for given in (prompt, tokens, [prompt]):  # text, token ids, a list of one text
        args = dict(model="stories", prompt=given, max_tokens=30, temperature=0)
        if stream:
            chunks = list(client.completions.create(**args, stream=True))
            text = "".join(c.choices[0].text for c in chunks)
            assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
        else:
            completion = client.completions.create(**args)
            text = completion.choices[0].text
            assert completion.object == "text_completion"
            assert completion.usage.prompt_tokens == len(tokens)
        assert text == want


@pytest.mark.parametrize("path", ["chat/completions", "completions"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_follows_openai_protocol(server, path, include_usage):
    body = {"model": "stories", "max_tokens": 12, "temperature": 0, "stream": True}
    if path == "chat/completions":
        body["messages"] = CHAT
    else:
        body["prompt"] = "Once upon a time"
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{server.url}/v1/{path}", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    with_choices = [c for c in chunks if c["choices"]]
    finishes = [c for c in with_choices if c["choices"][0]["finish_reason"] is not None]
    assert len(finishes) == 1 and finishes[0] is with_choices[-1]
    assert finishes[0]["choices"][0]["finish_reason"] == "length"
    if path == "chat/completions":
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        roles = [c for c in with_choices if "role" in c["choices"][0]["delta"]]
        assert roles == [with_choices[0]]
        assert roles[0]["choices"][0]["delta"]["role"] == "assistant"
    if include_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
        assert all(c["usage"] is None for c in chunks[:-1])
    else:
        assert all(c["choices"] and "usage" not in c for c in chunks)


def test_stop_strings_end_the_text_as_generate_does(server, stories):
    model, tokenizer = stories
    tokens = apply_chat_template(tokenizer, CHAT)
    full = expected(model, tokenizer, tokens, 40)
    stop = full.split()[4]
    assert full.index(stop) > 0
    client = server.client()
    for stops in (stop, [stop, "never there"]):
        completion = client.chat.completions.create(
            model="stories", messages=CHAT, max_tokens=40, temperature=0, stop=stops
        )
        assert completion.choices[0].message.content == full[: full.index(stop)]
        assert completion.choices[0].finish_reason == "stop"
        chunks = list(
            client.chat.completions.create(
                model="stories",
                messages=CHAT,
                max_tokens=40,
                temperature=0,
                stop=stops,
                stream=True,
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == full[: full.index(stop)]


def target_logprobs(model, tokens: list[int], generated: list[int]) -> mx.array:
    """(n, V) the target's log-probabilities at each generated position."""
    logits = model(mx.array([tokens + generated])).logits[0, len(tokens) - 1 : -1]
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def test_chat_logprobs_are_the_models(server, stories):
    model, tokenizer = stories
    tokens = apply_chat_template(tokenizer, CHAT)
    client = server.client()
    args = dict(model="stories", messages=CHAT, max_tokens=10, temperature=0, logprobs=True)
    whole = client.chat.completions.create(**args, top_logprobs=3).choices[0].logprobs.content
    generated = [r.token for r in stream_generate(model, tokenizer, tokens, max_tokens=10)]
    reference = target_logprobs(model, tokens, generated)
    assert len(whole) == 10
    for entry, token, row in zip(whole, generated, reference, strict=True):
        assert entry.token == tokenizer.decode([token])
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert tops[0] == pytest.approx(mx.max(row).item(), abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the top one
    chunks = list(client.chat.completions.create(**args, stream=True))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    # The streamed request reuses the cached prompt, so its last prompt row comes from a
    # one-row forward: equal up to float32 rounding of another matmul kernel (OpenBLAS).
    assert [e.token for e in streamed] == [e.token for e in whole]
    for a, b in zip(streamed, whole, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    assert all(e.top_logprobs == [] for e in streamed)  # none asked for
    plain = client.chat.completions.create(**{**args, "logprobs": False})
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_legacy_format(server, stories):
    model, tokenizer = stories
    completion = server.client().completions.create(
        model="stories", prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2
    )
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert all(len(top) <= 2 and max(top.values()) <= 0 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


def test_context_end_is_a_length_finish(server, stories):
    model, tokenizer = stories
    tokens = (list(tokenizer.encode("Once upon a time")) * 200)[
        : model.args.max_position_embeddings - 3
    ]
    completion = server.client().completions.create(
        model="stories", prompt=tokens, max_tokens=50, temperature=0
    )
    assert completion.choices[0].finish_reason == "length"  # OpenAI has no "context"
    assert completion.usage.completion_tokens == 4  # the slots left, and the last one's token


def test_sampling_is_seeded(server):
    """A seed repeats a sample with plain decoding or a fixed draft length (an adaptive one
    follows measured timings, and with it the number of random draws)."""
    client = server.client()

    def text(seed: int, method: str) -> str:
        speculative = {"method": method}
        if method != "none":
            speculative["num_draft_tokens"] = 3
        completion = client.completions.create(
            model="stories",
            prompt="Once upon a time",
            max_tokens=30,
            temperature=1.0,
            top_p=0.95,
            seed=seed,
            extra_body={"speculative": speculative},
        )
        return completion.choices[0].text

    for method in METHODS:
        assert text(3, method) == text(3, method)
        assert text(3, method) != text(4, method)


def served_greedy_usage(model, tokenizer, spec) -> dict:
    """Serves `spec` alone; its greedy text, whole and streamed, equals plain `generate`'s.
    Returns the whole answer's speculative usage."""
    prompt = "Once upon a time"
    want = expected(model, tokenizer, list(tokenizer.encode(prompt)), 40)
    with serve(model, tokenizer, spec) as running:
        client = running.client()
        args = dict(model="stories", prompt=prompt, max_tokens=40, temperature=0)
        completion = client.completions.create(**args)
        assert completion.choices[0].text == want
        chunks = client.completions.create(**args, stream=True)
        assert "".join(c.choices[0].text for c in chunks) == want
    return completion.usage.speculative


def test_medusa_greedy_equals_generate(stories, tmp_path):
    from .test_medusa import FULL_TREE, load_medusa_heads, train_heads

    model, tokenizer = stories
    train_heads(model, tmp_path, samples=32, prefix=16, epochs=10)
    heads = load_medusa_heads(tmp_path / "heads", model)
    # A fixed tree: the adaptive policy may fall back to plain steps on a slow, noisy machine.
    usage = served_greedy_usage(
        model, tokenizer, MedusaSpec(heads=heads, num_draft_tokens=FULL_TREE)
    )
    assert usage["method"] == "medusa" and usage["tokens_per_target_forward"] > 1.5


def test_eagle_greedy_equals_generate(stories):
    model, tokenizer = stories
    config = json.loads((MODELS / "stories260K-llama" / "config.json").read_text())
    head = random_eagle_head(config, 1, seed=3)  # random weights: lossless, rarely right
    spec = EagleSpec(heads=head, tree=EagleGrowth(16, 4, 4), num_draft_tokens=15)
    usage = served_greedy_usage(model, tokenizer, spec)
    assert usage["method"] == "eagle" and usage["drafted_tokens"] > 0


def test_metrics_count_what_happened(server):
    client = server.client()
    before = server.metric("mlx_speculate_accepted_tokens_total", method="draft_model")
    completion = client.completions.create(
        model="stories",
        prompt="Once upon a time",
        max_tokens=20,
        temperature=0,
        extra_body={"speculative": {"method": "draft_model", "num_draft_tokens": 3}},
    )
    accepted = completion.usage.speculative["accepted_tokens"]
    assert accepted > 0
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "mlx_speculate_requests_total",
        "mlx_speculate_prompt_tokens_total",
        "mlx_speculate_generated_tokens_total",
        "mlx_speculate_drafted_tokens_total",
        "mlx_speculate_accepted_tokens_total",
        "mlx_speculate_tokens_per_target_forward_bucket",
        "mlx_speculate_time_to_first_token_seconds_bucket",
        "mlx_speculate_queue_depth",
    ):
        assert f"\n{name}" in text, name
    after = server.metric("mlx_speculate_accepted_tokens_total", method="draft_model")
    assert after - before == accepted
    assert f'mlx_speculate_accepted_tokens_total{{method="draft_model"}} {after}' in text
