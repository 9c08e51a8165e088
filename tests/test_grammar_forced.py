"""Tokens the grammar forces where no draft reached: below a tree's nodes (they join the tree
as certain nodes) and at the end of the output (emitted without a forward). Fewer forwards,
the same output."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_speculate.drafters import Draft, LookupSpec
from mlx_speculate.generation import stream_generate
from mlx_speculate.grammar import Grammar
from mlx_speculate.grammar.constraint import Constraint
from mlx_speculate.policy.adaptive import FixedPolicy
from mlx_speculate.sampling import SamplingParams
from mlx_speculate.tree import Tree

from .helpers import decode
from .markov import MarkovLM
from .test_grammar import (
    ALLOWED,
    MARKOV_GRAMMAR,
    STORY,
    TARGET_TABLE,
    LetterTokenizer,
    MarkovTreeDrafter,
    V,
    constrained_greedy,
    stories,  # noqa: F401 (a fixture)
    tree_guide_for,
)

a, b, c, d, e, f = range(V)


def test_tree_guide_adds_the_forced_run_below_a_leaf():
    # Root "b"; children "e" (a leaf: the grammar forces "f" after it) and "a".
    guide, _ = tree_guide_for([e, a], [-1, 0, 0])
    assert guide.draft.tokens.tolist() == [e, a, f]
    assert guide.draft.tree.parents == (-1, 0, 0, 1)
    assert guide.forced == (False, True, False, False)  # "e"'s row is a point on "f"
    assert guide.drafted == 2  # the forced "f" is not a draft


def test_tree_guide_keeps_a_drafted_forced_token_as_is():
    # The drafter drafted the forced "f" below "e" itself: nothing is added.
    guide, _ = tree_guide_for([e, f], [-1, 0, 1])
    assert guide.draft.tokens.tolist() == [e, f]
    assert guide.draft.tree.parents == (-1, 0, 1) and guide.drafted == 2


class TopTreeDrafter(MarkovTreeDrafter):
    """The target's two likeliest allowed letters, each followed by its likeliest one (it
    drafts "e" at the second level, never the "f" forced after it)."""

    def propose(self, context, k, sampling) -> Draft | None:
        table = np.where(ALLOWED, TARGET_TABLE, -np.inf)
        firsts = np.argsort(-table[context[-1]])[:2].tolist()
        seconds = [int(np.argmax(table[t])) for t in firsts]
        return Draft(mx.array(firsts + seconds, dtype=mx.int32), Tree((-1, 0, 0, 1, 2)))


def test_forced_runs_below_tree_nodes_save_forwards():
    # The tree is two deep: a step emits more than 3 tokens only when it accepts a forced
    # "f" added below a drafted "e". Greedy output is plain greedy's, in fewer forwards.
    target, greedy = MarkovLM(TARGET_TABLE), SamplingParams()
    grammar = Grammar.lark(MARKOV_GRAMMAR)

    def run(drafter):
        constraint = Constraint(grammar, LetterTokenizer(), V)
        policy = FixedPolicy(0 if drafter is None else 2)
        return decode(target, [1], 400, drafter, policy, greedy, constraint=constraint)

    plain, plain_steps, _ = run(None)
    tokens, steps, _ = run(TopTreeDrafter())
    assert tokens == plain
    assert sum(len(s.tokens) == 4 and s.forced == (False, False, True, False) for s in steps) > 50
    assert len(steps) < len(plain_steps)


def test_a_forced_ending_takes_no_forward(stories):  # noqa: F811
    # After "yes" or "no", the "." and the EOS are forced: the step that emits them runs no
    # forward. One forward in all: the forced "The answer is " rides it, then yes or no.
    target, tokenizer, _ = stories
    grammar = Grammar.lark('start: "The answer is " ("yes" | "no") "."')
    prompt = tokenizer.encode(STORY)
    reference = constrained_greedy(target, tokenizer, prompt, grammar, 30)
    for spec in (None, LookupSpec(num_draft_tokens=4)):
        responses = list(
            stream_generate(target, tokenizer, prompt, grammar=grammar, drafter=spec, max_tokens=30)
        )
        assert [r.token for r in responses] == reference
        assert responses[-1].finish_reason == "stop"
        stats = responses[-1].stats
        assert stats.target_forwards == 1 and stats.generated == len(reference) - 1
        last = responses[-1].logprobs  # a forced token's log-probability is 0: certain
        assert mx.max(last).item() == 0.0 and last[reference[-1]].item() == 0.0
