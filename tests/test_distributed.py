"""Tensor parallelism on one machine: ranks over the ring backend on loopback (`mlx.launch`),
CPU. Sharded logits match the single-process ones; greedy decoding (plain, prompt lookup,
draft model) is token for token the same; seeded sampling is identical across ranks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mlx_speculate.parallel.pipeline import split_layers
from mlx_speculate.parallel.sharding import check_shardable, shard

from .helpers import tiny_model
from .test_cli import tiny_folder

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("llama", "qwen2", "phi3", "qwen3", "gemma3_text", "mistral", "ministral3", "gemma2")
# The families tensor parallelism does not split (experts, recurrent or shared-key layers):
# pipeline parallelism runs them.
PIPELINE_ONLY = (
    "qwen3_moe", "gpt_oss", "gemma4_text", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text",
)  # fmt: skip
HYBRIDS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
LAUNCH = Path(sys.executable).with_name("mlx.launch")


def free_port(count: int) -> int:
    """A port p with p .. p + count - 1 free now (the ring backend listens on consecutive ones)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + count < 65535 and all(_free(port + i) for i in range(count)):
            return port
    raise RuntimeError("no free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def run_launch(command: list[str]) -> subprocess.CompletedProcess:
    """`mlx.launch` in its own process group, killed whole on a timeout: a hung rank otherwise
    outlives the test and spins on a core. The ranks' watchdogs end a hung step; this limit
    only catches a stuck launcher, so it is wide enough for a loaded 2-core machine."""
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        start_new_session=True,
    ) as process:  # fmt: skip
        try:
            out, err = process.communicate(timeout=1800)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            pytest.fail(f"mlx.launch timed out; its ranks were killed: {err[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def worker_command(worker: str, ranks: int, tmp_path: Path, spec: dict) -> list[str]:
    """`mlx.launch` of tests/<worker> over `ranks` ranks on loopback."""
    return [
        str(LAUNCH), "--backend", "ring", "-n", str(ranks), "--hosts", "127.0.0.1",
        "--starting-port", str(free_port(ranks)), "--python", sys.executable, "--cwd", str(ROOT),
        str(ROOT / "tests" / worker), str(tmp_path), json.dumps(spec),
    ]  # fmt: skip


def launch(tmp_path: Path, ranks: int, spec: dict) -> list[dict[str, np.ndarray]]:
    done = run_launch(worker_command("dist_worker.py", ranks, tmp_path, spec))
    # mlx.launch exits 0 even when a rank fails: the files are the evidence.
    missing = [r for r in range(ranks) if not (tmp_path / f"rank{r}.npz").exists()]
    assert done.returncode == 0 and not missing, done.stdout[-3000:] + done.stderr[-3000:]
    return [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(ranks)]


def assert_sharded_matches(results, families, generate=(), atol=2e-5) -> None:
    for family in families:
        for rank in results:
            single = rank[f"{family}/single/logits"]
            np.testing.assert_allclose(rank[f"{family}/sharded/logits"], single, atol=atol)
            taps = rank[f"{family}/single/taps"]
            np.testing.assert_allclose(rank[f"{family}/sharded/taps"], taps, atol=atol)
        # A hybrid verifies chains only: no Medusa trees (dist_worker.CHAIN_METHODS).
        methods = ("plain", "lookup", "draft", "eagle")
        methods += () if family in HYBRIDS else ("medusa",)
        for method in methods if family in generate else ():
            for rank in results:
                assert list(rank[f"{family}/sharded/{method}"]) == list(
                    rank[f"{family}/single/{method}"]
                ), (family, method)
        if family in generate:
            sampled = [list(rank[f"{family}/sharded/sampled"]) for rank in results]
            assert all(s == sampled[0] for s in sampled), sampled


def test_two_ranks_every_family(tmp_path):
    spec = {"families": FAMILIES, "generate": ["llama", "phi3"]}
    results = launch(tmp_path, 2, spec)
    assert_sharded_matches(results, FAMILIES, spec["generate"])


def test_three_ranks_and_quantized(tmp_path):
    overrides = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3}
    spec = {"families": ["llama", "phi3"], "generate": ["phi3"], "overrides": overrides}
    assert_sharded_matches(launch(tmp_path, 3, spec), ["llama", "phi3"], ["phi3"])


def test_two_ranks_quantized(tmp_path):
    overrides = {"intermediate_size": 128}  # 64 inputs of down_proj per rank: 2 groups of 32
    spec = {"families": ["llama", "phi3"], "quantize": True, "overrides": overrides}
    assert_sharded_matches(launch(tmp_path, 2, spec), ["llama", "phi3"], atol=1e-4)


def test_pipeline_two_ranks_every_family(tmp_path):
    """Layers split across ranks: the same logits and taps (EAGLE-3 reads layers of both
    halves), the same greedy tokens with and without a draft model, the same samples. Every
    family, those tensor parallelism refuses too; a hybrid's rank 0 holds only recurrent
    layers and rank 1 both kinds, and each rolls its own recurrent state back after rejected
    drafts: its tokens equal the single process's with every chain method."""
    families = FAMILIES + PIPELINE_ONLY
    generate = ["llama", "gemma3_text", "qwen3_next", "gpt_oss"]
    spec = {"families": families, "generate": generate, "parallel": "pipeline"}
    assert_sharded_matches(launch(tmp_path, 2, spec), families, generate, atol=1e-6)


def test_pipeline_three_ranks_uneven_blocks(tmp_path):
    """Blocks of 2, 1 and 1 layers; the hybrid's hold two Gated DeltaNet layers, one, and
    its attention layer alone, each rank keeping its own layers' recurrent state."""
    families = ["qwen2", "qwen3_5_text"]
    spec = {"families": families, "generate": families, "parallel": "pipeline"}
    spec["overrides"] = {"num_hidden_layers": 4}
    assert_sharded_matches(launch(tmp_path, 3, spec), families, families, atol=1e-6)


class FakeGroup:
    def __init__(self, size: int, rank: int = 0):
        self._size = size
        self._rank = rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ({}, "num_key_value_heads=2"),
        ({"num_key_value_heads": 4, "intermediate_size": 99}, "intermediate_size=99"),
    ],
)
def test_indivisible_counts_raise(overrides, name):
    model = tiny_model("llama", **overrides)
    with pytest.raises(ValueError, match=name):
        shard(model, FakeGroup(4 if not overrides else 2))
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        check_shardable(model, 3)


@pytest.mark.parametrize("model_type", PIPELINE_ONLY)
def test_tensor_parallel_refuses_families_it_does_not_split(model_type):
    """Experts (and recurrent or shared-key layers) are not split: one line naming the way that
    works, never a traceback from a missing projection."""
    model = tiny_model(model_type)
    refused = f"does not split {model_type} models.*--parallel pipeline"
    with pytest.raises(ValueError, match=refused):
        shard(model, FakeGroup(2))


def test_pipeline_refuses_a_gemma4_split_between_shared_keys():
    """A Gemma 4 layer that reads an earlier layer's keys must sit on that layer's rank: a
    split between them is refused in one line naming what works, before any collective."""
    S, F = "sliding_attention", "full_attention"
    shared = {"num_hidden_layers": 4, "layer_types": [S, F, S, F], "num_kv_shared_layers": 2}
    split_layers(tiny_model("gemma4_text", **shared), FakeGroup(2, rank=0))  # layers 0 and 1
    refused = "layer 2 reads layer 0's keys.*use fewer ranks.*layers 0 to 2"
    with pytest.raises(ValueError, match=refused):
        split_layers(tiny_model("gemma4_text", **shared), FakeGroup(2, rank=1))
    # Without shared keys every split works; each rank's cache holds its own layers.
    model = split_layers(tiny_model("gemma4_text", num_hidden_layers=4), FakeGroup(2, rank=1))
    assert len(model.layers) == len(model.make_cache().keys) == 2


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_generate_cli_under_mlx_launch(tmp_path, mode):
    """`mlx.launch ... -- python -m mlx_speculate.generate --draft-model ...` prints once, the
    single-process greedy text, and says how the target is split."""
    folder = tiny_folder(tmp_path / "tiny", 64)
    flags = ["--model", str(folder), "--draft-model", str(folder), "--prompt", "w1 w2 w3"]
    flags += ["--ignore-chat-template", "-m", "12"]
    alone = subprocess.run(
        [sys.executable, "-m", "mlx_speculate.generate", *flags],
        capture_output=True, text=True, cwd=ROOT, timeout=500,
    )  # fmt: skip
    assert alone.returncode == 0, alone.stderr
    command = [
        str(LAUNCH), "--backend", "ring", "-n", "2", "--hosts", "127.0.0.1",
        "--starting-port", str(free_port(2)), "--cwd", str(ROOT),
        "--", sys.executable, "-m", "mlx_speculate.generate", *flags, "--verbose",
        "--parallel", mode, "--rank-timeout", "300",
    ]  # fmt: skip
    done = run_launch(command)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(alone.stdout.strip()) == 1, (done.stdout, alone.stdout)
    assert f"Sharded: {mode} parallel over 2 ranks" in done.stdout + done.stderr
