"""The method registry: keywords, flags and tree options resolve in one place, and every
mismatch is a one-line error naming the keyword."""

import pytest

from mlx_speculate.drafters import (
    METHODS,
    AssistantSpec,
    DFlashSpec,
    DraftModelSpec,
    EagleGrowth,
    EagleSpec,
    LookupSpec,
    MedusaSpec,
    MtpSpec,
    spec_from_keywords,
)
from mlx_speculate.generation import stream_generate

from .helpers import tiny_model
from .markov import StubTokenizer


def test_every_method_registers_itself():
    assert METHODS == {
        "assistant": AssistantSpec,
        "dflash": DFlashSpec,
        "draft_model": DraftModelSpec,
        "eagle": EagleSpec,
        "prompt_lookup": LookupSpec,
        "medusa": MedusaSpec,
        "mtp": MtpSpec,
    }
    for spec in METHODS.values():
        assert set(spec.flags) <= set(spec.keywords)


def test_typed_tree_keywords():
    assert spec_from_keywords(medusa=True, medusa_tree="mc_sim_7b_63").tree == "mc_sim_7b_63"
    assert spec_from_keywords(eagle=True, eagle_tree=EagleGrowth(10)).tree == EagleGrowth(10)
    # The old tree= keyword still works where its type fits the method.
    assert spec_from_keywords(medusa=True, tree=[[0], [1], [0, 0]]).tree == [[0], [1], [0, 0]]
    assert spec_from_keywords(eagle=True, tree=EagleGrowth(5)).tree == EagleGrowth(5)
    assert spec_from_keywords(mtp=True, num_draft_tokens=2).head is True
    spec = spec_from_keywords(prompt_lookup=True, max_ngram=2, num_draft_tokens=3)
    assert (type(spec), spec.max_ngram, spec.num_draft_tokens) == (LookupSpec, 2, 3)


@pytest.mark.parametrize(
    "keywords, error, words",
    [
        ({"eagle": True, "tree": "mc_sim_7b_63"}, TypeError, "eagle_tree must be an EagleGrowth"),
        ({"medusa": True, "tree": EagleGrowth()}, TypeError, "medusa_tree must be a Medusa tree"),
        ({"eagle": True, "medusa_tree": "mc_sim_7b_63"}, ValueError, "medusa_tree applies to"),
        ({"medusa": True, "eagle_tree": EagleGrowth()}, ValueError, "eagle_tree applies to eagle"),
        ({"medusa": True, "medusa_tree": "nope"}, ValueError, "medusa_tree 'nope' is unknown"),
        ({"medusa": True, "tree": "a", "medusa_tree": "b"}, ValueError, "give tree or medusa_tree"),
        ({"prompt_lookup": True, "tree": "a"}, ValueError, "tree applies to eagle or medusa only"),
        ({"eagle": True, "typical_acceptance": True}, ValueError, "applies to medusa only"),
        ({"prompt_lookup": True, "medusa": True}, ValueError, "not prompt_lookup and medusa"),
        ({"num_draft_tokens": 3}, ValueError, "need a speculative method"),
        ({"prompt_lookup": True, "max_ngrams": 2}, TypeError, "unexpected keyword 'max_ngrams'"),
    ],
)
def test_mismatched_keywords_are_one_line_errors(keywords, error, words):
    with pytest.raises(error, match=words) as info:
        spec_from_keywords(**keywords)
    assert "\n" not in str(info.value)


def test_stream_generate_names_the_tree_keyword():
    model, tokenizer = tiny_model(), StubTokenizer()
    with pytest.raises(TypeError, match="eagle_tree must be an EagleGrowth"):
        next(stream_generate(model, tokenizer, [1, 2], eagle=True, tree="mc_sim_7b_63"))
    with pytest.raises(TypeError, match="medusa_tree must be a Medusa tree name"):
        next(stream_generate(model, tokenizer, [1, 2], medusa=True, tree=EagleGrowth()))


def test_spec_constructors_check_their_tree_type():
    with pytest.raises(TypeError, match="eagle_tree must be an EagleGrowth"):
        EagleSpec(tree="mc_sim_7b_63")
    with pytest.raises(ValueError, match="typical_acceptance applies to medusa only"):
        LookupSpec(typical_acceptance=True)
    assert MedusaSpec(typical_acceptance=True).typical_acceptance
