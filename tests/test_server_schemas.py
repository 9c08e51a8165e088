"""Structured output through the server on the 20 schemas of tests/json_schemas.json (nested
objects, enums, arrays, numbers, refs, any_of, ...): every answer ends, parses and validates,
at temperature 0 and 0.8, with prompt lookup and with a draft model; the grammar's forced
tokens are fast-forwarded; greedy answers equal plain constrained greedy decoding's token for
token. stories260K runs all 20 by default; SmolLM2 a sample (all 20 under -m slow: 34 minutes
under nice on 2 cores at load 12-15, with the OpenBLAS tests/blas.py loads; the longest are
sampled answers that run long, array_of_objects 423 s). The figures (fast-forwarded
fraction, tokens per forward) are benchmarks/bench_grammar.py's."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from mlx_speculate.drafters import DraftModelSpec

from .helpers import MODELS
from .serving import load_cached, serve

SCHEMAS = json.loads((Path(__file__).parent / "json_schemas.json").read_text())
SMOLLM2_SAMPLE = ("person",)
DRAFT = 4
RUNS = [(method, t) for method in ("prompt_lookup", "draft_model") for t in (0.0, 0.8)]


@pytest.fixture(scope="module")
def stories():
    target = load_cached(MODELS / "stories260K-llama")
    draft, draft_tokenizer = load_cached(
        MODELS / "llama2xs281K-llama"
    )
    spec = DraftModelSpec(model=draft, tokenizer=draft_tokenizer, num_draft_tokens=DRAFT)
    with serve(*target, spec, model_id="local") as running:
        yield running


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, smollm2_file):
    """SmolLM2 (float32) drafting for itself."""
    from mlx_speculate.convert import convert
    from mlx_speculate.loading import load

    folder = convert(smollm2_file, tmp_path_factory.mktemp("smollm2") / "f32", dtype="float32")
    model, tokenizer = load(folder)
    spec = DraftModelSpec(model=model, num_draft_tokens=DRAFT)
    with serve(model, tokenizer, spec, model_id="local") as running:
        yield running


def speculative(method: str) -> dict:
    """A fixed draft length: the adaptive policy may rightly choose plain steps on a CPU,
    which would leave speculation untested."""
    return {"method": method} | ({} if method == "none" else {"num_draft_tokens": DRAFT})


def answers(running, name: str, prompt: str) -> None:
    schema = SCHEMAS[name]
    plain = None  # plain constrained greedy decoding's tokens (as text, one per token)
    for i, (method, temperature) in enumerate([("none", 0.0), *RUNS]):
        completion = running.client(timeout=600).chat.completions.create(
            model="local",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=400,
            temperature=temperature,
            seed=i,
            logprobs=True,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": name, "schema": schema},
            },
            extra_body={"speculative": speculative(method)},
        )
        choice, usage = completion.choices[0], completion.usage.speculative
        assert choice.finish_reason == "stop", (method, temperature, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
        assert usage["method"] == method and usage["fast_forwarded_tokens"] > 0
        tokens = [entry.token for entry in choice.logprobs.content]
        if method == "none":
            plain = tokens
        elif temperature == 0:
            assert tokens == plain, (method, choice.message.content)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_stories_answers_validate(stories, name):
    answers(stories, name, "Lily and Tom went to the park. They saw a big dog.")


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=() if n in SMOLLM2_SAMPLE else pytest.mark.slow) for n in SCHEMAS],
)
def test_smollm2_answers_validate(smollm2, name):
    answers(smollm2, name, f"Reply in JSON following this schema: {json.dumps(SCHEMAS[name])}")
