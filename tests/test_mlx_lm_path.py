"""Model types mlx-lm knows and this package does not implement run through mlx-lm's own
module (models/mlx_lm_model.py): tiny random folders that transformers saved, of a dense
(OLMo 2), an MoE (Mixtral), a multi-head latent attention (DeepSeek-V3), a short-conv hybrid
(LFM2), a Mamba-2 hybrid (Nemotron-H) and a sliding-window (Cohere 2) family, give mlx-lm's
logits; greedy speculation with prompt lookup and draft models equals plain greedy decoding;
the recurrent states and the wrapped window roll back exactly after rejections; sampling
follows the target; grammars and the server work; tree and head methods refuse in one line; a
4-bit folder mlx-lm made loads."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest

from mlx_speculate.batch import check_batchable
from mlx_speculate.decode import Decoder
from mlx_speculate.drafters import DraftModelSpec, make_drafter, spec_from_keywords
from mlx_speculate.drafters.draft_model import DraftModelDrafter
from mlx_speculate.drafters.lookup import LookupDrafter, LookupSpec
from mlx_speculate.generate import main
from mlx_speculate.generation import stream_generate
from mlx_speculate.grammar import Grammar
from mlx_speculate.grammar.constraint import Constraint
from mlx_speculate.loading import load
from mlx_speculate.models import MODEL_TYPES
from mlx_speculate.policy.adaptive import FixedPolicy
from mlx_speculate.sampling import SamplingParams
from mlx_speculate.sequence import Sequence

from .families import PROMPT, REPEATING, check_sampled_marginal, save_hf
from .helpers import TINY, assert_clear_argmax, decode, greedy_reference, tiny_model
from .markov import StubTokenizer
from .serving import serve
from .test_convert import save_tokenizer
from .test_grammar import constrained_greedy

VOCAB = TINY["vocab_size"]
FAMILIES = {
    "olmo2": {},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v3": {
        "kv_lora_rank": 16,
        "q_lora_rank": 24,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 1,
    },
    # Layer 0 a gated short convolution (a recurrent state), layer 1 attention; mlx-lm's
    # LFM2 ties its embeddings.
    "lfm2": {
        "layer_types": ["conv", "full_attention"],
        "block_dim": 64,
        "block_ff_dim": 96,
        "conv_L_cache": 3,
        "norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
    # Mamba-2 layers (0 and 3) around an attention layer and an MLP layer.
    "nemotron_h": {
        "hybrid_override_pattern": "M*-M",
        "num_hidden_layers": 4,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "n_groups": 2,
        "conv_kernel": 4,
        "expand": 1,
        "head_dim": 16,
        "layer_norm_epsilon": 1e-5,
        "chunk_size": 8,
    },
    # A sliding window of 4 on layer 0 (mlx-lm's RotatingKVCache, which wraps: no trim).
    "cohere2": {
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window_pattern": 2,  # what mlx-lm reads of layer_types
        "tie_word_embeddings": True,
    },
}
HYBRIDS = ("lfm2", "nemotron_h")
# Whose caches roll back by a copy and a replay (the hybrids' recurrent state, a window).
REPLAYING = (*HYBRIDS, "cohere2")
# Seeds whose greedy tokens have clear margins (helpers.assert_clear_argmax).
SEEDS = {"olmo2": 0, "mixtral": 5, "deepseek_v3": 3, "lfm2": 0, "nemotron_h": 3, "cohere2": 0}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A float32 folder per family, as transformers saves it, with a word-level tokenizer."""
    root = tmp_path_factory.mktemp("mlx_lm_path")
    made = {}
    for model_type, extra in FAMILIES.items():
        folder = root / model_type
        save_hf(folder, {"model_type": model_type, **TINY, **extra}, seed=SEEDS[model_type])
        save_tokenizer(folder, VOCAB)
        made[model_type] = folder
    return made


@pytest.fixture(scope="module")
def models(folders):
    return {model_type: load(folder)[0] for model_type, folder in folders.items()}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_family_loads_through_mlx_lm_with_its_logits(folders, models, model_type):
    model = models[model_type]
    assert model_type not in MODEL_TYPES
    assert model.implementation == "mlx-lm"
    assert model.recurrent == (model_type in REPLAYING)
    assert not model.verifies_trees
    theirs, _ = mlx_lm.load(str(folders[model_type]))
    tokens = mx.array([REPEATING])
    expected = theirs(tokens)
    assert mx.array_equal(model(tokens).logits, expected)
    # Prefill, then a token a step in its cache: the same logits as the whole forward.
    cache = model.make_cache()
    rows = [model(tokens[:, :9], cache).logits[0]]
    rows += [model(tokens[:, t : t + 1], cache).logits[0] for t in range(9, len(REPEATING))]
    assert mx.allclose(mx.concatenate(rows), expected[0], atol=1e-5, rtol=1e-4)
    assert cache.offset == len(REPEATING)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_speculation_equals_plain_greedy(folders, models, model_type):
    """Prompt lookup (a chain) and draft models equal plain greedy decoding token for token:
    a random draft model (rejections almost every step) and, for attention-only targets,
    the target's folder loaded again through the mlx-lm path (drafts mostly accepted)."""
    target, n = models[model_type], 24
    drafts = {"random": tiny_model("llama", seed=11)}
    if not target.recurrent:
        drafts["itself"] = load(folders[model_type])[0]
    for prompt in (PROMPT, REPEATING):
        reference = greedy_reference(target, prompt, n)
        assert_clear_argmax(target, prompt, reference)
        drafters = {"lookup": LookupDrafter(max_ngram=3, branches=1)}
        drafters |= {name: DraftModelDrafter(d, VOCAB) for name, d in drafts.items()}
        for name, drafter in drafters.items():
            tokens, steps, _ = decode(target, prompt, n, drafter, FixedPolicy(4))
            assert tokens == reference, (model_type, name)
            drafted, accepted = sum(s.drafted for s in steps), sum(s.accepted for s in steps)
            if name == "random":
                assert accepted < drafted, (accepted, drafted)
            if name == "itself":
                assert accepted > drafted // 2, (accepted, drafted)
        # The public entry with the default (adaptive) policy.
        for options in ({"prompt_lookup": True}, {"draft_model": drafts["random"]}):
            out = stream_generate(target, StubTokenizer(), prompt, max_tokens=n, **options)
            assert [r.token for r in out] == reference, options


@pytest.mark.parametrize("model_type", REPLAYING)
def test_replaying_caches_roll_back_exactly_after_rejections(models, model_type):
    """A verify-like forward of 5 tokens, truncated to 2 of them: the next forward gives the
    logits of a forward of the whole sequence; decoding with a bad draft equals plain greedy
    decoding, also for a second prompt that shares a prefix the caches cannot return to."""
    model = models[model_type]
    tokens = mx.array([REPEATING])
    expected = model(tokens).logits[0]
    cache = model.make_cache()
    model(tokens[:, :8], cache)
    model(tokens[:, 8:13], cache)  # 5 rows, 2 of them accepted
    cache.truncate(10)
    out = model(tokens[:, 10:12], cache).logits[0]
    assert mx.allclose(out, expected[10:12], atol=1e-5, rtol=1e-4)
    unreachable = r"^cannot roll mlx-lm's caches back to 4 tokens: only 10 to 12 "
    with pytest.raises(ValueError, match=unreachable):
        cache.truncate(4)
    assert cache.restorable(4) == 0 and cache.restorable(11) == 11
    cache.truncate(0)  # a fresh state
    out = model(tokens[:, :3], cache).logits[0]
    assert mx.allclose(out, expected[:3], atol=1e-5, rtol=1e-4)

    decoder = Decoder(Sequence(model, DraftModelDrafter(tiny_model("llama", seed=11), VOCAB)))
    for prompt in (REPEATING, REPEATING + [40, 41]):
        reference = greedy_reference(model, prompt, 16)
        decoder.sequence.prefill(prompt)
        steps = []
        for step in decoder.steps(SamplingParams(), FixedPolicy(4)):
            steps.append(step)
            if sum(len(s.tokens) for s in steps) >= 16:
                break
        tokens = [t for s in steps for t in s.tokens][:16]
        assert tokens == reference
        assert sum(s.accepted for s in steps) < sum(s.drafted for s in steps)


def test_sampled_speculation_follows_the_target_through_mlx_lm(models):
    """A draft model at temperature 1 on the Mamba hybrid: the second token of many
    generations follows the target's exact marginal (Pearson's test, tests/markov.py)."""
    check_sampled_marginal(models["nemotron_h"], tiny_model("llama", seed=11), draws=400)


class CharTokenizer:
    """llguidance's plain tokenizer protocol over the folders' ids: id i is the character
    chr(32 + i), the last id the EOS."""

    tokens = [bytes([32 + i]) for i in range(VOCAB - 1)] + [b"</s>"]
    eos_token_id, bos_token_id, special_token_ids = VOCAB - 1, None, [VOCAB - 1]
    eos_token_ids = {VOCAB - 1}

    def __call__(self, text):
        return [c - 32 for c in text]


@pytest.mark.parametrize("model_type", ["olmo2", "nemotron_h"])
def test_grammars_constrain_speculation_through_mlx_lm(models, model_type):
    """Under a grammar, plain decoding, prompt lookup and a draft model give the constrained
    greedy tokens (tests/test_grammar.py's definition, one token per forward)."""
    model, tokenizer = models[model_type], CharTokenizer()
    grammar = Grammar.lark(r'start: (/[a-h]/ /[0-9]/ /[q-z]/)+ "."')
    reference = constrained_greedy(model, tokenizer, REPEATING, grammar, 16)
    assert len(set(reference)) > 2
    drafters = {
        "plain": None,
        "lookup": LookupDrafter(max_ngram=3, branches=1),
        "draft": DraftModelDrafter(tiny_model("llama", seed=11), VOCAB),
    }
    for name, drafter in drafters.items():
        constraint = Constraint(grammar, tokenizer, VOCAB)
        policy = FixedPolicy(0 if drafter is None else 3)
        tokens, _, _ = decode(
            model, REPEATING, len(reference), drafter, policy, constraint=constraint
        )
        assert tokens == reference, name


def test_the_server_serves_an_mlx_lm_model_one_request_at_a_time(folders):
    """Each method's greedy completion is plain greedy decoding's text (the engine refuses the
    model, so requests run one at a time)."""
    model, tokenizer = load(folders["olmo2"])
    prompt = " ".join(f"w{t}" for t in REPEATING)
    reference = greedy_reference(model, tokenizer.encode(prompt), 8)
    spec = DraftModelSpec(model=tiny_model("llama", seed=11))
    with serve(model, tokenizer, spec, model_id="olmo2", max_batch=8) as running:
        for method in ("none", "prompt_lookup", "draft_model"):
            completion = running.client().completions.create(
                model="olmo2",
                prompt=prompt,
                max_tokens=8,
                temperature=0,
                extra_body={"speculative": {"method": method}},
            )
            assert completion.choices[0].text == tokenizer.decode(reference), method


def test_trees_and_head_methods_refuse_in_one_line(models):
    model = models["olmo2"]
    natives = ", ".join(MODEL_TYPES)
    for keyword, value in (
        ("medusa", True),
        ("eagle", True),
        ("mtp", True),
        ("dflash", True),
        ("assistant", "an-assistant-folder"),
    ):
        spec = spec_from_keywords(**{keyword: value})
        with pytest.raises(ValueError) as e:
            make_drafter(spec, model)
        message = str(e.value)
        assert "\n" not in message
        assert message.startswith(f"{spec.method} needs a model type this package implements")
        assert natives in message and "olmo2 runs through mlx-lm's module" in message
    with pytest.raises(ValueError, match=r"^prompt lookup with lookup_branches > 1 needs"):
        make_drafter(LookupSpec(branches=3), model)
    assert make_drafter(LookupSpec(), model).branches == 1  # chains by default
    cache = model.make_cache()
    with pytest.raises(ValueError, match=r"^a draft tree needs a model type"):
        cache.check_verify(4, is_chain=False)
    with pytest.raises(ValueError, match=r"^a draft tree needs a model type"):
        model(mx.array([[1, 2]]), cache, mask=mx.zeros((2, 2)))
    with pytest.raises(ValueError, match=r"olmo2 runs through mlx-lm's module.*--max-batch 1"):
        check_batchable(model)


def test_a_4bit_folder_mlx_lm_made_loads(folders, tmp_path):
    from mlx_lm import convert

    out = tmp_path / "olmo2-4bit"
    convert(str(folders["olmo2"]), str(out), quantize=True, q_group_size=32, q_bits=4)
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4
    model, _ = load(out)
    theirs, _ = mlx_lm.load(str(out))
    tokens = mx.array([REPEATING])
    expected = theirs(tokens)
    assert model.implementation == "mlx-lm"
    assert mx.allclose(model(tokens).logits, expected, atol=1e-4, rtol=1e-4)
    reference = greedy_reference(model, REPEATING, 16)
    tokens_, _, _ = decode(model, REPEATING, 16, LookupDrafter(3, branches=1), FixedPolicy(4))
    assert tokens_ == reference


def test_an_unknown_type_stays_a_one_line_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_family"}))
    with pytest.raises(ValueError, match=r"^model_type 'no_such_family' is not supported"):
        load(tmp_path)


def test_the_cli_says_which_path_the_model_took_and_refuses_heads(folders, capsys):
    args = ["--model", str(folders["olmo2"]), "--prompt", "w1 w2", "-m", "2"]
    assert main([*args, "--ignore-chat-template", "--verbose"]) == 0
    assert "model: olmo2, through mlx-lm's module" in capsys.readouterr().err
    assert main([*args, "--medusa", "some-heads"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: medusa needs a model type this package implements (llama")
    assert err.count("\n") == 1
