"""Hybrid families (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): transformers parity, exact rollback of
the recurrent state under speculation, lossless greedy speculation, loading and conversion."""

from __future__ import annotations

import json
from collections import abc
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_speculate.convert import convert
from mlx_speculate.decode import Decoder
from mlx_speculate.drafters.base import Draft, Drafter
from mlx_speculate.drafters.draft_model import DraftModelSpec
from mlx_speculate.drafters.lookup import LookupDrafter, LookupSpec
from mlx_speculate.loading import build_model, load
from mlx_speculate.policy.adaptive import FixedPolicy
from mlx_speculate.sampling import SamplingParams
from mlx_speculate.sequence import Sequence
from mlx_speculate.state_cache import ROWS
from mlx_speculate.step import verify
from mlx_speculate.tree import Tree
from mlx_speculate.verify import AcceptanceRule

from .helpers import decode, greedy_reference, random_weights, tiny_config
from .test_convert import save_tokenizer

VOCAB = 97
HYBRID = {
    "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 96,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 12,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    "pad_token_id": None, "eos_token_id": None, "bos_token_id": None,
}  # fmt: skip
MOE = {
    "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}  # fmt: skip
# Layer 1 of the Qwen3-Next config is dense (mlp_only_layers), the rest mixtures of experts.
FAMILIES = {
    "qwen3_next": {**MOE, "mlp_only_layers": [1], "norm_topk_prob": False},
    "qwen3_5_text": {},
    "qwen3_5_moe_text": MOE,
}
GREEDY = SamplingParams()
RULE = AcceptanceRule(GREEDY)


def config(model_type: str, **overrides) -> dict:
    return {"model_type": model_type, **HYBRID, **FAMILIES[model_type], **overrides}


def hf_model(cfg: dict, seed: int = 0):
    """transformers' float64 model for `cfg` with random weights far from its init (norms and
    the decay parameters too)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    hf_config = AutoConfig.for_model(**cfg, attn_implementation="eager")
    # The grouped-matmul experts have no float64 kernel on the CPU; the eager loop has.
    model = AutoModelForCausalLM.from_config(hf_config, experts_implementation="eager")
    model = model.double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(("dt_bias", "A_log")):
                p.copy_(0.5 * torch.randn_like(p))
            elif p.ndim >= 2:
                p.copy_(torch.randn_like(p) * (0.3 if "proj" in name else 0.1))
    return model


def hf_weights(model) -> dict[str, mx.array]:
    return {k: mx.array(v.float().numpy()) for k, v in model.state_dict().items()}


def hf_logits(model, tokens: np.ndarray, cache=None) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(torch.from_numpy(tokens), past_key_values=cache, use_cache=cache is not None)
    return out.logits.numpy()


def assert_close(ours: mx.array, ref: np.ndarray, rel: float = 1e-4) -> None:
    """Max |ours - ref| below `rel` of max |ref| (the reference's DeltaNet runs in float32)."""
    err = float(np.abs(np.array(ours, dtype=np.float64) - ref).max())
    scale = float(np.abs(ref).max())
    assert err < rel * scale, f"max abs error {err:.3g} (relative {err / scale:.3g})"


def tokens(length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (1, length))


# -- (1) parity with transformers ------------------------------------------------------------


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_logits_match_transformers(model_type):
    """A whole-prompt forward, then prefill + one token per step (both caches), give
    transformers' logits from its own checkpoint layout (fused experts, (C, 1, K) conv
    weights, (1 + weight) norms)."""
    from transformers import DynamicCache

    cfg = config(model_type)
    ref = hf_model(cfg)
    model = build_model(cfg, hf_weights(ref))
    ids = tokens(12)
    assert_close(model(mx.array(ids)).logits, hf_logits(ref, ids))
    ref_cache, cache = DynamicCache(config=ref.config), model.make_cache()
    for start, end in [(0, 6)] + [(t, t + 1) for t in range(6, 12)]:
        expected = hf_logits(ref, ids[:, start:end], ref_cache)
        assert_close(model(mx.array(ids[:, start:end]), cache).logits, expected)


def test_per_expert_checkpoint_names_load():
    """Original Qwen3-Next checkpoints store one tensor per expert and projection; stacked
    they give the same model as transformers' fused layout."""
    cfg = config("qwen3_next")
    weights = hf_weights(hf_model(cfg))
    split = {}
    for k, v in weights.items():
        if k.endswith("experts.gate_up_proj"):
            gate, up = mx.split(v, 2, axis=1)
            for e in range(v.shape[0]):
                split[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate[e]
                split[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = up[e]
        elif k.endswith("experts.down_proj"):
            for e in range(v.shape[0]):
                split[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e]
        else:
            split[k] = v
    split["mtp.fc.weight"] = mx.zeros((4, 4))  # the MTP head is not loaded
    ids = mx.array(tokens(8))
    expected = build_model(cfg, weights)(ids).logits
    assert mx.allclose(build_model(cfg, split)(ids).logits, expected, atol=1e-6).item()


# -- (2) recurrent state under speculation ---------------------------------------------------


def tiny_hybrid(model_type: str = "qwen3_5_text", seed: int = 0, **overrides):
    cfg = {k: v for k, v in config(model_type, **overrides).items() if v is not None}
    return build_model(cfg, random_weights(cfg, seed))


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_rejected_rows_leave_no_recurrent_state(model_type):
    """A compiled verify of k drafts of which only some are accepted, truncated as the loop
    does: the next forward's logits equal a fresh forward over the accepted prefix. A cache
    that kept the state after the last verified row fails this by far."""
    model = tiny_hybrid(model_type)
    prompt = tokens(9, seed=1)[0].tolist()
    greedy = greedy_reference(model, prompt, 6)
    for accepted in (0, 2, 3):
        cache = model.make_cache()
        model(mx.array([prompt]), cache)
        draft = greedy[1 : 1 + accepted] + [(greedy[1 + accepted] + 1) % VOCAB]
        draft += [5] * (4 - len(draft))  # k = 4: the accepted ones, one wrong, then filler
        out = verify(model, cache, mx.array(greedy[:1]), Tree.chain(4), mx.array(draft), None, RULE)
        n = out.acceptance.num_accepted.item()
        assert n == accepted
        cache.truncate(len(prompt) + n + 1)
        following = greedy[n + 1]
        ours = model(mx.array([[following]]), cache).logits[0, -1]
        context = prompt + greedy[: n + 1] + [following]
        fresh = model(mx.array([context])).logits[0, -1]
        assert mx.allclose(ours, fresh, rtol=1e-4, atol=1e-4).item(), accepted


def test_truncate_restores_only_what_the_ring_holds():
    """A prompt's forward keeps its final state, a verify step every row's: truncation is
    restored within the last verify's rows or to 0; further back it is a one-line error (and
    the prompt-prefix reuse re-prefills instead)."""
    model = tiny_hybrid()
    cache = model.make_cache()
    model(mx.array(tokens(12)), cache)  # a prompt: its final state alone
    assert cache.restorable(12) == 12 and cache.restorable(5) == 0
    with pytest.raises(ValueError, match="cannot restore the recurrent state at 5 tokens"):
        cache.truncate(5)
    verify(model, cache, mx.array([1]), Tree.chain(3), mx.array([2, 3, 4]), None, RULE)
    assert cache.offset == 16  # rows 12..15, each with its state
    assert cache.restorable(14) == 14 and cache.restorable(11) == 0
    cache.truncate(14)
    with pytest.raises(ValueError, match="cannot restore the recurrent state at 11 tokens"):
        cache.truncate(11)
    cache.truncate(0)
    assert cache.offset == 0

    long = tokens(ROWS + 10)
    model(mx.array(long), cache)  # a forward past ROWS keeps its final state alone
    assert cache.restorable(ROWS) == 0 and cache.restorable(ROWS + 10) == ROWS + 10


def test_prompt_prefix_reuse_keeps_the_recurrent_state_right():
    """A second prompt that shares a prefix with the last context gets the first token a fresh
    decoder gives it, whether the shared prefix was restorable or re-prefilled."""
    model = tiny_hybrid()
    first = tokens(20, seed=2)[0].tolist()
    decoder = Decoder(Sequence(model))
    for prompt in (first + [3, 4], first[:15] + [9, 9, 9], first[:15] + [9, 9, 9, 1]):
        decoder.sequence.prefill(prompt)
        step = next(decoder.steps(GREEDY))
        fresh = Decoder(Sequence(model))
        fresh.sequence.prefill(prompt)
        assert step.tokens == next(fresh.steps(GREEDY)).tokens


class OracleDrafter(Drafter):
    """Proposes the reference continuation with one wrong token at a seeded position, so that
    nearly every step accepts part of its draft and rejects the rest."""

    taps: tuple[int, ...] = ()
    max_draft = 8
    follows_context = True

    def weights(self) -> tuple:
        return ()

    def __init__(self, prompt: abc.Sequence[int], reference: abc.Sequence[int], seed: int = 0):
        self.prompt, self.reference = list(prompt), list(reference)
        self.rng = np.random.default_rng(seed)

    def extend(self, features) -> None:
        pass

    def rewind(self, length: int) -> None:
        pass

    def propose(self, context, k, sampling) -> Draft | None:
        done = len(context) - len(self.prompt)
        draft = self.reference[done : done + k]
        if len(draft) < k:
            return None
        wrong = int(self.rng.integers(0, k + 1))  # k: all right
        if wrong < k:
            draft[wrong] = (draft[wrong] + 1) % VOCAB
        return Draft(mx.array(draft, dtype=mx.int32), Tree.chain(k))


# Recurrent layers only: what a pipeline rank holds when its block has no attention layer.
RECURRENT_ONLY = {"num_hidden_layers": 2, "layer_types": ["linear_attention"] * 2}


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [*((t, {}) for t in FAMILIES), ("qwen3_5_text", RECURRENT_ONLY)],
)
def test_speculation_with_partial_accepts_equals_greedy(model_type, overrides):
    """Greedy speculation equals plain greedy decoding token for token: an oracle drafter
    whose drafts are partly rejected, prompt lookup (a chain by default for these targets) and
    a tiny Llama draft model that mostly disagrees (its chains queued on lazy counts); also
    with no attention layer at all (a cache without keys)."""
    model = tiny_hybrid(model_type, **overrides)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    reference = greedy_reference(model, prompt, 40)

    out, steps, _ = decode(model, prompt, 36, OracleDrafter(prompt, reference), FixedPolicy(4))
    assert out == reference[:36]
    assert sum(0 < s.accepted < 4 for s in steps) >= 4  # partial accepts happened

    lookup = LookupSpec(max_ngram=2).build(model)
    assert lookup.branches == 1
    assert decode(model, prompt, 40, lookup, FixedPolicy(4))[0] == reference

    draft_cfg = tiny_config("llama", vocab_size=VOCAB)
    draft = build_model(draft_cfg, random_weights(draft_cfg, seed=3))
    drafter = DraftModelSpec(model=draft).build(model)
    assert decode(model, prompt, 40, drafter, FixedPolicy(3))[0] == reference


def test_trees_and_hybrid_drafts_are_refused_in_one_line():
    """Refused before any graph is traced: sampling still works afterwards (an error inside a
    trace once left the random state without a value)."""
    model = tiny_hybrid("qwen3_next")
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    with pytest.raises(ValueError, match="verify chains only.*--lookup-branches 1"):
        decode(model, prompt, 20, LookupDrafter(max_ngram=2, branches=3), FixedPolicy(4))
    assert len(decode(model, prompt, 5, sampling=SamplingParams(temperature=1.0))[0]) == 5
    assert mx.random.uniform().item() < 1
    with pytest.raises(ValueError, match="qwen3_5_text draft model is not supported"):
        DraftModelSpec(model=tiny_hybrid()).build(model)


# -- (3) folders: transformers, multimodal wrappers, 4-bit conversion read by mlx-lm ----------


def save_hf(out: Path, model_type: str) -> Path:
    ref = hf_model(config(model_type))
    ref.float().save_pretrained(out)
    save_tokenizer(out, VOCAB)
    return out


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_transformers_folder_loads(tmp_path, model_type):
    src = save_hf(tmp_path / "hf", model_type)
    ids = tokens(10)
    import transformers

    auto = transformers.AutoModelForCausalLM
    ref = auto.from_pretrained(src, experts_implementation="eager").double().eval()
    assert_close(load(src)[0](mx.array(ids)).logits, hf_logits(ref, ids))


@pytest.mark.parametrize("wrapper", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_multimodal_wrapper_folders_load_their_language_model(wrapper, prefix):
    """`text_config` plus the language model under transformers' or mlx-community's prefix
    (the vision tower and MTP head beside it are not loaded)."""
    text = config(f"{wrapper}_text")
    weights = hf_weights(hf_model(text))
    wrapped = {}
    for k, v in weights.items():
        if k.startswith("model."):
            wrapped[prefix + k[len("model.") :]] = v
        else:  # lm_head
            wrapped[k if prefix.startswith("model.") else f"language_model.{k}"] = v
    wrapped["model.visual.blocks.0.norm1.weight"] = mx.ones((8,))
    wrapped["mtp.layers.0.input_layernorm.weight"] = mx.ones((64,))
    outer = {"model_type": wrapper, "text_config": text, "vision_config": {"hidden_size": 8}}
    ids = mx.array(tokens(8))
    expected = build_model(text, weights)(ids).logits
    assert mx.allclose(build_model(outer, wrapped)(ids).logits, expected, atol=1e-6).item()


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe_text"])
def test_4bit_conversion_is_read_alike_by_mlx_lm(tmp_path, model_type):
    """A transformers folder converted to 4 bits (experts through gathered quantized matmuls)
    loads here and in mlx-lm with the same logits."""
    from mlx_lm.utils import load_model

    src = save_hf(tmp_path / "hf", model_type)
    if model_type == "qwen3_5_moe_text":  # mlx-lm knows the wrapper's type, not the text one
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3_5_moe"}))
    dst = convert(src, tmp_path / "q4", quantize=True, q_group_size=32)
    ids = mx.array(tokens(12))
    ours = load(dst)[0](ids).logits
    theirs = load_model(dst)[0](ids)
    assert mx.allclose(theirs, ours, rtol=1e-4, atol=1e-4).item()
    quantized = dict(tree_flatten(load(dst)[0].parameters()))
    assert any("switch_mlp.gate_proj.scales" in k for k in quantized)


def test_conversion_writes_the_fields_mlx_lm_requires(tmp_path):
    """A Qwen3-Next config that leaves fields to transformers' defaults (the sparse step, the
    dense layers, the rotary fraction) converts into a folder mlx-lm loads, with the logits of
    the model converted; layer types that follow no interval are refused in one line."""
    from mlx_lm.utils import load_model

    def source(folder: Path, cfg: dict):
        folder.mkdir()
        model = build_model(cfg, random_weights(cfg, seed=2))
        weights = dict(tree_flatten(model.parameters()))
        mx.save_safetensors(str(folder / "model.safetensors"), weights)
        (folder / "config.json").write_text(json.dumps(cfg))
        save_tokenizer(folder, VOCAB)
        return model

    cfg = tiny_config("qwen3_next")
    del cfg["partial_rotary_factor"]  # 0.25, the family's default
    model = source(tmp_path / "src", cfg)
    dst = convert(tmp_path / "src", tmp_path / "mlx")
    written = json.loads((dst / "config.json").read_text())
    assert written["mlp_only_layers"] == [1] and written["full_attention_interval"] == 4
    ids = mx.array(tokens(12))
    expected = model(ids).logits
    assert mx.allclose(load(dst)[0](ids).logits, expected, rtol=1e-5, atol=1e-5).item()
    assert mx.allclose(load_model(dst)[0](ids), expected, rtol=1e-4, atol=1e-4).item()
    types = ["linear_attention", "full_attention", "full_attention", "linear_attention"]
    source(tmp_path / "no-interval", {**cfg, "layer_types": types})
    with pytest.raises(ValueError, match="layer_types follow no interval"):
        convert(tmp_path / "no-interval", tmp_path / "refused")
