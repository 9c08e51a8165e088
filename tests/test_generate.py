"""stream_generate and the CLI, on the real stories models from ../shared."""

import functools

import pytest

from mlx_speculate.generate import main
from mlx_speculate.generation import (
    GenerationResponse,
    SpeculativeStats,
    generate,
    stream_generate,
)
from mlx_speculate.loading import load

from .helpers import greedy_reference, tiny_model
from .test_speculative import assert_clear_argmax

load_cached = functools.lru_cache(load)
PROMPT = "Lily and Tom went to the park."


@pytest.fixture
def stories(shared_models):
    model, _ = load_cached(shared_models / "stories260K-llama")
    _, tokenizer = load(shared_models / "stories260K-llama")  # fresh: tests change its EOS
    return model, tokenizer


@pytest.fixture
def draft(shared_models):
    return load_cached(shared_models / "llama2xs281K-llama")


@pytest.fixture
def reference(stories):
    model, tokenizer = stories
    prompt = tokenizer.encode(PROMPT)
    tokens = greedy_reference(model, prompt, 80)
    assert_clear_argmax(model, prompt, tokens)
    return tokens


def run(model, tokenizer, **kwargs):
    return list(stream_generate(model, tokenizer, PROMPT, **kwargs))


def test_responses_are_typed(stories, draft, reference):
    model, tokenizer = stories
    responses = run(model, tokenizer, max_tokens=30, draft_model=draft[0], num_draft_tokens=3)
    assert all(isinstance(r, GenerationResponse) for r in responses)
    assert [r.token for r in responses] == reference[:30]
    assert [r.generation_tokens for r in responses] == list(range(1, 31))
    assert all(r.finish_reason is None and r.stats is None for r in responses[:-1])
    last = responses[-1]
    assert last.finish_reason == "length"
    assert isinstance(last.stats, SpeculativeStats)
    # The prompt's forward chose the first token; the verify forwards the other 29.
    assert last.stats.generated == 29
    # Every verify forward checks 3 drafts, but never more than the tokens still wanted after
    # the step's own: the last one may check fewer.
    forwards = last.stats.target_forwards
    assert 3 * (forwards - 1) < last.stats.drafted <= 3 * forwards
    assert sum(r.from_draft for r in responses) == last.stats.accepted > 0
    assert last.stats.tokens_per_forward == 29 / last.stats.target_forwards > 1
    assert responses[0].prompt_tokens == len(tokenizer.encode(PROMPT))
    assert all(r.logprobs.shape == (512,) for r in responses)


@pytest.mark.parametrize(
    "speculation",
    [
        {},
        {"draft_model": "draft"},
        {"draft_model": "draft", "num_draft_tokens": 5},
        {"prompt_lookup": True},
        {"prompt_lookup": True, "max_ngram": 1, "num_draft_tokens": 2},
    ],
    ids=["plain", "draft-adaptive", "draft-5", "lookup-adaptive", "lookup-1gram"],
)
def test_speculative_text_equals_plain(stories, draft, reference, speculation):
    model, tokenizer = stories
    if "draft_model" in speculation:
        speculation = {**speculation, "draft_model": draft[0], "draft_tokenizer": draft[1]}
    text = generate(model, tokenizer, PROMPT, max_tokens=80, **speculation)
    assert text == tokenizer.decode(reference)


def family_model(shared_models, family):
    """The stories weights in another family's layout (same greedy tokens), fresh tokenizer."""
    model, _ = load_cached(shared_models / f"stories260K-{family}")
    _, tokenizer = load(shared_models / f"stories260K-{family}")
    return model, tokenizer


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
@pytest.mark.parametrize("position", [7, 13])
def test_eos_inside_an_accepted_run(shared_models, reference, family, position):
    # The target drafts for itself: the prompt's forward emits position 0, then every step
    # accepts all 4 drafts and emits positions 1-5, 6-10, 11-15, ...: 7 and 13 are accepted
    # drafts inside a run.
    model, tokenizer = family_model(shared_models, family)
    assert_clear_argmax(model, tokenizer.encode(PROMPT), reference)
    eos = reference[position]
    assert eos not in reference[:position]
    tokenizer.eos_token_ids = {eos}
    responses = run(model, tokenizer, max_tokens=50, draft_model=model, num_draft_tokens=4)
    assert [r.token for r in responses] == reference[: position + 1]
    assert responses[-1].finish_reason == "stop"
    assert responses[-1].text == ""  # EOS is not emitted as text
    assert responses[-1].generation_tokens == position
    assert "".join(r.text for r in responses) == tokenizer.decode(reference[:position])
    # Cut mid-run: the drafts after the EOS were accepted by the target but do not count.
    stats = responses[-1].stats
    assert stats.accepted == sum(r.from_draft for r in responses) < stats.drafted
    assert stats.generated == position  # the first token came from the prompt's forward


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
@pytest.mark.parametrize("max_tokens", [1, 7, 9])
def test_max_tokens_inside_an_accepted_run(shared_models, reference, family, max_tokens):
    model, tokenizer = family_model(shared_models, family)
    responses = run(model, tokenizer, max_tokens=max_tokens, draft_model=model, num_draft_tokens=4)
    assert [r.token for r in responses] == reference[:max_tokens]
    assert responses[-1].finish_reason == "length"


def test_stop_string_is_trimmed_and_never_partly_emitted(stories, reference):
    model, tokenizer = stories
    full = tokenizer.decode(reference)
    stop = " to play"
    assert stop in full
    for speculation in ({}, {"draft_model": model, "num_draft_tokens": 4}):
        responses = run(model, tokenizer, max_tokens=80, stop=[stop], **speculation)
        assert responses[-1].finish_reason == "stop"
        # Segments are only ever appended, so no piece of the stop string was sent earlier.
        assert "".join(r.text for r in responses) == full[: full.index(stop)]


def test_seed_reproducible_at_temperature(stories, draft):
    model, tokenizer = stories

    def tokens(seed, **kwargs):
        responses = run(model, tokenizer, max_tokens=40, temperature=1.0, seed=seed, **kwargs)
        return [r.token for r in responses]

    for speculation in ({}, {"draft_model": draft[0], "num_draft_tokens": 3}):
        assert tokens(5, **speculation) == tokens(5, **speculation)
        assert tokens(5, **speculation) != tokens(6, **speculation)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_k": -1},
        {"min_p": 1.0},
        {"max_tokens": 0},
        {"prompt_lookup": True, "num_draft_tokens": -1},
        {"prompt_lookup": True, "max_ngram": 0},
    ],
)
def test_invalid_values_raise(stories, kwargs):
    model, tokenizer = stories
    with pytest.raises(ValueError):
        run(model, tokenizer, **kwargs)


def test_conflicting_drafters_raise(stories):
    model, tokenizer = stories
    with pytest.raises(ValueError, match="one speculative method"):
        run(model, tokenizer, draft_model=model, prompt_lookup=True)


def test_draft_vocabulary_mismatch_raises(stories):
    model, tokenizer = stories
    with pytest.raises(ValueError, match="draft vocabulary 97 does not match target 512"):
        run(model, tokenizer, draft_model=tiny_model("llama"))


# The CLI.


def cli(capsys, *args):
    code = main(["--ignore-chat-template", "--prompt", PROMPT, *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_prompt_lookup(capsys, shared_models, stories, reference):
    _, tokenizer = stories
    target = shared_models / "stories260K-llama"
    code, out, err = cli(capsys, "--model", target, "-m", 40, "--prompt-lookup", "--verbose")
    assert code == 0
    assert out == tokenizer.decode(reference[:40]) + "\n"
    assert "Generation: 40 tokens" in err


def test_cli_draft_model(capsys, shared_models, stories, reference):
    _, tokenizer = stories
    target = shared_models / "stories260K-llama"
    draft_path = shared_models / "llama2xs281K-llama"
    code, out, err = cli(
        capsys, "--model", target, "--draft-model", draft_path, "--num-draft-tokens", 3,
        "-m", 40, "--verbose",
    )
    assert code == 0
    assert out == tokenizer.decode(reference[:40]) + "\n"
    assert "Speculation:" in err and "tokens per target forward" in err


def test_cli_bad_draft_path(capsys, shared_models):
    target = shared_models / "stories260K-llama"
    code, out, err = cli(capsys, "--model", target, "--draft-model", "/nonexistent/draft")
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("error:") and "/nonexistent/draft" in err
