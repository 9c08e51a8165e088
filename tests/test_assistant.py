"""Gemma 4 assistant drafters: the drafted chains' distributions against transformers (its
target's shared keys and its assistant, in float64), lossless greedy and sampled speculation,
the method through generate and its CLI, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_speculate.batch import BatchEngine, Handle
from mlx_speculate.batch.engine import batch_stream
from mlx_speculate.decode import Decoder
from mlx_speculate.drafters import AssistantSpec, make_drafter, spec_from_keywords
from mlx_speculate.drafters.base import TargetFeatures
from mlx_speculate.generate import main
from mlx_speculate.generation import Session, generate
from mlx_speculate.heads.gemma4_assistant import AssistantArgs, Gemma4Assistant
from mlx_speculate.loading import build_model, load_model
from mlx_speculate.policy.adaptive import FixedPolicy
from mlx_speculate.sampling import SamplingParams
from mlx_speculate.sequence import Sequence

from .families import randomize
from .gemma4_models import gemma4_weights
from .helpers import assert_clear_argmax, decode, greedy_reference, tiny_config, tiny_model
from .markov import StubTokenizer, assert_follows_marginal
from .test_convert import save_tokenizer
from .test_gemma4 import save_gemma4
from .test_models import assert_close

pytest.importorskip("torch")

S, F = "sliding_attention", "full_attention"
# A target whose layers 3 and 4 write no keys: the assistant reads sliding layer 2's and
# global layer 1's (transformers' `shared_kv_states`), with a window of 6 below the prompts.
SHARED = {"num_hidden_layers": 5, "layer_types": [S, F, S, S, F], "num_kv_shared_layers": 2}
# Its global layers take one key head, values from keys; other ropes than the defaults.
K_EQ_V = {"attention_k_eq_v": True, "num_global_key_value_heads": 1}
ROPES = {
    S: {"rope_type": "default", "rope_theta": 100.0},
    F: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 100.0},
}
# The assistant's layers: narrower than the target (48 against 64), one of each type, with
# the target's key shapes (head sizes 16 and 32).
LAYERS = {
    "hidden_size": 48, "num_hidden_layers": 2, "intermediate_size": 64, "layer_types": [S, F],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
    "sliding_window": 6, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
    "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
}  # fmt: skip
PROMPT = [1, 5, 9, 33, 7, 2, 60, 11, 5, 9, 33]
GREEDY = SamplingParams()


def text_config(vocab: int, **overrides) -> dict:
    return {"model_type": "gemma4_text", **LAYERS, "vocab_size": vocab, **overrides}


def assistant_config(vocab: int, backbone: int = 64, text: dict | None = None, **top) -> dict:
    """A config.json as transformers writes it for Gemma4AssistantForCausalLM."""
    return {
        "model_type": "gemma4_assistant",
        "architectures": ["Gemma4AssistantForCausalLM"],
        "backbone_hidden_size": backbone,
        "text_config": text_config(vocab, **(text or {})),
        **top,
    }


# -- (1) against transformers -----------------------------------------------------------------

VARIANTS = {
    # Tied embeddings scoring the whole vocabulary.
    "tied": ({}, {}, {}),
    # Sparse logits: 12 clusters of 8 tokens, the best 3 scored.
    "ordered": (
        {"vocab_size": 96, "vocab_size_per_layer_input": 96},
        {},
        {"use_ordered_embeddings": True, "num_centroids": 12, "centroid_intermediate_top_k": 3},
    ),
    # An untied lm_head; global keys of one head whose values are the keys; other ropes.
    "untied-k-eq-v": (
        {**K_EQ_V, "rope_parameters": ROPES},
        {**K_EQ_V, "rope_parameters": ROPES},
        {"tie_word_embeddings": False},
    ),
}


def save_hf_assistant(folder: Path, config: dict, seed: int = 1):
    """A random transformers assistant for `config` saved in float32 (its layer scales and
    token ordering random too); returns it in float64 with eager attention."""
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    settings = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    text = {**settings.pop("text_config")}
    text |= {"pad_token_id": None, "eos_token_id": None, "bos_token_id": None}
    hf_config = Gemma4AssistantConfig(text_config=text, **settings, attn_implementation="eager")
    model = Gemma4AssistantForCausalLM(hf_config).float().eval()
    randomize(model, seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=generator))
        if model.masked_embedding is not None:
            vocab = text["vocab_size"]
            model.masked_embedding.token_ordering.copy_(torch.randperm(vocab, generator=generator))
    model.save_pretrained(folder)
    return model.double()


def reference_chain(target, assistant, context: list[int], drafted: list[int]) -> np.ndarray:
    """transformers' generation step (SinglePositionMultiTokenCandidateGenerator) in float64:
    the target over the committed positions gives its shared keys and last state; each step
    reads the target's embedding of the token before and the state before, at the pending
    token's position. (k, V) log-probabilities of the chain `drafted`."""
    import torch

    committed = torch.tensor([context[:-1]])
    with torch.no_grad():
        out = target(committed, output_hidden_states=True, return_shared_kv_states=True)
        shared = dict(out.shared_kv_states)
        state, token, rows = out.hidden_states[-1][:, -1:], context[-1], []
        position = torch.tensor([[len(context) - 1]])
        for next_token in drafted:
            embedding = target.get_input_embeddings()(torch.tensor([[token]]))
            step = assistant(
                inputs_embeds=torch.cat([embedding, state], dim=-1),
                position_ids=position,
                shared_kv_states=shared,
            )
            rows.append(torch.log_softmax(step.logits[0, -1], dim=-1).numpy())
            token, state = next_token, step.last_hidden_state
    return np.stack(rows)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_chains_match_transformers(tmp_path, name):
    """Sampled chains come with transformers' distributions at every step: after a prompt
    longer than the window, and again after three more committed positions (the drafter's
    key cache extended past its last proposal)."""
    target_overrides, layer_overrides, top = VARIANTS[name]
    config = tiny_config("gemma4_text", **SHARED, **target_overrides)
    target_ref = save_gemma4(tmp_path / "target", config)
    vocab = config["vocab_size"]
    assistant_ref = save_hf_assistant(
        tmp_path / "assistant", assistant_config(vocab, text=layer_overrides, **top)
    )
    target = load_model(tmp_path / "target")[0]
    drafter = make_drafter(AssistantSpec(assistant=tmp_path / "assistant"), target)
    assert drafter.taps == (2, 1)  # the last writing sliding and global layers
    sampling = SamplingParams(temperature=1.0)
    mx.random.seed(0)
    context, cache = PROMPT[:-1], target.make_cache()
    for step, more in enumerate(([], [40, 3, 17])):
        rows = context[-1:] + more if step else context
        out = target(mx.array([rows]), cache, taps=drafter.taps)
        drafter.extend(TargetFeatures(out.hidden[0], tuple(t[0] for t in out.taps)))
        context = context + more + [8 + step]
        draft = drafter.propose(context, 3, sampling)
        assert draft.tokens.shape == (3,)
        expected = reference_chain(target_ref, assistant_ref, context, draft.tokens.tolist())
        assert_close(draft.logprobs, expected)


# -- (2) lossless speculation -----------------------------------------------------------------


def markov_target(seed: int, **overrides):
    """A random Gemma 4 whose layers write little into the residual stream (their output norms
    shrunk), so its next token follows mostly from the last one, partly from the rest."""
    config = tiny_config("gemma4_text", **SHARED, **overrides)
    weights = gemma4_weights(config, seed)
    quiet = ("post_attention_layernorm", "post_feedforward_layernorm", "post_per_layer_input")
    for name in weights:
        if any(part in name for part in quiet):
            weights[name] = 0.15 * weights[name]
    return config, weights


def copying_assistant(target_config: dict, target_weights: dict, seed: int = 3) -> dict:
    """Weights (in transformers' names) of an assistant as wide as the target that passes the
    target's embedding of its token through `pre_projection`, over layers that write little,
    normed and scored as the target does (its final norm and lm_head): it predicts what the
    target predicts after the token alone. Its state goes out unchanged (`post_projection` the
    identity)."""
    args = AssistantArgs.from_dict(copying_config(target_config), "test")
    params = tree_flatten(Gemma4Assistant(args).parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    weights = {}
    for key, (name, value) in zip(keys, params, strict=True):
        weights[name] = 0.1 * mx.random.normal(value.shape, key=key)
        if "norm" in name or "layer_scalar" in name:
            weights[name] = mx.ones(value.shape) * (0.1 if "post_" in name else 1.0)
    h = target_config["hidden_size"]
    weights["pre_projection.weight"] = mx.concatenate([mx.eye(h), mx.zeros((h, h))], axis=1)
    weights["post_projection.weight"] = mx.eye(h)
    weights["lm_head.weight"] = target_weights["lm_head.weight"]
    weights["model.norm.weight"] = target_weights["model.norm.weight"]
    return weights


def copying_config(target_config: dict) -> dict:
    """As wide as the target, scoring with an lm_head of its own (the target's)."""
    vocab, h = target_config["vocab_size"], target_config["hidden_size"]
    return assistant_config(vocab, h, text={"hidden_size": h}, tie_word_embeddings=False)


def save_folder(folder: Path, config: dict, weights: dict, tokenizer: int = 0) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    if tokenizer:
        save_tokenizer(folder, tokenizer)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A Markov-like target (with a tokenizer), an assistant that copies it and one of
    random weights, which mostly disagrees."""
    root = tmp_path_factory.mktemp("assistant")
    config, weights = markov_target(4)
    target = save_folder(root / "target", config, weights, tokenizer=config["vocab_size"])
    copying = copying_assistant(config, weights)
    copying = save_folder(root / "copying", copying_config(config), copying)
    save_hf_assistant(root / "random", assistant_config(config["vocab_size"]), seed=5)
    return {"target": target, "copying": copying, "random": root / "random"}


@pytest.mark.parametrize("assistant", ["copying", "random"])
def test_greedy_speculation_equals_plain_decoding(folders, assistant):
    """Token for token, after prompts longer than the window, with chains of 3 (and of 2
    through `generate`'s keyword); the copying assistant's drafts are accepted whole, in part
    and not at all, the random one's mostly not."""
    target = load_model(folders["target"])[0]
    spec = AssistantSpec(assistant=folders[assistant])
    for prompt in (PROMPT, [(7 * i) % 97 for i in range(30)]):
        reference = greedy_reference(target, prompt, 40)
        assert_clear_argmax(target, prompt, reference)
        tokens, steps, _ = decode(target, prompt, 40, make_drafter(spec, target), FixedPolicy(3))
        assert tokens == reference
        accepted = [s.accepted for s in steps if s.drafted]
        if assistant == "copying":
            assert max(accepted) == 3 and min(accepted) == 0, accepted
        else:
            assert sum(accepted) < len(accepted), accepted
    options = {"assistant": spec.assistant, "num_draft_tokens": 2}
    text = generate(target, StubTokenizer(), PROMPT, max_tokens=20, **options)
    assert text.split() == [str(t) for t in greedy_reference(target, PROMPT, 20)]


def test_greedy_speculation_past_the_targets_rings(folders):
    """The target's sliding layers wrap their rings (cache.py) while the assistant reads the
    keys it made of every position: still plain greedy decoding's tokens."""
    target = load_model(folders["target"])[0]
    n = 220
    assert len(PROMPT) + n > target.make_cache().ring_size
    reference = greedy_reference(target, PROMPT, n)
    assert_clear_argmax(target, PROMPT, reference)
    spec = AssistantSpec(assistant=folders["copying"])
    tokens, steps, _ = decode(target, PROMPT, n, make_drafter(spec, target), FixedPolicy(3))
    assert tokens == reference
    assert sum(s.accepted for s in steps) > 0


def test_the_batch_equals_greedy_alone(folders):
    """Assistant drafters in the batch engine, one per sequence at its own offset: every
    sequence emits plain greedy decoding's tokens alone, and drafts were accepted."""
    target = load_model(folders["target"])[0]
    spec = AssistantSpec(assistant=folders["copying"])
    prompts = [PROMPT, [(7 * i) % 97 for i in range(30)], PROMPT[:9]]
    references = [greedy_reference(target, p, 24) for p in prompts]
    for prompt, reference in zip(prompts, references, strict=True):
        assert_clear_argmax(target, prompt, reference)
    engine = BatchEngine(target, 4)
    handles = [
        Handle(
            Session(target, StubTokenizer(), make_drafter(spec, target)),
            p,
            GREEDY,
            24,
            num_draft_tokens=3,
        )
        for p in prompts
    ]
    tokens: list[list[int]] = [[] for _ in prompts]
    for i, response in batch_stream(engine, handles):
        tokens[i].append(response.token)
    assert tokens == references
    assert sum(h.last.stats.accepted for h in handles) > 0


def test_sampled_tokens_follow_the_targets_marginal(tmp_path):
    """At temperature 0.7 the second token of many generations (the first drafted one,
    accepted or resampled) follows the target's exact marginal for it; the decoder is reused,
    so each prompt rewinds the drafter's keys to the cached prefix."""
    config, weights = markov_target(4, vocab_size=16, vocab_size_per_layer_input=16)
    target = build_model(config, weights)
    folder = save_folder(tmp_path / "a", copying_config(config), copying_assistant(config, weights))
    decoder = Decoder(Sequence(target, make_drafter(AssistantSpec(assistant=folder), target)))
    sampling = SamplingParams(temperature=0.7)
    prompt = [t % 16 for t in PROMPT]
    mx.random.seed(0)
    seconds, accepted = [], 0
    for _ in range(400):
        decoder.sequence.prefill(prompt)
        tokens = []
        for step in decoder.steps(sampling, FixedPolicy(3), max_tokens=4):
            tokens.extend(step.tokens)
            accepted += step.accepted
            if len(tokens) >= 2:
                break
        seconds.append(tokens[1])
    assert accepted > 400  # of 1200 drafts: often right
    assert_follows_marginal(target, prompt, 0.7, 1, seconds)


# -- (3) the command line ---------------------------------------------------------------------


def test_generate_assistant_prints_the_plain_text(capsys, folders):
    args = ["--ignore-chat-template", "--prompt", "w5 w6 w7 w8 w9 w5 w6 w7", "-m", "16"]
    args += ["--model", str(folders["target"])]
    assert main(args) == 0
    plain = capsys.readouterr().out
    code = main([*args, "--assistant", str(folders["copying"]), "--num-draft-tokens", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out == plain
    code = main([*args, "--assistant", str(folders["target"])])
    out, err = capsys.readouterr()
    assert code != 0 and out == ""
    assert err.count("\n") == 1 and "is not a Gemma 4 assistant (model_type 'gemma4_text'" in err


# -- (4) one-line errors ----------------------------------------------------------------------


def one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"model_type": "gemma4_text"}, "is not a Gemma 4 assistant (model_type 'gemma4_text'"),
        ({"backbone_hidden_size": 32}, "reads states of width 32 (backbone_hidden_size), the "),
        ({"text_config": text_config(96)}, "predicts a vocabulary of 96, the target's is 97"),
        (
            {"text_config": text_config(97, global_head_dim=16)},
            "layer 1 reads 2 key/value heads of size 16; the target's full_attention keys "
            "have 2 of size 32",
        ),
        (
            {"text_config": text_config(97, hidden_size_per_layer_input=8)},
            "must have hidden_size_per_layer_input=0, got 8",
        ),
        ({"text_config": None}, "has no text_config"),
        (
            {"use_ordered_embeddings": True, "num_centroids": 10},
            "10 centroids must divide the vocabulary of 97",
        ),
        ({"quantization": {"bits": 4, "group_size": 64}}, "is quantized"),
    ],
)
def test_assistants_that_do_not_fit_are_one_line_errors(tmp_path, folders, change, needle):
    target = load_model(folders["target"])[0]
    config = {**json.loads((folders["random"] / "config.json").read_text()), **change}
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").symlink_to(folders["random"] / "model.safetensors")
    with pytest.raises(ValueError) as error:
        make_drafter(AssistantSpec(assistant=folder), target)
    assert needle in one_line(error)


def test_other_targets_and_arguments_are_one_line_errors(folders):
    with pytest.raises(ValueError) as error:
        generate(tiny_model("llama"), StubTokenizer(), PROMPT, assistant=folders["random"])
    assert one_line(error) == "a Gemma 4 assistant drafts for Gemma 4 targets, not llama"
    target = load_model(folders["target"])[0]
    with pytest.raises(ValueError) as error:
        make_drafter(spec_from_keywords(assistant=True), target)
    assert one_line(error) == "assistant must be a folder or a Gemma4Assistant, got True"
