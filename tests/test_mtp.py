"""Native MTP (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): the head against a transformers reference
(its decoder layer, vLLM's composition around it), lossless greedy and sampled speculation,
conversion that keeps (and quantizes) `mtp.*`, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_speculate.convert import convert
from mlx_speculate.decode import Decoder
from mlx_speculate.drafters import MtpSpec, make_drafter
from mlx_speculate.drafters import mtp as mtp_module
from mlx_speculate.drafters.base import FusedDrafter, TargetFeatures
from mlx_speculate.generate import main
from mlx_speculate.generation import generate
from mlx_speculate.graphs import compiled
from mlx_speculate.heads.mtp import MtpHead
from mlx_speculate.loading import build_model, load
from mlx_speculate.policy.adaptive import FixedPolicy
from mlx_speculate.sampling import SamplingParams
from mlx_speculate.sequence import Sequence

from .helpers import decode, greedy_reference, random_weights, tiny_model
from .markov import StubTokenizer, assert_follows_marginal
from .test_convert import save_tokenizer
from .test_dflash import CyclingPolicy
from .test_hybrid import FAMILIES, VOCAB, assert_close, config, hf_model

GREEDY = SamplingParams()
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
# The checkpoint key that counts the head's layers, per family.
COUNT = {"qwen3_next": "num_nextn_predict_layers"}


def mtp_config(model_type: str, **overrides) -> dict:
    cfg = {COUNT.get(model_type, "mtp_num_hidden_layers"): 1, **config(model_type, **overrides)}
    return {k: v for k, v in cfg.items() if v is not None}


# -- a target whose next token follows mostly from the last one, and a head that copies it ----


def markov_weights(cfg: dict, seed: int = 0) -> dict[str, mx.array]:
    """Random weights whose mixers and MLPs write little into the residual stream, so the next
    token depends mostly on the last one (and partly on the rest: drafts are partly right)."""
    mixers = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
    weights = random_weights(cfg, seed)
    return {k: v * 0.3 if k.endswith(mixers) else v for k, v in weights.items()}


def copying_weights(args, seed: int = 7) -> dict[str, mx.array]:
    """An MTP head (in its own names) whose fc passes the embedding of token t+1 alone, over a
    layer that writes little: it predicts what the target predicts after that token."""
    params = tree_flatten(MtpHead(args).parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    weights = {}
    for key, (name, value) in zip(keys, params, strict=True):
        if "norm" in name:
            weights[name] = mx.ones(value.shape)
        else:
            weights[name] = 0.05 * mx.random.normal(value.shape, key=key)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weights[name] = 0.1 * weights[name]
    h = args.hidden_size
    weights["fc.weight"] = mx.concatenate([mx.eye(h), mx.zeros((h, h))], axis=1)
    return weights


def save_mlx(folder: Path, model_type: str, head: bool = True, **overrides) -> Path:
    """An MLX model folder of a Markov-like target, with a copying MTP head unless not `head`."""
    cfg = mtp_config(model_type, **overrides)
    weights = markov_weights(cfg)
    if head:
        args = build_model(cfg, weights).args
        weights |= {f"mtp.{k}": v for k, v in copying_weights(args).items()}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    save_tokenizer(folder, VOCAB)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp")
    return {t: save_mlx(root / t, t) for t in FAMILIES}


# -- (1) the head against transformers --------------------------------------------------------


def save_hf_with_mtp(folder: Path, model_type: str) -> dict:
    """A transformers folder of a random target with an `mtp.*` head in the checkpoint's layout:
    the head's layer and final norm from a one-layer full-attention transformers model of the
    family ((1 + weight) norms, fused experts), fc and the pre-fc norms random. Returns the
    torch reference pieces (float64)."""
    import torch

    cfg = mtp_config(model_type)
    target = hf_model(cfg)
    target.float().save_pretrained(folder)
    save_tokenizer(folder, VOCAB)
    saved = json.loads((folder / "config.json").read_text())
    count = COUNT.get(model_type, "mtp_num_hidden_layers")
    (folder / "config.json").write_text(json.dumps({**saved, count: 1}))
    layer = hf_model({**cfg, "num_hidden_layers": 1, "layer_types": ["full_attention"]}, seed=1)
    torch.manual_seed(2)
    h = cfg["hidden_size"]
    extra = {
        "fc.weight": 0.1 * torch.randn(h, 2 * h, dtype=torch.float64),
        "pre_fc_norm_embedding.weight": 0.1 * torch.randn(h, dtype=torch.float64),
        "pre_fc_norm_hidden.weight": 0.1 * torch.randn(h, dtype=torch.float64),
    }
    head = {f"mtp.{k}": v for k, v in extra.items()}
    for name, value in layer.state_dict().items():
        if name.startswith("model.layers.") or name == "model.norm.weight":
            head["mtp." + name.removeprefix("model.")] = value
    weights = mx.load(str(folder / "model.safetensors"))
    weights |= {k: mx.array(v.float().numpy()) for k, v in head.items()}
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    return {"target": target, "layer": layer, **extra, "eps": cfg["rms_norm_eps"]}


def reference_outputs(ref: dict, embeds, hidden):
    """vLLM's MTP step in torch over (L, h) embeddings of tokens t+1 and states of positions t:
    (1 + weight) norms, fc over their concatenation, then the one-layer model's layer and final
    norm (`mtp.norm`): (L, h) outputs, causal over the rows."""
    import torch

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ref["eps"]) * (1 + weight)

    embeds = norm(embeds, ref["pre_fc_norm_embedding.weight"])
    hidden = norm(hidden, ref["pre_fc_norm_hidden.weight"])
    x = torch.cat([embeds, hidden], dim=-1) @ ref["fc.weight"].T
    with torch.no_grad():
        return ref["layer"].model(inputs_embeds=x[None]).last_hidden_state[0]


def reference_chain(ref: dict, states, tokens: list[int], drafted: list[int]) -> np.ndarray:
    """(k, V) log-probabilities of a chain: the head over the target's (n, h) `states` and the
    embeddings of `tokens` (context[1:]), each step then adding a row that reads the token
    drafted before and the head's last output."""
    import torch

    target = ref["target"]
    embed, lm_head = target.model.embed_tokens.weight.double(), target.lm_head.weight.double()
    states, tokens, rows = list(states), list(tokens), []
    with torch.no_grad():
        for token in drafted:
            out = reference_outputs(ref, embed[torch.tensor(tokens)], torch.stack(states))
            rows.append(torch.log_softmax(out[-1] @ lm_head.T, dim=-1).numpy())
            tokens.append(token)
            states.append(out[-1])
    return np.stack(rows)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_drafts_match_the_transformers_reference(tmp_path, model_type):
    """Read from a transformers folder, the drafter's sampled chains come with the reference's
    distributions at every step: after the prompt (its rows padded to a bucket) and again after
    two more committed positions, catching up over the slots its last chain wrote."""
    import torch

    ref = save_hf_with_mtp(tmp_path / "hf", model_type)
    target, _ = load(tmp_path / "hf")
    drafter = make_drafter(MtpSpec(), target)
    cache = target.make_cache()
    context = PROMPT[:11]  # 11 rows: a bucket of 12
    states = target(mx.array([context]), cache).hidden[0]
    drafter.extend(TargetFeatures(states))
    sampling = SamplingParams(temperature=1.0)
    for step in range(2):
        if step == 1:  # the pending token and one more committed; the next one pending
            out = target(mx.array([context[-1:] + [40]]), cache).hidden[0]
            drafter.extend(TargetFeatures(out))
            states = mx.concatenate([states, out])
            context = context + [40]
        context = context + [3 + step]
        draft = drafter.propose(context, 3, sampling)
        rows = torch.from_numpy(np.array(states, dtype=np.float64))
        expected = reference_chain(ref, rows, context[1:], draft.tokens.tolist())
        assert_close(draft.logprobs, expected, rel=1e-4)


# -- (2) lossless speculation -----------------------------------------------------------------


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_greedy_speculation_equals_plain_decoding(folders, model_type):
    """Token for token, with drafts accepted whole, in part and not at all (the head copies a
    target that mostly follows its last token); a long prompt's rows run through the head
    before the compiled catch-up, and `mtp=True` through `generate` gives the same text."""
    target, _ = load(folders[model_type])
    for prompt in (PROMPT, [(7 * i) % VOCAB for i in range(70)]):
        reference = greedy_reference(target, prompt, 40)
        drafter = make_drafter(MtpSpec(), target)
        tokens, steps, _ = decode(target, prompt, 40, drafter, FixedPolicy(3))
        assert tokens == reference
        accepted = [s.accepted for s in steps if s.drafted]
        assert 0 < sum(accepted) < sum(s.drafted for s in steps)
        assert max(accepted) >= 2 and min(accepted) == 0, accepted
    text = generate(target, StubTokenizer(), PROMPT, max_tokens=20, mtp=True, num_draft_tokens=2)
    assert text.split() == [str(t) for t in greedy_reference(target, PROMPT, 20)]


def test_sampled_tokens_follow_the_targets_marginal(folders):
    """At temperature 0.5 the second token of many generations (the first drafted one, accepted
    or resampled) follows the target's exact marginal for it; the decoder is reused, so each
    prompt rewinds the head past its last chain."""
    target, _ = load(folders["qwen3_5_text"])
    decoder = Decoder(Sequence(target, make_drafter(MtpSpec(), target)))
    sampling = SamplingParams(temperature=0.5)
    mx.random.seed(0)
    seconds, accepted = [], 0
    for _ in range(300):
        decoder.sequence.prefill(PROMPT)
        tokens = []
        for step in decoder.steps(sampling, FixedPolicy(3), max_tokens=4):
            tokens.extend(step.tokens)
            accepted += step.accepted
            if len(tokens) >= 2:
                break
        seconds.append(tokens[1])
    assert accepted > 75  # the drafts were often right
    assert_follows_marginal(target, PROMPT, 0.5, 1, seconds)


@pytest.mark.parametrize("ks", [(3,), (3, 2)], ids=["fixed", "cycling"])
def test_steps_after_the_first_are_fused(monkeypatch, folders, ks):
    """On a compiled hybrid target each verify step's graph drafts the next chain: the drafter
    runs a graph of its own for the first step, and again only when the chain grows (a
    shorter one is cut from the fused chain), and the output stays plain greedy's."""
    target, _ = load(folders["qwen3_5_text"])
    drafter = make_drafter(MtpSpec(), target)
    assert isinstance(drafter, FusedDrafter) and target.traceable
    own_graphs = []
    counted = lambda *args, **kw: own_graphs.append(args[1]) or compiled(*args, **kw)  # noqa: E731
    monkeypatch.setattr(mtp_module, "compiled", counted)
    policy = CyclingPolicy(ks, every=4)
    tokens, steps, _ = decode(target, PROMPT, 60, drafter, policy)
    assert tokens == greedy_reference(target, PROMPT, 60)
    assert len(steps) > 12 and 0 < sum(s.accepted for s in steps) < sum(s.drafted for s in steps)
    growths = -(-len(steps) // 8) if len(ks) > 1 else 0  # from 2 back to 3, every 8 steps
    assert 1 <= len(own_graphs) <= 1 + growths, own_graphs


def test_fused_sampled_drafts_follow_the_targets_marginal(folders):
    """The third token of many seeded generations with chains of one draft follows the target's
    exact marginal. The head's fc is noisy (its drafts often wrong), so the first step often
    rejects its draft and the third token is the second step's draft, which the first
    step's verify graph drew (fused, and queued on its lazy count), or its resample."""
    target, _ = load(folders["qwen3_5_text"])
    weights = copying_weights(target.args)
    noise = mx.random.normal(weights["fc.weight"].shape, key=mx.random.key(3))
    weights["fc.weight"] = weights["fc.weight"] + 0.3 * noise
    head = MtpHead(target.args).load_weights(list(weights.items()))
    drafter = mtp_module.MtpDrafter(head, target)
    followed = []
    follow = drafter.follow
    drafter.follow = lambda *args: followed.append(draft := follow(*args)) or draft
    decoder = Decoder(Sequence(target, drafter))
    sampling = SamplingParams(temperature=0.5)
    mx.random.seed(1)
    thirds, from_fused = [], 0
    for _ in range(400):
        decoder.sequence.prefill(PROMPT)
        emitted = []  # tokens per step: the first token's, then each verify step's
        for step in decoder.steps(sampling, FixedPolicy(1), max_tokens=8):
            emitted.append(step.tokens)
            if sum(map(len, emitted)) >= 3:
                break
        from_fused += len(emitted) == 3  # the first step rejected its draft
        thirds.append([t for tokens in emitted for t in tokens][2])
    queued = sum(d is not None for d in followed)
    assert from_fused > 80 and queued > 100, (from_fused, queued)
    assert_follows_marginal(target, PROMPT, 0.5, 2, thirds)


# -- (3) conversion ---------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe_text"])
def test_convert_keeps_and_quantizes_the_head(tmp_path, model_type):
    """From a transformers folder: a float conversion holds the same head (its (1 + weight)
    norms mapped once) in a file mlx-lm does not read; -q quantizes it with the model, and
    drafting with it stays lossless."""
    save_hf_with_mtp(tmp_path / "hf", model_type)
    source, _ = load(tmp_path / "hf")
    expected = dict(tree_flatten(make_drafter(MtpSpec(), source).head.parameters()))
    dst = convert(tmp_path / "hf", tmp_path / "mlx")
    target, _ = load(dst)
    head = dict(tree_flatten(make_drafter(MtpSpec(), target).head.parameters()))
    assert head.keys() == expected.keys()
    for name, value in expected.items():
        assert mx.allclose(head[name], value, atol=1e-6).item(), name
    if model_type == "qwen3_next":  # mlx-lm knows this type: the head is no tensor it refuses
        from mlx_lm.utils import load_model

        load_model(dst)

    dst = convert(tmp_path / "hf", tmp_path / "q4", quantize=True, q_group_size=32)
    assert not any(k.startswith("mtp.") for k in mx.load(str(dst / "model.safetensors")))
    stored = mx.load(str(dst / "mtp.safetensors"))
    for name in ("fc", "layers.0.self_attn.q_proj", "layers.0.mlp.switch_mlp.gate_proj"):
        assert f"mtp.{name}.scales" in stored, name
    target, _ = load(dst)
    drafter = make_drafter(MtpSpec(), target)
    fc = drafter.head.fc
    dense = mx.dequantize(fc.weight, fc.scales, fc.biases, fc.group_size, fc.bits)
    assert_close(dense, np.array(expected["fc.weight"]), rel=0.1)
    reference = greedy_reference(target, PROMPT, 20)
    assert decode(target, PROMPT, 20, drafter, FixedPolicy(3))[0] == reference


# -- (4) one-line errors ----------------------------------------------------------------------


def one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


def test_missing_head_and_other_families_are_refused_in_one_line(capsys, tmp_path, folders):
    plain = save_mlx(tmp_path / "plain", "qwen3_5_text", head=False)
    target, _ = load(plain)
    with pytest.raises(ValueError) as e:
        make_drafter(MtpSpec(), target)
    assert "holds no MTP weights (mtp.*" in one_line(e) and str(plain) in one_line(e)
    # The head of another folder of the same model (the original of a conversion).
    drafter = make_drafter(MtpSpec(head=folders["qwen3_5_text"]), target)
    assert decode(target, PROMPT, 12, drafter, FixedPolicy(2))[0] == greedy_reference(
        target, PROMPT, 12
    )

    with pytest.raises(ValueError) as e:
        generate(tiny_model("llama"), StubTokenizer(), PROMPT, max_tokens=4, mtp=True)
    assert one_line(e) == (
        "llama models carry no MTP head (native MTP drafts for qwen3_next, qwen3_5, qwen3_5_moe)"
    )
    cfg = mtp_config("qwen3_5_text")
    with pytest.raises(ValueError, match="not loaded from a folder"):
        make_drafter(MtpSpec(), build_model(cfg, random_weights(cfg)))
    deep = save_mlx(tmp_path / "deep", "qwen3_5_text", mtp_num_hidden_layers=2)
    with pytest.raises(ValueError) as e:
        make_drafter(MtpSpec(), load(deep)[0])
    assert "mtp_num_hidden_layers=2: MTP heads of one layer are supported" in one_line(e)
    # Converting such a folder keeps the model and says why the head is left out.
    dst = convert(deep, tmp_path / "deep-mlx")
    assert not (dst / "mtp.safetensors").exists()
    assert "the multi-token-prediction head is not kept" in capsys.readouterr().err


# -- (5) the command line ---------------------------------------------------------------------


def test_generate_mtp_prints_its_speculation_line(capsys, tmp_path, folders):
    args = ["--ignore-chat-template", "--prompt", "w5 w6 w7 w8 w9 w5 w6 w7", "-m", "16"]
    folder = folders["qwen3_5_moe_text"]
    code = main([*args, "--model", str(folder), "--mtp", "--num-draft-tokens", "2", "--verbose"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Speculation:" in err and "tokens per target forward" in err
    plain = save_mlx(tmp_path / "plain", "qwen3_5_moe_text", head=False)
    assert main([*args, "--model", str(plain), "--mtp", str(folder), "--verbose"]) == 0
    assert capsys.readouterr().out == out  # the head of another folder: the same text
    code = main([*args, "--model", str(plain), "--mtp"])
    out, err = capsys.readouterr()
    assert code != 0 and out == ""
    assert err.count("\n") == 1 and "holds no MTP weights" in err
