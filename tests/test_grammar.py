"""Structured output under speculation: grammars, exact constrained greedy and sampling."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import llguidance
import mlx.core as mx
import numpy as np
import pytest

from mlx_speculate.convert import convert
from mlx_speculate.drafters import Draft, Drafter, DraftModelSpec, EagleSpec, LookupSpec, MedusaSpec
from mlx_speculate.drafters.draft_model import DraftModelDrafter
from mlx_speculate.drafters.eagle import EagleGrowth
from mlx_speculate.drafters.lookup import LookupDrafter
from mlx_speculate.generation import stream_generate
from mlx_speculate.grammar import Grammar, ll_tokenizer
from mlx_speculate.grammar.constraint import Constraint
from mlx_speculate.loading import load
from mlx_speculate.policy.adaptive import FixedPolicy
from mlx_speculate.sampling import SamplingParams
from mlx_speculate.tree import Tree

from .helpers import MODELS, decode, random_eagle_head
from .markov import MarkovLM, assert_markov
from .test_medusa import random_heads

SCHEMAS = json.loads((Path(__file__).parent / "json_schemas.json").read_text())
SAMPLE = ("nested_address", "array_of_objects", "point")  # the default run's schemas
STORY = "Lily and Tom went to the park."


def every_schema(sample=SAMPLE):
    """The sample by default; all 20 under -m slow."""
    return [
        pytest.param(name, marks=() if name in sample else pytest.mark.slow) for name in SCHEMAS
    ]


# Grammars: construction and one-line errors.


def test_grammars_build():
    assert Grammar.json_schema(SCHEMAS["person"]) == Grammar.json_schema(
        json.dumps(SCHEMAS["person"])
    )
    assert Grammar.json_object().description == "JSON schema"
    assert Grammar.lark('start: "yes" | "no"').description == "Lark grammar"


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: Grammar.json_schema("{not json"), "the JSON schema is not valid JSON"),
        (lambda: Grammar.json_schema([1]), "a JSON schema is an object, got list"),
        (lambda: Grammar.json_schema({"type": "objectx"}), "the JSON schema is invalid: "),
        (lambda: Grammar.lark("start: foo"), 'the Lark grammar is invalid: .*unknown name: "foo"'),
    ],
)
def test_bad_grammars_are_one_line_errors(build, message):
    with pytest.raises(ValueError, match=message) as info:
        build()
    assert "\n" not in str(info.value)


def test_lark_takes_a_string():
    with pytest.raises(TypeError, match="a Lark grammar is a str, got dict"):
        Grammar.lark({"start": "x"})


# Exact constrained decoding on stories260K, with prompt lookup and the llama2xs281K draft.


@pytest.fixture(scope="module")
def stories():
    target, tokenizer = load(MODELS / "stories260K-llama")
    draft, _ = load(MODELS / "llama2xs281K-llama")
    return target, tokenizer, draft


def constrained_greedy(model, tokenizer, prompt, grammar, n):
    """The definition, one token per forward: the forced token where llguidance has one,
    else the argmax over the allowed tokens; stops after EOS."""
    matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar.source)
    eos, vocab = set(tokenizer.eos_token_ids), model.args.vocab_size
    cache = model.make_cache()
    logits = model(mx.array([prompt]), cache).logits[0, -1]
    out = []
    for _ in range(n):
        forced = matcher.compute_ff_tokens()
        if forced:
            token = forced[0]
        else:
            bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            allowed = np.unpackbits(bits, bitorder="little")[:vocab].astype(bool)
            token = int(np.argmax(np.where(allowed, np.asarray(logits), -np.inf)))
        out.append(token)
        if token in eos:
            break
        assert matcher.consume_token(token)
        logits = model(mx.array([[token]]), cache).logits[0, -1]
    return out


def generate_json(model, tokenizer, prompt, schema, **kwargs):
    """The responses of one constrained generation, checked to end, parse and validate."""
    responses = list(
        stream_generate(
            model, tokenizer, prompt, grammar=Grammar.json_schema(schema), max_tokens=300, **kwargs
        )
    )
    assert responses[-1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(r.text for r in responses)), schema)
    stats = responses[-1].stats
    assert stats.accepted == sum(r.from_draft for r in responses) <= stats.drafted
    assert 0 < stats.fast_forwarded <= len(responses)
    return responses


def methods(draft):
    return {
        "plain": None,
        "lookup": LookupSpec(num_draft_tokens=4),
        "draft_model": DraftModelSpec(model=draft, num_draft_tokens=4),
    }


@pytest.mark.parametrize("name", every_schema())
def test_stories_schemas(stories, name):
    target, tokenizer, draft = stories
    schema = SCHEMAS[name]
    prompt = tokenizer.encode(STORY)
    reference = constrained_greedy(target, tokenizer, prompt, Grammar.json_schema(schema), 300)
    for method, spec in methods(draft).items():
        greedy = generate_json(target, tokenizer, prompt, schema, drafter=spec)
        assert [r.token for r in greedy] == reference, method
        generate_json(target, tokenizer, prompt, schema, drafter=spec, temperature=0.8, seed=3)


# SmolLM2 (float32), drafting for itself and by prompt lookup.

SMOLLM2_SAMPLE = ("person",)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, smollm2_file):
    return load(convert(smollm2_file, tmp_path_factory.mktemp("smollm2") / "f32", dtype="float32"))


def chat_prompt(tokenizer, schema) -> list[int]:
    chat = [
        {"role": "user", "content": f"Reply in JSON following this schema: {json.dumps(schema)}"}
    ]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", every_schema(SMOLLM2_SAMPLE))
def test_smollm2_schemas(smollm2, name):
    model, tokenizer = smollm2
    schema = SCHEMAS[name]
    prompt = chat_prompt(tokenizer, schema)
    reference = constrained_greedy(model, tokenizer, prompt, Grammar.json_schema(schema), 300)
    for method, spec in methods(model).items():
        greedy = generate_json(model, tokenizer, prompt, schema, drafter=spec)
        assert [r.token for r in greedy] == reference, method
        generate_json(model, tokenizer, prompt, schema, drafter=spec, temperature=0.8, seed=3)


def test_speculation_accepts_and_fast_forwards(stories):
    # The draft model agrees often, the grammar forces the keys and punctuation: fewer
    # forwards than tokens, forced tokens never counted as accepted drafts.
    target, tokenizer, draft = stories
    schema = SCHEMAS["array_of_objects"]
    prompt = tokenizer.encode(STORY)
    for spec in (LookupSpec(num_draft_tokens=4), DraftModelSpec(model=draft, num_draft_tokens=4)):
        stats = generate_json(target, tokenizer, prompt, schema, drafter=spec)[-1].stats
        assert stats.accepted > 0
        assert stats.tokens_per_forward > 2
        assert stats.fast_forwarded > stats.generated / 3


def test_lark_grammar(stories):
    target, tokenizer, _ = stories
    grammar = Grammar.lark('start: "The answer is " ("yes" | "no") "."')
    text = "".join(
        r.text for r in stream_generate(target, tokenizer, STORY, grammar=grammar, max_tokens=30)
    )
    assert text in ("The answer is yes.", "The answer is no.")


def tree_specs(target):
    """Medusa and EAGLE-1 with random heads for the stories model: they draft trees."""
    config = json.loads((MODELS / "stories260K-llama" / "config.json").read_text())
    return {
        "medusa": MedusaSpec(heads=random_heads(64, target.args.vocab_size, seed=3)),
        "eagle": EagleSpec(heads=random_eagle_head(config, 1, seed=3), tree=EagleGrowth(16, 4, 4)),
    }


@pytest.mark.parametrize("method", ["medusa", "eagle"])
@pytest.mark.parametrize("name", every_schema(("array_of_objects",)))
def test_tree_drafters_under_a_grammar(stories, method, name):
    """Trees drafted by heads, cut by the grammar: greedy output equals constrained greedy
    token for token, and sampled output parses and validates."""
    target, tokenizer, _ = stories
    schema = SCHEMAS[name]
    prompt = tokenizer.encode(STORY)
    reference = constrained_greedy(target, tokenizer, prompt, Grammar.json_schema(schema), 300)
    spec = tree_specs(target)[method]
    greedy = generate_json(target, tokenizer, prompt, schema, drafter=spec)
    assert [r.token for r in greedy] == reference
    assert greedy[-1].stats.drafted > 0  # some tree nodes survived the grammar
    generate_json(target, tokenizer, prompt, schema, drafter=spec, temperature=0.8, seed=3)


# Sampling: a Markov stand-in target under a grammar whose state is the previous token, so
# the constrained output is a Markov chain with the masked, renormalised transitions.

V = 6  # tokens "a".."f"; the grammar's EOS (id 6) lies outside the model's vocabulary
TARGET_TABLE = np.random.default_rng(2).normal(scale=1.5, size=(V, V))
TARGET_TABLE[:, 0] += 1.0  # "a" often, so its constrained row is well sampled
TARGET_TABLE[0, 1:3] = 0.0  # after "a": "b" and "c" alike
DRAFT_TABLE = 0.5 * TARGET_TABLE + np.random.default_rng(3).normal(scale=1.5, size=(V, V))
# After "a" the draft mostly proposes what the grammar forbids, and "b" over "c": drawing
# the token there from the target's row instead of the residual would favour "b" visibly.
DRAFT_TABLE[0] = [1.5, 2.0, -3.0, 1.5, 1.5, 1.5]
# After "a" only "b" or "c"; after "e" only "f" (forced: fast-forwarded); else anything.
MARKOV_GRAMMAR = "start: /([bcdf]|a[bc]|ef)*/"
ALLOWED = np.ones((V, V), dtype=bool)
ALLOWED[0] = [False, True, True, False, False, False]
ALLOWED[4] = [False] * 5 + [True]
SAMPLED = 3000


class LetterTokenizer:
    """llguidance's plain tokenizer protocol: one letter per token, then an EOS."""

    tokens = [bytes([ord("a") + i]) for i in range(V)] + [b"</s>"]
    eos_token_id, bos_token_id, special_token_ids = V, None, [V]
    eos_token_ids = {V}

    def __call__(self, text):
        return [ord(c) - ord("a") for c in text.decode() if "a" <= c <= "f"]


class MarkovTreeDrafter(Drafter):
    """A tree drafter on DRAFT_TABLE: the `width` likeliest next letters, each followed by its
    own likeliest one (deterministic children, as heads draft), so that the grammar both
    forbids and forces some of the tree's nodes."""

    taps = ()
    max_draft = 6
    follows_context = False  # drafts below the pending token, as heads do

    def __init__(self, width: int = 3):
        self.width = width

    def weights(self) -> tuple:
        return ()

    def extend(self, features) -> None:
        pass

    def rewind(self, length: int) -> None:
        pass

    def propose(self, context, k, sampling) -> Draft | None:
        if k < 2:
            return None
        firsts = np.argsort(-DRAFT_TABLE[context[-1]])[: self.width].tolist()
        seconds = [int(np.argmax(DRAFT_TABLE[t])) for t in firsts]
        parents = [-1, *[0] * len(firsts), *range(1, len(firsts) + 1)]
        return Draft(mx.array(firsts + seconds, dtype=mx.int32), Tree(tuple(parents)))


@pytest.mark.parametrize(
    "drafter_kind, sampling",
    [
        ("none", SamplingParams(temperature=1.0)),
        ("lookup", SamplingParams(temperature=1.0)),
        ("lookup_chain", SamplingParams(temperature=1.0)),
        ("draft_model", SamplingParams(temperature=1.0)),
        ("draft_model", SamplingParams(temperature=0.7, top_k=3)),
        ("tree", SamplingParams(temperature=1.0)),
    ],
    ids=["none", "lookup", "lookup_chain", "draft_model", "draft_model-top_k", "tree"],
)
def test_constrained_sampling_follows_masked_target(drafter_kind, sampling):
    mx.random.seed(5)
    drafter = {
        "none": None,
        "draft_model": DraftModelDrafter(MarkovLM(DRAFT_TABLE), V),
        "lookup": LookupDrafter(max_ngram=2),  # trees below the forced run
        "lookup_chain": LookupDrafter(max_ngram=2, branches=1),
        "tree": MarkovTreeDrafter(),
    }[drafter_kind]
    constraint = Constraint(Grammar.lark(MARKOV_GRAMMAR), LetterTokenizer(), V)
    policy = FixedPolicy(0 if drafter is None else 3)
    target = MarkovLM(TARGET_TABLE)
    tokens, steps, _ = decode(
        target, [1], SAMPLED, drafter, policy, sampling, constraint=constraint
    )
    masked = np.where(ALLOWED, TARGET_TABLE, -np.inf)
    assert_markov(tokens, masked, sampling)  # a forbidden transition fails it outright
    assert sum(sum(s.forced) for s in steps) > 100  # the forced "f" after every "e"
    if drafter is not None:  # drafts accepted and rejected, forbidden ones among them
        assert sum(s.accepted for s in steps) > 200
        assert sum(s.accepted < s.drafted for s in steps) > 200


def test_markov_grammar_is_what_the_table_says():
    # ALLOWED mirrors the grammar: walk every transition through llguidance itself.
    tokenizer = ll_tokenizer(LetterTokenizer())
    source = Grammar.lark(MARKOV_GRAMMAR).source
    for prev in range(V):
        matcher = llguidance.LLMatcher(tokenizer, source)
        assert matcher.consume_token(prev)
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        assert (np.unpackbits(bits, bitorder="little")[:V].astype(bool) == ALLOWED[prev]).all()


# The chain one step verifies, on the Markov grammar: what is cut, kept and forced.


def guide_for(proposal, logprobs=None, context=(1,), room=8):
    """The guide for a drafter proposing `proposal` after `context` (letters as ids)."""
    constraint = Constraint(Grammar.lark(MARKOV_GRAMMAR), LetterTokenizer(), V)
    constraint.commit(list(context))
    seen = []

    def propose(ctx, k):
        seen.append(list(ctx))
        tokens = mx.array(proposal[:k], dtype=mx.int32)
        rows = None if logprobs is None else logprobs[: len(proposal[:k])]
        return Draft(tokens, Tree.chain(len(proposal[:k])), rows)

    return constraint.guide(list(context), propose, len(proposal), room), seen


def chain_of(guide):
    return [] if guide.draft is None else guide.draft.tokens.tolist()


def test_guide_cuts_forbidden_drafts():
    guide, _ = guide_for([0, 3, 1])  # "a" then "d": forbidden after "a"
    assert chain_of(guide) == [0]
    assert guide.drafted == 1 and guide.forced == (False, False)
    assert guide.allowed.tolist()[1] == ALLOWED[0].tolist()  # the row after "a"


def test_guide_fast_forwards_forced_tokens():
    # After "e" the grammar forces "f": the drafter's "f" is that forced token (not a draft),
    # and a drafter going elsewhere ends its part of the chain, the forced "f" added anyway.
    guide, _ = guide_for([4, 5, 1])
    assert chain_of(guide) == [4, 5, 1]
    assert guide.forced == (False, True, False, False) and guide.drafted == 2
    guide, _ = guide_for([4, 2, 1])
    assert chain_of(guide) == [4, 5] and guide.drafted == 1
    # A forced run at the start goes before the drafter's tokens, which follow it.
    guide, seen = guide_for([1, 2], context=(1, 4))
    assert chain_of(guide) == [5, 1, 2] and seen == [[1, 4, 5]]
    assert guide.forced[0] and guide.draft.logprobs is None


def test_guide_keeps_a_sampled_forbidden_draft_as_a_rejected_leaf():
    rows = mx.log(mx.full((3, V), 1 / V))
    guide, _ = guide_for([0, 3, 1], logprobs=rows)
    assert chain_of(guide) == [0, 3] and guide.drafted == 2
    assert guide.allowed.tolist()[2] == [True] * V  # never read: "d" is never accepted
    # The draft's rows by parent; a forced node's row is a point on it.
    guide, _ = guide_for([4, 5, 1], logprobs=rows)
    q = np.exp(np.asarray(guide.draft.logprobs))
    assert np.allclose(q[0], 1 / V) and q[1].tolist() == [0, 0, 0, 0, 0, 1]


# The tree one step verifies under a tree drafter, on the Markov grammar.


def tree_guide_for(tokens, parents, context=(1,)):
    constraint = Constraint(Grammar.lark(MARKOV_GRAMMAR), LetterTokenizer(), V)
    constraint.commit(list(context))
    proposed = []

    def propose():
        proposed.append(True)
        return Draft(mx.array(tokens, dtype=mx.int32), Tree(tuple(parents)))

    return constraint.tree_guide(propose, 8), proposed


def test_tree_guide_cuts_forbidden_subtrees():
    # Root "b"; children "a" (then "d": forbidden after "a", and "b"), "e" (then "f": forced
    # after "e", and "c": forbidden), "c".
    a, b, c, d, e, f = range(V)
    guide, _ = tree_guide_for([a, e, c, d, b, f, c], [-1, 0, 0, 0, 1, 1, 2, 2])
    assert guide.draft.tokens.tolist() == [a, e, c, b, f]
    assert guide.draft.tree.parents == (-1, 0, 0, 0, 1, 2)
    assert guide.drafted == 5
    assert guide.forced == (False, False, True, False, False, False)
    rows = guide.allowed.tolist()
    assert rows[1] == ALLOWED[a].tolist() and rows[2] == ALLOWED[e].tolist()
    assert rows[4] == ALLOWED[b].tolist()  # after "a", "b": the state after "b"


def test_tree_guide_runs_a_forced_token_without_drafting():
    # After "e" the grammar forces "f": the step is that forced run, the drafter is not asked
    # (its features are those of the pending "e").
    guide, proposed = tree_guide_for([0, 1], [-1, 0, 0], context=(1, 4))
    assert not proposed
    assert guide.draft.tokens.tolist() == [5] and guide.forced[0] and guide.drafted == 0


def test_a_lookup_tree_hangs_below_the_forced_run():
    # After "b e" the grammar forces "f"; prompt lookup's tree ("a" then "d" or "b"; "c") is
    # walked below it: "d" after "a" is forbidden and cut, the rest kept with their masks.
    a, b, c, d, e, f = range(V)
    constraint = Constraint(Grammar.lark(MARKOV_GRAMMAR), LetterTokenizer(), V)
    constraint.commit([b, e])
    seen = []

    def propose(context, k):
        seen.append(list(context))
        return Draft(mx.array([a, c, d, b], dtype=mx.int32), Tree((-1, 0, 0, 1, 1)))

    guide = constraint.guide([b, e], propose, 4, 8)
    assert seen == [[b, e, f]]
    assert guide.draft.tokens.tolist() == [f, a, c, b]
    assert guide.draft.tree.parents == (-1, 0, 1, 1, 2)
    assert guide.forced == (True, False, False, False, False) and guide.drafted == 3
    rows = guide.allowed.tolist()
    assert rows[0] == [i == f for i in range(V)] and rows[2] == ALLOWED[a].tolist()
    assert constraint.guide([b, e], lambda *_: None, 4, 8).draft.tokens.tolist() == [f]
