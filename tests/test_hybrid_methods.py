"""Every method on a hybrid target (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): sampling with a draft
model follows the target's exact marginals, EAGLE chains are lossless (EAGLE trees refused in
one line), `Session` keeps the recurrent state right across turns, and the server answers chat
turns that share a prefix as plain greedy decoding does."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_speculate.chat import apply_chat_template
from mlx_speculate.decode import Decoder
from mlx_speculate.drafters import DraftModelSpec, EagleGrowth, EagleSpec, make_drafter
from mlx_speculate.drafters.base import Draft, Drafter
from mlx_speculate.drafters.draft_model import DraftModelDrafter
from mlx_speculate.drafters.lookup import LookupSpec
from mlx_speculate.generation import Session, stream_generate
from mlx_speculate.loading import build_model, load
from mlx_speculate.policy.adaptive import FixedPolicy
from mlx_speculate.sampling import SamplingParams
from mlx_speculate.sequence import Sequence
from mlx_speculate.tree import Tree

from .helpers import (
    decode,
    greedy_reference,
    leading_tokens,
    random_eagle_head,
    random_weights,
    tiny_config,
)
from .markov import StubTokenizer, assert_follows_marginal
from .serving import serve
from .test_hybrid import FAMILIES, GREEDY, VOCAB, save_hf, tiny_hybrid

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]


def llama_draft(seed: int = 3):
    """A tiny random Llama with the hybrids' vocabulary: it mostly disagrees with them."""
    cfg = tiny_config("llama", vocab_size=VOCAB)
    return build_model(cfg, random_weights(cfg, seed=seed))


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_sampling_with_a_draft_model_follows_the_target(model_type):
    """At temperature 1 the first and second tokens of many generations, drafted by a Llama
    that is often rejected, follow the hybrid target's exact marginals (Pearson's test)."""
    mx.random.seed(0)
    target, draft = tiny_hybrid(model_type), llama_draft()
    decoder = Decoder(Sequence(target, DraftModelDrafter(draft, VOCAB)))
    sampling = SamplingParams(temperature=1.0)
    draws = [leading_tokens(decoder, PROMPT, sampling, FixedPolicy(3), 2, 4) for _ in range(400)]
    assert_follows_marginal(target, PROMPT, 1.0, 0, [d[0] for d in draws])
    assert_follows_marginal(target, PROMPT, 1.0, 1, [d[1] for d in draws])
    with pytest.raises(AssertionError):  # the test tells the draft's distribution apart
        assert_follows_marginal(draft, PROMPT, 1.0, 0, [d[0] for d in draws])


def eagle_heads(target):
    config = {k: v for k, v in vars(target.args).items() if not k.startswith("_")}
    layers = target.args.num_hidden_layers
    return {
        version: random_eagle_head(config, version, 5, draft_vocab=None, taps=taps)
        for version, taps in ((1, None), (3, (0, layers // 2, layers - 1)))
    }


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_eagle_chains_equal_greedy_and_trees_are_refused(model_type):
    """Random EAGLE-1 and EAGLE-3 heads drafting chains: greedy output equals plain greedy
    decoding token for token (through the sequence and `stream_generate`); an EAGLE tree is
    refused in one line that names the chain setting."""
    target = tiny_hybrid(model_type)
    reference = greedy_reference(target, PROMPT, 32)
    for version, head in eagle_heads(target).items():
        drafter = make_drafter(EagleSpec(heads=head, tree=EagleGrowth.chain(4)), target)
        tokens, steps, _ = decode(target, PROMPT, 32, drafter, FixedPolicy(4))
        assert tokens == reference, version
        assert sum(s.drafted for s in steps) > 0
        spec = EagleSpec(heads=head, tree=EagleGrowth.chain(3))
        out = stream_generate(target, StubTokenizer(), PROMPT, max_tokens=32, drafter=spec)
        assert [r.token for r in out] == reference, version
        with pytest.raises(ValueError, match="verify chains only.*--tree-top-k 1") as refused:
            tree = make_drafter(EagleSpec(heads=head, tree=EagleGrowth(16, 4, 4)), target)
            decode(target, PROMPT, 8, tree, FixedPolicy(15))
        assert "\n" not in str(refused.value)


class ContextOracle(Drafter):
    """Proposes the target's greedy continuation of whatever the context is, with one wrong
    token at a seeded position, so that nearly every step accepts part of its draft."""

    taps: tuple[int, ...] = ()
    max_draft = 8
    follows_context = True

    def __init__(self, target, seed: int = 0):
        self.target, self.rng = target, np.random.default_rng(seed)

    def weights(self) -> tuple:
        return ()

    def extend(self, features) -> None:
        pass

    def rewind(self, length: int) -> None:
        pass

    def propose(self, context, k, sampling) -> Draft | None:
        draft = greedy_reference(self.target, list(context), k)
        wrong = int(self.rng.integers(0, k + 1))  # k: all right
        if wrong < k:
            draft[wrong] = (draft[wrong] + 1) % VOCAB
        return Draft(mx.array(draft, dtype=mx.int32), Tree.chain(k))


def session_run(session: Session, prompt: list[int], n: int, policy=None):
    return list(session.stream(prompt, sampling=GREEDY, max_tokens=n, policy=policy))


def tokens_of(responses) -> list[int]:
    return [r.token for r in responses]


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_session_turns_keep_the_recurrent_state_right(model_type):
    """With prompt lookup on, and with a drafter whose drafts are partly accepted, each turn
    of one `Session` (the next turn extending the last context, then one that goes back into
    its middle, then one past the first) gives what a fresh `Session` gives for the same
    prompt, and that is plain greedy decoding; the turns reuse the cached prefix."""
    target = tiny_hybrid(model_type)
    lookup = LookupSpec(max_ngram=2)
    for make, k in ((lambda: lookup.build(target), None), (lambda: ContextOracle(target), 4)):
        policy = None if k is None else FixedPolicy(k)
        session = Session(target, StubTokenizer(), make())
        first = tokens_of(session_run(session, PROMPT, 20, policy))
        assert first == greedy_reference(target, PROMPT, 20)
        follow = PROMPT + first + [11, 12, 5, 6, 7]
        back = PROMPT + first[:7] + [40, 41]
        for prompt in (follow, back, follow + [3]):
            ours = session_run(session, prompt, 20, policy)
            if prompt is follow:  # a state further back than the last step's is re-prefilled
                assert ours[0].cached_tokens >= len(PROMPT) + len(first) - 1
            if k is not None:
                assert 0 < sum(r.from_draft for r in ours) < 20
            fresh = session_run(Session(target, StubTokenizer(), make()), prompt, 20, policy)
            expected = greedy_reference(target, prompt, 20)
            assert tokens_of(ours) == tokens_of(fresh) == expected, len(prompt)


@pytest.fixture(scope="module")
def hybrid_folder(tmp_path_factory):
    return save_hf(tmp_path_factory.mktemp("hybrid") / "hf", "qwen3_5_text")


@pytest.mark.parametrize("method", ["prompt_lookup", "draft_model"])
def test_server_chat_turns_equal_plain_greedy(hybrid_folder, method):
    """Chat requests through the `openai` client to a served hybrid folder: the second extends
    the first's conversation (the session's prefix cache reused), the third replaces the
    second's last message (a state further back than the cache keeps: re-prefilled). Each
    answer is plain greedy `generate` of the same prompt."""
    model, tokenizer = load(hybrid_folder)
    spec = DraftModelSpec(model=llama_draft(), tokenizer=tokenizer)
    first = [{"role": "user", "content": " ".join(f"w{t}" for t in PROMPT)}]
    with serve(model, tokenizer, spec, model_id="hybrid") as running:
        client = running.client()

        def ask(messages) -> str:
            completion = client.chat.completions.create(
                model="hybrid",
                messages=messages,
                max_tokens=16,
                temperature=0,
                extra_body={"speculative": {"method": method, "num_draft_tokens": 3}},
            )
            answer = completion.choices[0].message.content
            tokens = apply_chat_template(tokenizer, messages)
            plain = stream_generate(model, tokenizer, tokens, max_tokens=16)
            assert answer == "".join(r.text for r in plain), messages[-1]
            assert completion.usage.completion_tokens == 16  # the tokenizer's EOS never came
            speculative = completion.usage.speculative
            assert speculative["method"] == method and speculative["drafted_tokens"] > 0
            return answer, completion.usage.prompt_tokens_details.cached_tokens

        answer, _ = ask(first)
        earlier = [*first, {"role": "assistant", "content": answer}]
        _, cached = ask([*earlier, {"role": "user", "content": "w11 w12 w5 w6"}])
        assert cached > len(PROMPT) + 8
        ask([*earlier, {"role": "user", "content": "w40 w41"}])
