"""EAGLE with the real SmolLM2-135M-Instruct heads in ../shared/eagle (skipped without it)
against the official SafeAILab implementation's results (tests/data/eagle/official-dev.json):
the same outputs token for token, and the same acceptance, tau = new tokens / verify forwards.
Also chains and 4-bit converted heads, which the official runs do not cover, against plain
greedy decoding.

A sample of the prompts runs by default (CI); `-m slow` runs every one of them."""

from __future__ import annotations

import functools
import json

import pytest

from mlx_speculate.convert import convert
from mlx_speculate.decode import Decoder
from mlx_speculate.drafters import EagleGrowth, EagleSpec, make_drafter
from mlx_speculate.heads.eagle_format import convert_eagle_heads, load_eagle_heads
from mlx_speculate.loading import load
from mlx_speculate.policy.adaptive import FixedPolicy
from mlx_speculate.sampling import SamplingParams
from mlx_speculate.sequence import Sequence

from .helpers import BESIDE, DATA, EAGLE_HEADS, require

RUNS = ("eagle1-dynamic-tree", "eagle1-static-chain", "eagle3-dynamic-tree")
SAMPLE = (0, 1, 5)  # the three shortest answers
HEADS = {"eagle1": "smollm2-eagle1", "eagle3": "smollm2-eagle3"}


@pytest.fixture(scope="session", autouse=True)  # session: before the session's smollm2_file
def _heads_present() -> None:
    """Every test here needs the heads: without them, skip before fetching or converting SmolLM2."""
    require(EAGLE_HEADS, BESIDE)


@pytest.fixture(scope="module")
def official() -> dict:
    return json.loads((DATA / "eagle" / "official-dev.json").read_text())["runs"]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, smollm2_file):
    """The float32 conversion of the SmolLM2 GGUF: the target the official runs used."""
    folder = convert(smollm2_file, tmp_path_factory.mktemp("smollm2") / "f32", dtype="float32")
    return load(folder)


@functools.cache
def heads_folder(name: str):
    return require(EAGLE_HEADS / name, BESIDE)


def greedy(model, drafter, prompt: list[int], settings: EagleGrowth, n: int):
    """At least n tokens of greedy EAGLE decoding with every step verifying the whole tree
    (as the official code does), and the verify forwards that took."""
    decoder = Decoder(Sequence(model, drafter))
    decoder.sequence.prefill(prompt)
    tokens, forwards = [], 0
    for step in decoder.steps(SamplingParams(), FixedPolicy(settings.total - 1)):
        tokens += step.tokens
        forwards += step.verified
        if len(tokens) >= n:
            return tokens, forwards
    raise AssertionError("the context filled up first")


def check_run(official: dict, model, run: str, prompts, heads=None) -> None:
    data = official[run]
    shape = data["tree"]
    settings = EagleGrowth(shape["total_token"], shape["depth"], shape["top_k"])
    spec = EagleSpec(heads=heads or heads_folder(data["head"]), tree=settings)
    drafter = make_drafter(spec, model)
    new_tokens = forwards = official_forwards = 0
    for index in prompts:
        entry = data["prompts"][index]
        want = entry["output_ids"]  # the official loop stops once a round passes 128 or EOS
        tokens, used = greedy(model, drafter, entry["prompt_ids"], settings, len(want))
        assert tokens[: len(want)] == want, f"prompt {index}"
        new_tokens += len(want)
        forwards += used  # verify forwards to reach the official output's length
        official_forwards += entry["verify_forwards"]
    tau, official_tau = new_tokens / forwards, new_tokens / official_forwards
    assert tau >= 0.95 * official_tau, (run, tau, official_tau)


@pytest.mark.parametrize("run", RUNS)
def test_official_outputs_and_acceptance_on_a_sample(official, smollm2, run):
    check_run(official, smollm2[0], run, SAMPLE)


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_official_outputs_and_acceptance_on_every_prompt(official, smollm2, run):
    check_run(official, smollm2[0], run, range(len(official[run]["prompts"])))


def test_speculators_layout_decodes_like_the_official_eagle3(official, smollm2):
    heads = heads_folder("smollm2-eagle3-speculators")
    check_run(official, smollm2[0], "eagle3-dynamic-tree", SAMPLE[:2], heads)


@pytest.mark.parametrize("version", ["eagle1", "eagle3"])
@pytest.mark.parametrize("variant", ["chain", "4-bit"])
def test_chains_and_4bit_heads_equal_plain_greedy(official, smollm2, tmp_path, version, variant):
    """Chains and 4-bit heads against plain greedy decoding (which the official outputs are:
    official-dev.json says so, and the test above checks it)."""
    model, _ = smollm2
    heads = heads_folder(HEADS[version])
    settings = EagleGrowth.chain(5) if variant == "chain" else EagleGrowth(60, 7, 10)
    if variant == "4-bit":
        folder = convert_eagle_heads(heads, tmp_path / "heads", target=model, quantize=True)
        heads = load_eagle_heads(folder, model)
        assert "scales" in heads.fc
    drafter = make_drafter(EagleSpec(heads=heads, tree=settings), model)
    for index in (1, 5):
        entry = official["eagle1-dynamic-tree"]["prompts"][index]
        want = entry["output_ids"]
        tokens, forwards = greedy(model, drafter, entry["prompt_ids"], settings, len(want))
        assert tokens[: len(want)] == want
        assert len(want) / forwards > 1.3  # multi-token acceptance really happens
