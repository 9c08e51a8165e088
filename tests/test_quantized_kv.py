"""Long contexts: quantized keys and values (`kv_bits`, `kv_group_size`, `quantized_kv_start`)
and a bounded context (`max_kv_size`).

Speculation is exact for the quantized cache: greedy speculative decoding equals greedy plain
decoding under the same settings, with each method on a plain family (Llama), a sliding one
(Gemma 3) and a hybrid (Qwen3.5: its attention layers quantized, its recurrent ones float),
before, across and after the switch at `quantized_kv_start`.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_speculate.batch import batch_generate
from mlx_speculate.decode import Decoder
from mlx_speculate.drafters import DFlashSpec, EagleGrowth, EagleSpec, MtpSpec, make_drafter
from mlx_speculate.drafters.draft_model import DraftModelDrafter
from mlx_speculate.drafters.lookup import LookupDrafter
from mlx_speculate.drafters.medusa import MedusaDrafter
from mlx_speculate.generate import main as generate_main
from mlx_speculate.generation import Session, stream_generate
from mlx_speculate.heads.mtp import MtpHead
from mlx_speculate.loading import build_model
from mlx_speculate.models.attention import scaled_dot_product_attention
from mlx_speculate.models.quantized_kv import KVQuantization
from mlx_speculate.policy.adaptive import FixedPolicy
from mlx_speculate.sampling import SamplingParams
from mlx_speculate.sequence import Sequence
from mlx_speculate.server.__main__ import build_parser as server_parser
from mlx_speculate.server.__main__ import main as server_main
from mlx_speculate.server.sessions import SessionPool

from .families import PROMPT, REPEATING, related_draft
from .helpers import random_eagle_head, random_weights, tiny_config, tiny_model
from .markov import StubTokenizer
from .test_dflash import dflash_config
from .test_dflash import random_head as random_dflash_head
from .test_loading import write_folder
from .test_medusa import random_heads
from .test_mtp import PROMPT as MTP_PROMPT
from .test_mtp import copying_weights, markov_weights, mtp_config

# Head sizes of whole groups (32): Gemma 3's tiny config has it already.
FAMILIES = {
    "llama": {"head_dim": 32},
    "gemma3_text": {},
    "qwen3_5_text": {"head_dim": 32},
}
N = 28  # tokens generated: the prompt is 17, so the context passes 40


def generated(model, drafter, kv: KVQuantization | None, prompt=REPEATING, n: int = N):
    """The first n greedy tokens of the loop with `drafter` (k = 4) over a cache of `kv`, and
    the decoder (its `accepted` and `drafted` counts set on it, for the tests to read)."""
    decoder = Decoder(Sequence(model, drafter, kv=kv))
    decoder.sequence.prefill(prompt)
    tokens = []
    decoder.drafted = decoder.accepted = 0
    for step in decoder.steps(SamplingParams(), FixedPolicy(4 if drafter else 0)):
        tokens.extend(step.tokens)
        decoder.drafted += step.drafted
        decoder.accepted += step.accepted
        if len(tokens) >= n:
            break
    return tokens[:n], decoder


def drafters(model_type: str, target) -> dict:
    """Every method the suite runs on tiny families; chains only on the hybrid."""
    config = {k: v for k, v in vars(target.args).items() if not k.startswith("_")}
    head = random_eagle_head(config, 1, 5)
    chain = EagleGrowth.chain(4)
    methods = {
        "draft model": lambda: DraftModelDrafter(
            related_draft(model_type, 0, 1, **FAMILIES[model_type]), target.args.vocab_size
        ),
        "lookup chain": lambda: LookupDrafter(max_ngram=3, branches=1),
        "eagle chain": lambda: make_drafter(EagleSpec(heads=head, tree=chain), target),
    }
    if not target.recurrent:
        methods["lookup tree"] = lambda: LookupDrafter(max_ngram=3, branches=3)
        heads = random_heads(target.args.hidden_size, target.args.vocab_size, seed=3)
        methods["medusa"] = lambda: MedusaDrafter(heads)
        methods["eagle tree"] = lambda: make_drafter(
            EagleSpec(heads=head, tree=EagleGrowth(16, 4, 4)), target
        )
    return methods


@pytest.mark.parametrize("model_type", list(FAMILIES))
@pytest.mark.parametrize(
    "kv",
    [KVQuantization(8, 32, 0), KVQuantization(4, 32, 0), KVQuantization(4, 32, 26)],
    ids=["8-bit", "4-bit", "4-bit-from-26"],
)
def test_greedy_speculation_equals_plain_decoding_over_a_quantized_cache(model_type, kv):
    target = tiny_model(model_type, **FAMILIES[model_type])
    reference, decoder = generated(target, None, kv)
    assert decoder.sequence.cache.codec == kv  # it did switch (from 26: within the generation)
    assert all(k is None or k.dtype == mx.uint32 for k in decoder.sequence.cache.keys)
    for name, drafter in drafters(model_type, target).items():
        tokens, decoder = generated(target, drafter(), kv)
        assert tokens == reference, name
        assert decoder.drafted > 0, name
        if name == "draft model":  # a related model: both acceptances and rejections
            assert 0 < decoder.accepted < decoder.drafted, name


# Head sizes of whole groups for the other families: Gemma 4's sliding layers read shared
# keys from earlier ones (packed too), gpt-oss adds sink logits and a sliding layer.
OTHERS = {
    "gemma4_text": {"head_dim": 32, "global_head_dim": 64},
    "gpt_oss": {"head_dim": 32},
    "qwen3_moe": {},
    "phi3": {"head_dim": 32},
    "qwen2": {"head_dim": 32},
}


@pytest.mark.parametrize("model_type", list(OTHERS))
def test_every_family_is_exact_over_a_quantized_cache(model_type):
    """Prompt lookup's chains and trees at 4 bits from slot 22, on the remaining families."""
    target = tiny_model(model_type, **OTHERS[model_type])
    kv = KVQuantization(4, 32, 22)
    reference, decoder = generated(target, None, kv)
    assert decoder.sequence.cache.codec == kv
    for branches in (1, 3):
        tokens, decoder = generated(target, LookupDrafter(max_ngram=3, branches=branches), kv)
        assert tokens == reference, branches
        assert decoder.drafted > 0


@pytest.mark.parametrize("bits", [8, 4, 3])
def test_quantized_attention_is_attention_over_the_dequantized_cache(bits):
    """The codec's attention (grouped query heads, an additive mask, gpt-oss sinks) equals
    float attention over the keys and values its packed rows decode to."""
    codec = KVQuantization(bits, 32, 0)
    keys = mx.random.normal((1, 2, 40, 64), key=mx.random.key(1))
    values = mx.random.normal((1, 2, 40, 64), key=mx.random.key(2))
    q = mx.random.normal((1, 4, 3, 64), key=mx.random.key(3))
    mask = mx.where(mx.random.uniform(shape=(3, 40), key=mx.random.key(4)) < 0.3, -1e9, 0.0)
    sinks = mx.array([0.5, -1.0, 2.0, 0.0])
    k, v = codec.encode(keys), codec.encode(values)
    assert k.dtype == mx.uint32 and k.shape == (1, 2, 40, 64 * bits // 32 + 2 * 64 // 32)

    def dequantized(words):
        return mx.dequantize(*codec.decode(words, mx.float32), group_size=32, bits=bits)

    assert mx.abs(dequantized(k) - keys).max().item() < 2.0 ** (2 - bits) * 4
    for sink in (None, sinks):
        out = codec.attention(q, k, v, 0.125, mask, sink)
        expected = scaled_dot_product_attention(
            q, dequantized(k), dequantized(v), 0.125, mask, sink
        )
        assert mx.allclose(out, expected, atol=1e-4).item()


KV = [KVQuantization(8, 32, 0), KVQuantization(4, 32, 24)]


@pytest.mark.parametrize("kv", KV, ids=["8-bit", "4-bit-from-24"])
def test_deep_target_drafters_are_exact_over_a_quantized_cache(kv):
    """DFlash's block drafts (chain and DDTree) and EAGLE-3 (tapping three layers) on a
    6-layer Llama."""
    deep = {**FAMILIES["llama"], "num_hidden_layers": 6}
    target = tiny_model("llama", **deep)
    head = random_dflash_head(dflash_config(tiny_config("llama", **deep)), 1)
    config = {k: v for k, v in vars(target.args).items() if not k.startswith("_")}
    eagle3 = random_eagle_head(config, 3, 5, draft_vocab=None, taps=(0, 3, 5))
    reference, _ = generated(target, None, kv, PROMPT)
    methods = {
        f"dflash top-{top_k}": make_drafter(DFlashSpec(drafter=head, top_k=top_k), target)
        for top_k in (1, 3)
    }
    methods["eagle-3"] = make_drafter(EagleSpec(heads=eagle3, tree=EagleGrowth(16, 4, 4)), target)
    for name, drafter in methods.items():
        tokens, decoder = generated(target, drafter, kv, PROMPT)
        assert tokens == reference, name
        assert decoder.drafted > 0, name


@pytest.mark.parametrize("kv", KV, ids=["8-bit", "4-bit-from-24"])
def test_native_mtp_is_exact_over_a_quantized_cache(kv):
    """Qwen3.5's own MTP head: its attention layer's keys quantized, the recurrent ones not."""
    cfg = mtp_config("qwen3_5_text", head_dim=32)
    target = build_model(cfg, markov_weights(cfg))
    head = MtpHead(target.args)
    head.load_weights(list(copying_weights(target.args).items()))
    reference, _ = generated(target, None, kv, MTP_PROMPT)
    drafter = make_drafter(MtpSpec(head=head), target)
    tokens, decoder = generated(target, drafter, kv, MTP_PROMPT)
    assert tokens == reference
    assert 0 < decoder.accepted < decoder.drafted
    assert decoder.sequence.cache.codec == kv


def test_quantized_cache_changes_the_model_and_the_switch_happens_at_its_start():
    """Before `quantized_kv_start` the tokens are the float cache's; 4-bit keys change later
    ones (the setting is not a no-op), and the storage is packed from the start on."""
    target = tiny_model("llama", **FAMILIES["llama"])
    float_tokens, _ = generated(target, None, None)
    start = len(REPEATING) + 6
    tokens, decoder = generated(target, None, KVQuantization(4, 32, start))
    # The token chosen by the forward at slot t is float while t < start.
    same = start - len(REPEATING) + 1
    assert tokens[:same] == float_tokens[:same]
    assert tokens != float_tokens
    assert (
        decoder.sequence.cache.codec is not None
        and decoder.sequence.cache.keys[0].dtype == mx.uint32
    )
    # Packed rows: 32 values at 4 bits in 4 words, a float32 scale and bias in 2 more.
    assert decoder.sequence.cache.keys[0].shape[-1] == 32 * 4 // 32 + 2


def test_a_step_stops_short_of_the_switch():
    """No verify forward runs rows on both sides of `quantized_kv_start`: a step rooted below
    it drafts at most up to the slot before it."""
    target = tiny_model("llama", **FAMILIES["llama"])
    start = len(REPEATING) + 5
    decoder = Decoder(
        Sequence(target, LookupDrafter(max_ngram=3, branches=1), kv=KVQuantization(8, 32, start))
    )
    decoder.sequence.prefill(REPEATING)
    for step in decoder.steps(SamplingParams(), FixedPolicy(6), max_tokens=N):
        root = len(decoder.sequence.context) - len(step.tokens) - 1  # the step's first slot
        if step.verified and root < start:
            assert root + step.drafted < start, (root, step.drafted)
    assert decoder.sequence.cache.codec is not None


def test_prompt_reuse_below_the_start_refills_a_float_cache():
    """A session's next prompt may reuse the cached prefix only where it stays exact: at or
    past the start (packed rows); below it, only a fresh cache is (the float rows are gone)."""
    target = tiny_model("llama", **FAMILIES["llama"])
    kv = KVQuantization(8, 32, len(REPEATING) + 4)
    session = Session(target, StubTokenizer(), kv=kv)
    list(session.stream(REPEATING, sampling=SamplingParams(), max_tokens=12))
    cache = session.sequence.cache
    assert cache.codec is not None
    assert cache.restorable(10) == 0 and cache.restorable(cache.offset) == cache.offset
    with pytest.raises(ValueError, match="below its quantized_kv_start of 21 \\(only to 0\\)"):
        cache.truncate(10)
    second = REPEATING[:10] + [3, 4, 5]
    stream = session.stream(second, sampling=SamplingParams(), max_tokens=12)
    first = next(stream)
    assert session.sequence.cache.codec is None  # refilled float: 13 tokens, below the start
    again = [first.token] + [r.token for r in stream]
    assert session.sequence.cache.codec is not None  # switched again at 21
    fresh = Session(target, StubTokenizer(), kv=kv)
    expected = fresh.stream(second, sampling=SamplingParams(), max_tokens=12)
    assert again == [r.token for r in expected]


def test_kv_bits_8_stores_a_long_context_in_under_a_third_of_float32():
    """At a 4K context of a realistic head size (128), the packed keys and values take at most
    0.3 of their float32 size (8 bits a value plus a scale and bias per 64)."""
    config = tiny_config(
        head_dim=128, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=8192,
    )  # fmt: skip
    model = build_model(config, random_weights(config, 0))
    prompt = [(7 * i) % 97 for i in range(4096)]
    sizes = {}
    for kv in (None, KVQuantization(8, 64, 0)):
        decoder = Decoder(Sequence(model, None, kv=kv))
        decoder.sequence.prefill(prompt)
        cache = decoder.sequence.cache
        assert cache.capacity == 4096
        sizes[kv] = sum(a.nbytes for a in cache.keys + cache.values)
    float32 = 2 * 2 * 1 * 4096 * 128 * 4  # keys and values, 2 layers, 1 head, float32
    assert sizes[None] == float32
    assert sizes[KVQuantization(8, 64, 0)] <= 0.3 * float32


@pytest.mark.parametrize(
    "options, message",
    [
        ({"kv_bits": 7}, "kv_bits must be one of 2, 3, 4, 5, 6, 8"),
        ({"kv_bits": 8, "kv_group_size": 48}, "kv_group_size must be one of 32, 64, 128"),
        ({"kv_bits": 8, "kv_group_size": 32}, "does not divide the head size 16"),
        ({"kv_bits": 4, "quantized_kv_start": -1}, "quantized_kv_start must be an integer >= 0"),
        ({"max_kv_size": 0}, "max_kv_size must be a positive integer"),
    ],
)
def test_bad_cache_settings_are_one_line_errors(options, message):
    target = tiny_model("llama")  # head size 16
    with pytest.raises(ValueError, match=message) as error:
        list(stream_generate(target, StubTokenizer(), [1, 2, 3], max_tokens=2, **options))
    assert "\n" not in str(error.value)


def test_max_kv_size_refuses_a_longer_prompt_and_stops_exactly_at_it():
    target = tiny_model("llama")
    with pytest.raises(ValueError, match="17 tokens, more than the cache's context of 16"):
        list(stream_generate(target, StubTokenizer(), REPEATING, max_kv_size=16))
    plain = list(stream_generate(target, StubTokenizer(), REPEATING, max_tokens=50))
    for options in ({}, {"prompt_lookup": True, "num_draft_tokens": 4}):
        session_out = list(
            stream_generate(target, StubTokenizer(), REPEATING, max_kv_size=24, **options)
        )
        # The context (prompt + generated, the last token pending) holds 24 cached slots.
        assert len(session_out) == 24 + 1 - len(REPEATING)
        assert [r.token for r in session_out] == [r.token for r in plain][: len(session_out)]
        assert session_out[-1].finish_reason == "context"
    session = Session(target, StubTokenizer(), LookupDrafter(max_ngram=3), max_kv_size=24)
    list(session.stream(REPEATING, sampling=SamplingParams(), max_tokens=50))
    assert session.sequence.cache.offset <= 24


def test_batch_generate_stops_each_sequence_at_max_kv_size():
    target = tiny_model("llama")
    prompts = [REPEATING, REPEATING[:9]]
    result = batch_generate(
        target, StubTokenizer(), prompts, max_tokens=50, max_kv_size=24, prompt_lookup=True
    )
    for prompt, tokens, reason in zip(prompts, result.tokens, result.finish_reasons, strict=True):
        alone = stream_generate(target, StubTokenizer(), prompt, max_tokens=50, max_kv_size=24)
        assert tokens == [r.token for r in alone]
        assert len(tokens) == 24 + 1 - len(prompt) and reason == "context"


def test_server_takes_the_cache_flags():
    parser = server_parser()
    args = parser.parse_args(
        ["--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0",
         "--max-kv-size", "20", "--max-batch", "1"]
    )  # fmt: skip
    assert (args.kv_bits, args.kv_group_size, args.quantized_kv_start) == (4, 32, 0)
    target = tiny_model("llama", **FAMILIES["llama"])
    kv = KVQuantization(args.kv_bits, args.kv_group_size, args.quantized_kv_start)
    pool = SessionPool(target, StubTokenizer(), None, 1, None, kv, args.max_kv_size)
    assert pool.max_context == 20
    sequence = pool.acquire("none", [1, 2, 3]).session.sequence
    assert sequence.cache.planned == kv and sequence.max_context == 20
    with pytest.raises(ValueError, match="does not divide the head size 16"):
        SessionPool(tiny_model("llama"), StubTokenizer(), None, 1, None, kv)


def test_server_refuses_kv_bits_with_the_batch_engine(capsys):
    with pytest.raises(SystemExit) as exit_:
        server_main(["--kv-bits", "8"])
    assert exit_.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("error: --kv-bits needs --max-batch 1: the batch engine keeps a float cache")
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny llama with head size 32 and a WordLevel tokenizer without an EOS token."""
    config = tiny_config(head_dim=32)
    path = write_folder(tmp_path_factory.mktemp("kv") / "tiny", config, random_weights(config))
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    del tokenizer_config["eos_token"]
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


def test_generate_cli_takes_the_cache_flags_end_to_end(folder, capsys):
    """The generate CLI's flags reach the cache (in process: main() is the whole CLI)."""
    from mlx_speculate.loading import load

    model, tokenizer = load(str(folder))
    prompt = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10"
    flags = ["--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "4"]
    common = ["--model", str(folder), "--prompt", prompt, "--ignore-chat-template"]
    assert generate_main([*common, "-m", "12", *flags, "--prompt-lookup"]) == 0
    kv = {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 4}
    expected = "".join(
        r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=12, **kv)
    )
    assert capsys.readouterr().out.strip() == expected.strip()
    floats = "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=12))
    assert expected != floats

    assert generate_main([*common, "-m", "50", "--max-kv-size", "16"]) == 0
    out = capsys.readouterr()
    assert len(out.out.split()) == 16 + 1 - 10
    assert out.err.strip().splitlines()[-1] == (
        "note: stopped after 7 tokens: the context of 16 tokens (--max-kv-size) is full"
    )
    assert generate_main([*common, "--max-kv-size", "4"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: the prompt has 10 tokens, more than the cache's context of 4"
    )
    with pytest.raises(SystemExit):
        generate_main([*common, "--kv-bits", "7"])
    assert "--kv-bits: invalid choice: 7" in capsys.readouterr().err
