"""Prefill: quantized models dequantize for the prompt's wide matmuls on the CPU (decoding keeps
the quantized kernel), and a long prompt's prefill is cancellable between chunks, by a callback
(the server, when its client leaves) or by Ctrl-C (the CLI)."""

from __future__ import annotations

import importlib
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlx_speculate.generation import stream_generate
from mlx_speculate.loading import build_model, load
from mlx_speculate.models import quantized_prefill
from mlx_speculate.models.quantized_prefill import PrefillQuantizedLinear, prefilling
from mlx_speculate.sequence import CANCELLABLE_STEPS, PREFILL_STEP, PrefillCancelled, Sequence

from .helpers import random_weights, tiny_config
from .serving import serve
from .test_loading import write_folder

# The CLI module (the package binds `generate` to the function of that name).
generate = importlib.import_module("mlx_speculate.generate")
LONG_PROMPT = [(7 * i) % 90 + 3 for i in range(2000)]  # ids of the tiny 97-word vocabulary


def quantized_folder(tmp_path: Path, context: int = 4096) -> Path:
    config = tiny_config(max_position_embeddings=context)
    model = build_model(config, random_weights(config))
    nn.quantize(model, 32, 4)
    weights = dict(tree_flatten(model.parameters()))
    return write_folder(
        tmp_path / "q", config | {"quantization": {"group_size": 32, "bits": 4}}, weights
    )


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    return load(quantized_folder(tmp_path_factory.mktemp("prefill")))


# -- dequantized wide matmuls --------------------------------------------------------------------


def test_load_installs_the_prefill_layers_on_the_cpu_only(tmp_path, monkeypatch):
    folder = quantized_folder(tmp_path)
    model, _ = load(folder)
    kinds = {type(m) for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert kinds == {PrefillQuantizedLinear}
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    model, _ = load(folder)
    kinds = {type(m) for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert kinds == {nn.QuantizedLinear}


def test_only_wide_inputs_inside_prefill_dequantize(quantized):
    model, _ = quantized
    layer = model.model.layers[0].mlp.up_proj
    quantized_call = nn.QuantizedLinear.__call__
    columns = layer.weight.shape[-1] * 32 // layer.bits
    wide = mx.random.normal((1, 16, columns), key=mx.random.key(1))
    narrow = wide[:, : quantized_prefill.MIN_ROWS - 1]
    # Outside prefill, and for narrow inputs inside it, the quantized kernel itself runs.
    assert mx.array_equal(layer(wide), quantized_call(layer, wide))
    with prefilling():
        assert mx.array_equal(layer(narrow), quantized_call(layer, narrow))
        fast = layer(wide)
    assert mx.allclose(fast, quantized_call(layer, wide), atol=1e-4, rtol=1e-4)


def test_prefill_of_a_quantized_model_gives_the_same_tokens(quantized):
    model, tokenizer = quantized
    prompt = LONG_PROMPT[:600]  # three chunks
    fast = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=8)]
    layers = [m for _, m in model.named_modules() if isinstance(m, PrefillQuantizedLinear)]
    try:
        for layer in layers:
            layer.__class__ = nn.QuantizedLinear
        slow = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=8)]
    finally:
        for layer in layers:
            layer.__class__ = PrefillQuantizedLinear
    assert fast == slow


# -- cancellation --------------------------------------------------------------------------------


class Gated:
    """A model whose prompt forwards (more than one token) are counted and can be made to wait
    for the test, or to act, while the rest of the model is what it wraps."""

    def __init__(self, model, on_chunk=None):
        self._model = model
        self.chunks = 0
        self.sizes: list[int] = []  # tokens per chunk
        self.entered = threading.Event()
        self.go = threading.Event()
        self.go.set()
        self.on_chunk = on_chunk

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, tokens, *args, **kwargs):
        if tokens.shape[1] > 1:
            self.chunks += 1
            self.sizes.append(tokens.shape[1])
            if self.on_chunk is not None:
                self.on_chunk(self.chunks)
            self.entered.set()
            assert self.go.wait(120), "the test never let the chunk go on"
        return self._model(tokens, *args, **kwargs)


def test_a_cancelled_prefill_stops_between_chunks_and_keeps_its_prefix(quantized):
    model, _ = quantized
    gated = Gated(model)
    sequence = Sequence(gated)
    with pytest.raises(PrefillCancelled):
        sequence.prefill(LONG_PROMPT, cancelled=lambda: gated.chunks == 2)
    assert gated.chunks == 2
    done = sum(gated.sizes)  # a cancellable prefill's chunks are sized by their time
    assert sequence.cache.offset == done and 2 * CANCELLABLE_STEPS[0] <= done <= 2 * PREFILL_STEP
    assert sequence.context == LONG_PROMPT[:done]
    # The same prompt again continues from the chunks done, to the same first token.
    assert sequence.prefill(LONG_PROMPT) == done
    fresh = Sequence(model)
    fresh.prefill(LONG_PROMPT)
    assert mx.allclose(sequence._prompt_logits, fresh._prompt_logits, atol=1e-4)


def test_a_cancelled_prefill_ends_the_stream_without_a_response(quantized):
    model, tokenizer = quantized
    from mlx_speculate.generation import Session
    from mlx_speculate.sampling import SamplingParams

    session = Session(model, tokenizer)
    stream = session.stream(
        LONG_PROMPT, sampling=SamplingParams(), max_tokens=4, cancelled=lambda: True
    )
    assert list(stream) == []
    assert session.sequence.cache.offset == 0


def test_ctrl_c_during_prefill_exits_130_within_a_chunk(quantized, monkeypatch, capsys):
    """SIGINT lands while chunk 2 runs; Python raises KeyboardInterrupt when that chunk's
    evaluation returns, before chunk 3."""
    model, tokenizer = quantized
    gated = Gated(model, on_chunk=lambda n: n == 2 and os.kill(os.getpid(), signal.SIGINT))
    monkeypatch.setattr(generate, "load_or_default", lambda *_: (gated, tokenizer))
    prompt = " ".join(f"w{i % 90}" for i in range(2000))
    code = generate.main(["--prompt", prompt, "--ignore-chat-template", "-m", "4"])
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err
    assert gated.chunks == 2


def test_a_client_leaving_during_prefill_frees_the_server_within_a_chunk(quantized):
    model, tokenizer = quantized
    gated = Gated(model)
    with serve(gated, tokenizer) as running:
        gated.chunks = 0  # the server's start-up calibration ran prompt forwards of its own
        gated.go.clear()
        body = {"model": "stories", "prompt": LONG_PROMPT, "max_tokens": 4, "stream": True}

        def leave_during_prefill():
            with httpx.Client(timeout=120) as client:
                with client.stream("POST", f"{running.url}/v1/completions", json=body):
                    gated.entered.wait(120)  # chunk 1 is running: leave now

        client = threading.Thread(target=leave_during_prefill)
        client.start()
        client.join(150)
        deadline = time.monotonic() + 120  # a bound on a hung test, not a measurement
        while not any(job.cancelled for job in running.worker._running):
            assert time.monotonic() < deadline, "the disconnect never cancelled the job"
            time.sleep(0.01)
        gated.go.set()  # chunk 1 finishes; chunks 2 to 8 must not run
        completion = running.client().completions.create(
            model="stories", prompt=[5, 6, 7], max_tokens=2, temperature=0
        )
        assert completion.choices[0].finish_reason in ("stop", "length")  # served in full
        assert gated.chunks == 2  # chunk 1 of the long prompt, then the short prompt's one
        outcome = running.metric(
            "mlx_speculate_requests_total", endpoint="/v1/completions", outcome="cancelled"
        )
        assert outcome == 1


def test_verbose_reports_prompt_tokens_per_second(quantized, monkeypatch, capsys):
    """Each of the 3 chunks of a 600-token prompt takes at least 0.2 s more: the rate must
    fall between 600 over the whole command's time and 600 over those 0.6 s."""
    model, tokenizer = quantized
    slowed = Gated(model, on_chunk=lambda _: time.sleep(0.2))
    monkeypatch.setattr(generate, "load_or_default", lambda *_: (slowed, tokenizer))
    prompt = " ".join(f"w{i % 90}" for i in range(600))
    start = time.perf_counter()
    code = generate.main(["--prompt", prompt, "--ignore-chat-template", "-m", "2", "--verbose"])
    elapsed = time.perf_counter() - start
    assert code == 0 and slowed.chunks == 3
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("Prompt: "))
    count, rate = line.removeprefix("Prompt: ").split(" tokens, ")
    assert int(count) == 600
    assert 600 / elapsed <= float(rate.removesuffix(" tokens-per-sec")) <= 600 / 0.6


def test_a_cancellable_prefill_sizes_its_chunks_by_their_time(quantized):
    """With a `cancelled` callback, chunks start at 32 tokens and then take what fits in
    CANCEL_SECONDS at the rate measured: 16 where each token takes 20 ms (a slow machine),
    more where the model is fast. Without one they are PREFILL_STEP tokens."""
    model, _ = quantized
    slow = Gated(model, on_chunk=lambda _: time.sleep(0.02 * slow.sizes[-1]))
    Sequence(slow).prefill(LONG_PROMPT[:100], cancelled=lambda: False)
    assert slow.sizes == [32, 16, 16, 16, 16, 4]  # 100 tokens, the last chunk what is left
    fast = Gated(model)
    Sequence(fast).prefill(LONG_PROMPT, cancelled=lambda: False)
    assert fast.sizes[0] == 32 and max(fast.sizes) > 32 and sum(fast.sizes) == len(LONG_PROMPT)
    plain = Gated(model)
    Sequence(plain).prefill(LONG_PROMPT)
    assert plain.sizes[:-1] == [PREFILL_STEP] * (len(plain.sizes) - 1)


def test_a_prefill_runs_a_chunk_at_a_time(quantized):
    """`begin_prefill` validates and reuses the cached prefix at once; each `chunk` then runs
    the next PREFILL_STEP tokens (sized: CANCELLABLE_STEPS[1] first), so a batch can step
    between them, and the last one leaves the first token's logits."""
    model, _ = quantized
    sequence = Sequence(model)
    prefill = sequence.begin_prefill(LONG_PROMPT[:600])
    starts = []
    while not prefill.done:
        starts.append(prefill.start)
        prefill.chunk()
    assert starts == [0, PREFILL_STEP, 2 * PREFILL_STEP] and sequence.cache.offset == 600
    assert sequence._prompt_logits.shape == (1, model.args.vocab_size)
    again = sequence.begin_prefill(LONG_PROMPT[:640], sized=True)
    assert again.kept == 600 and not again.done
    again.chunk()
    assert again.start == 600 + min(40, CANCELLABLE_STEPS[1])
    with pytest.raises(ValueError, match="the prompt is empty"):
        sequence.begin_prefill([])
