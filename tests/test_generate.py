"""stream_generate and the CLI, on the real stories models in tests/data."""

import functools
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_speculate.chat import apply_chat_template
from mlx_speculate.drafters.draft_model import DraftModelDrafter
from mlx_speculate.generate import main
from mlx_speculate.generation import (
    GenerationResponse,
    SpeculativeStats,
    generate,
    stream_generate,
)
from mlx_speculate.loading import load
from mlx_speculate.policy.adaptive import FixedPolicy
from mlx_speculate.sequence import Sequence

from .helpers import MODELS, decode, greedy_reference, random_weights, tiny_config, tiny_model
from .markov import StubTokenizer
from .test_loading import write_folder
from .test_speculative import assert_clear_argmax

ROOT = Path(__file__).resolve().parents[1]

load_cached = functools.lru_cache(load)
PROMPT = "Lily and Tom went to the park."


@pytest.fixture
def stories():
    model, _ = load_cached(MODELS / "stories260K-llama")
    _, tokenizer = load(MODELS / "stories260K-llama")  # fresh: tests change its EOS
    return model, tokenizer


@pytest.fixture
def draft():
    return load_cached(MODELS / "llama2xs281K-llama")


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
    assert all(r.finish_reason is None for r in responses[:-1])
    # Every response carries the statistics so far: exact counts up to its token (the first
    # token came from the prompt's forward, not a verify forward).
    assert [r.stats.generated for r in responses] == list(range(30))
    assert all(
        r.stats.accepted == sum(q.from_draft for q in responses[: i + 1])
        for i, r in enumerate(responses)
    )
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


def family_model(family):
    """The stories weights in another family's layout (same greedy tokens), fresh tokenizer."""
    model, _ = load_cached(MODELS / f"stories260K-{family}")
    _, tokenizer = load(MODELS / f"stories260K-{family}")
    return model, tokenizer


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
@pytest.mark.parametrize("position", [7, 13])
def test_eos_inside_an_accepted_run(reference, family, position):
    # The target drafts for itself: the prompt's forward emits position 0, then every step
    # accepts all 4 drafts and emits positions 1-5, 6-10, 11-15, ...: 7 and 13 are accepted
    # drafts inside a run.
    model, tokenizer = family_model(family)
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
def test_max_tokens_inside_an_accepted_run(reference, family, max_tokens):
    model, tokenizer = family_model(family)
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


def test_cli_prompt_lookup(capsys, stories, reference):
    _, tokenizer = stories
    target = MODELS / "stories260K-llama"
    code, out, err = cli(capsys, "--model", target, "-m", 40, "--prompt-lookup", "--verbose")
    assert code == 0
    assert out == tokenizer.decode(reference[:40]) + "\n"
    assert "Generation: 40 tokens" in err


def test_cli_draft_model(capsys, stories, reference):
    _, tokenizer = stories
    target = MODELS / "stories260K-llama"
    draft_path = MODELS / "llama2xs281K-llama"
    code, out, err = cli(
        capsys, "--model", target, "--draft-model", draft_path, "--num-draft-tokens", 3,
        "-m", 40, "--verbose",
    )
    assert code == 0
    assert out == tokenizer.decode(reference[:40]) + "\n"
    assert "Speculation:" in err and "tokens per target forward" in err


def test_cli_bad_draft_path(capsys):
    target = MODELS / "stories260K-llama"
    code, out, err = cli(capsys, "--model", target, "--draft-model", "/nonexistent/draft")
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("error:") and "/nonexistent/draft" in err


# Inputs the model cannot take, limits and statistics, on tiny seeded models.

TINY_PROMPT = [1, 5, 9, 33, 7, 2, 60]


@pytest.mark.parametrize("ids", [[1, 97], [1, -1], [2**20], [1, 2.0], ["5"]])
def test_token_ids_outside_the_vocabulary_are_refused_before_any_forward(ids):
    model = tiny_model("llama")  # vocabulary 97
    sequence = Sequence(model)
    with pytest.raises(ValueError, match="outside the model's vocabulary|must be integers"):
        sequence.prefill(ids)
    assert sequence.cache.offset == 0 and sequence.context == []
    with pytest.raises(ValueError, match="outside the model's vocabulary|must be integers"):
        next(stream_generate(model, StubTokenizer(), ids))


def test_huge_token_id_is_an_error_not_a_crash(tmp_path):
    """2**20 used to read far past the embedding and end the process with SIGSEGV."""
    script = (
        "from mlx_speculate.generation import generate\n"
        "from tests.helpers import tiny_model\n"
        "from tests.markov import StubTokenizer\n"
        "try:\n"
        "    generate(tiny_model('llama'), StubTokenizer(), [1, 2**20], max_tokens=2)\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "token id 1048576 is outside the model's vocabulary (0 to 96)" in result.stdout


def test_text_that_is_not_unicode_is_refused(tmp_path):
    config = tiny_config()
    model, tokenizer = load(write_folder(tmp_path / "tiny", config, random_weights(config)))
    for prompt in ("w1 \udcff w2", [{"role": "user", "content": "w1\udc80"}]):
        with pytest.raises(ValueError, match="not valid Unicode"):
            next(stream_generate(model, tokenizer, apply_chat_template(tokenizer, prompt)))
    with pytest.raises(ValueError, match="not valid Unicode"):
        next(stream_generate(model, tokenizer, "w1 \udcff w2"))


@pytest.mark.parametrize("speculation", [{}, {"prompt_lookup": True, "num_draft_tokens": 4}])
def test_context_limit_has_its_own_finish_reason(speculation):
    model = tiny_model("llama", max_position_embeddings=32)
    prompt = TINY_PROMPT * 3  # 21 tokens
    responses = list(stream_generate(model, StubTokenizer(), prompt, max_tokens=50, **speculation))
    # The cache holds all 32 positions; the token read from the last one is emitted too.
    assert len(prompt) + len(responses) == 33
    assert responses[-1].finish_reason == "context"
    assert [r.token for r in responses] == greedy_reference(model, prompt, 12)
    short = list(stream_generate(model, StubTokenizer(), prompt, max_tokens=5, **speculation))
    assert short[-1].finish_reason == "length" and len(short) == 5


def test_one_token_is_charged_to_the_prompt_not_to_generation():
    """--max-tokens 1 once reported ~28,000 tokens/s of generation. The first token comes from
    the prompt's own forward: prompt speed counts up to it (no faster than that forward), and
    generation speed counts only the tokens after it (none here)."""
    model = tiny_model("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       vocab_size=4096)
    prompt = list(range(1, 65))
    forward = []
    for _ in range(5):
        start = time.perf_counter()
        mx.eval(model(mx.array([prompt]), model.make_cache()).logits[0, -1])
        forward.append(time.perf_counter() - start)
    (response,) = stream_generate(model, StubTokenizer(), prompt, max_tokens=1)
    assert response.generation_tokens == 1 and response.generation_tps == 0.0
    assert len(prompt) / response.prompt_tps >= 0.5 * min(forward)


def test_tokens_per_forward_counts_the_eos():
    """A plain run ended by EOS: every verify forward yielded one token, the EOS included (the
    first token came from the prompt's forward)."""
    model = tiny_model("llama")
    reference = greedy_reference(model, TINY_PROMPT, 20)
    tokenizer = StubTokenizer()
    position = next(i for i in range(5, 20) if reference[i] not in reference[:i])
    tokenizer.eos_token_ids = (reference[position],)
    responses = list(stream_generate(model, tokenizer, TINY_PROMPT, max_tokens=50))
    stats = responses[-1].stats
    assert responses[-1].finish_reason == "stop"
    assert stats.generated == stats.target_forwards == position
    assert stats.tokens_per_forward == 1.0 and stats.drafted == stats.accepted == 0


def test_accepted_drafts_cut_by_a_stop_string_do_not_count():
    model = tiny_model("llama")
    reference = greedy_reference(model, TINY_PROMPT, 30)
    assert_clear_argmax(model, TINY_PROMPT, reference)
    # The target drafts for itself (all accepted), 4 per step: the prompt's forward gives
    # token 0, the steps 1-5 and 6-10, so token 7 ends inside a run.
    stop = f"{reference[7]} "
    assert stop not in "".join(f"{t} " for t in reference[:7])
    responses = list(
        stream_generate(
            model, StubTokenizer(), TINY_PROMPT, max_tokens=30, stop=[stop],
            draft_model=model, num_draft_tokens=4,
        )
    )
    stats = responses[-1].stats
    assert responses[-1].finish_reason == "stop"
    assert [r.token for r in responses] == reference[:8]
    assert stats.drafted == 8 and stats.target_forwards == 2
    assert stats.accepted == sum(r.from_draft for r in responses) == 6  # 1-4, then 6 and 7


def test_draft_length_is_capped_by_the_tokens_still_wanted():
    """num_draft_tokens=100 with max_tokens=40 once drafted 900 tokens."""
    model = tiny_model("llama")
    drafter = DraftModelDrafter(model, 97, max_draft=100)
    tokens, steps, _ = decode(model, TINY_PROMPT, 40, drafter, FixedPolicy(100), max_tokens=40)
    committed = 0
    for step in steps:
        assert step.drafted <= 40 - committed - 1
        committed += len(step.tokens)
    responses = list(
        stream_generate(
            model, StubTokenizer(), TINY_PROMPT, max_tokens=40, draft_model=model,
            num_draft_tokens=100,
        )
    )
    assert len(responses) == 40 and responses[-1].stats.drafted <= 39 * len(steps)
    assert responses[-1].stats.drafted < 100


def test_a_loaded_draft_brings_its_tokenizer_to_the_check(tmp_path):
    """The README's example passes `draft_model=draft` alone: a draft loaded with a tokenizer
    of the same size that encodes differently is refused; one like the target's is taken."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from mlx_speculate.drafters.draft_model import PROBES

    probe_words = sorted({w for text in PROBES for w in text.split()})
    words = ["<unk>", "<s>", "</s>", *probe_words]
    words += [f"w{i}" for i in range(97 - len(words))]

    def folder(name, order, seed):
        path = write_folder(tmp_path / name, config, random_weights(config, seed))
        tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(order)}, "<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer.save(str(path / "tokenizer.json"))
        return path

    config = tiny_config()
    target, tokenizer = load(folder("target", words, 0))
    twin, _ = load(folder("twin", words, 1))
    assert generate(target, tokenizer, "w1 w2", max_tokens=3, draft_model=twin)
    draft, _ = load(folder("other", words[:3] + words[3:][::-1], 1))
    with pytest.raises(ValueError, match="draft tokenizer .* does not encode"):
        next(stream_generate(target, tokenizer, "w1 w2", draft_model=draft))
