"""Shared benchmark plumbing: BLAS choice, model folders, timing summaries.

On Linux the `mlx[cpu]` wheel runs float32 matmuls on reference BLAS; importing
`mlx_speculate` (this module does) loads the system's OpenBLAS before MLX
(`mlx_speculate/blas.py`). `--openblas PATH` with `MLX_SPECULATE_OPENBLAS=0` loads another one;
the benchmarks report which BLAS ran in their header. Models and data go under
$MLX_SPECULATE_BENCH_DIR, else the package's cache ($MLX_SPECULATE_CACHE, else
~/.cache/mlx_speculate).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from mlx_speculate import blas
from mlx_speculate.default_model import cache_dir

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
ROOT = Path(__file__).resolve().parents[1]
# The small real models, tokenizers and EAGLE data the tests use too (tests/data/README.md).
DATA = ROOT / "tests" / "data"
MODELS = DATA / "models"
# Beside a development checkout, not in the repository: the SmolLM2 EAGLE heads (eagle/) and,
# on the GPU machine, the kit's trained stories260K head (models/; gpu_suite.py).
SHARED = ROOT.parent / "shared"
CACHE = Path(os.environ.get("MLX_SPECULATE_BENCH_DIR") or cache_dir()).expanduser()

# Qwen2.5-0.5B's shapes (random weights: speed only, text is noise).
QWEN25_05B = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


def add_blas_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--openblas",
        nargs="?",
        const=OPENBLAS,
        default=None,
        metavar="PATH",
        help=f"load this OpenBLAS before MLX for float32 matmuls (default path {OPENBLAS}; "
        f"importing mlx_speculate loads the system's unless {blas.VARIABLE}=0)",
    )


def setup_blas(path: str | None) -> str:
    """Loads the OpenBLAS at `path` when asked and the package has not loaded one (must run
    before `import mlx`); returns a description of the BLAS that runs."""
    if not path or blas.BLAS == f"OpenBLAS ({path})":
        return blas.BLAS
    if "mlx.core" in sys.modules:
        raise RuntimeError("OpenBLAS must be loaded before mlx is imported")
    if blas.BLAS.startswith("OpenBLAS"):
        raise SystemExit(
            f"--openblas {path}: importing mlx_speculate loaded {blas.BLAS} already; "
            f"set {blas.VARIABLE}=0 to load another one"
        )
    if not Path(path).exists():
        raise SystemExit(f"{path} not found: apt-get install libopenblas0-pthread")
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return f"OpenBLAS ({path})"


def header(title: str, blas: str) -> None:
    """Prints the run's title, device and BLAS; from then on graphs are built where they are
    called, as before the background builds (graphs.py): a benchmark times steady steps after
    its warm-ups, which must not leave builds queued behind them."""
    import mlx.core as mx

    from mlx_speculate import graphs

    graphs.build_in_place()
    print(f"# {title}")
    print(f"device: {mx.default_device()}, BLAS: {blas}, mlx {mx.__version__}")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def smollm2_f32() -> Path:
    """SmolLM2-135M-Instruct in float32 as an MLX folder (mlx-lm loads it too), converted
    once from the package's default GGUF (fetched on first use)."""
    from mlx_speculate.convert import convert
    from mlx_speculate.default_model import smollm2_gguf

    folder = CACHE / "smollm2-f32-mlx"
    if not folder.exists():
        convert(smollm2_gguf(), folder, dtype="float32")
    return folder


def random_model(config: dict, dtype=None, seed: int = 0):
    """A model of `config`'s shapes with N(0, 0.02) weights in `dtype` (float32), in memory."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    from mlx_speculate.loading import model_class

    module = model_class(config)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.random.seed(seed)
    weights = [
        (name, (0.02 * mx.random.normal(p.shape)).astype(dtype or mx.float32))
        for name, p in tree_flatten(model.parameters())
    ]
    model.update(tree_unflatten(weights))
    return model


def write_random_model(folder: Path, config: dict, seed: int = 0) -> Path:
    """A float32 folder with random weights in HF names, plus the Qwen2 tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if (folder / "model.safetensors").exists():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = dict(tree_flatten(random_model(config, seed=seed).parameters()))
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    write_qwen2_tokenizer(tmp)
    tmp.rename(folder)
    return folder


def write_qwen2_tokenizer(folder: Path) -> None:
    from mlx_speculate.gguf.tokenizer import write_gguf_tokenizer

    write_gguf_tokenizer(DATA / "tokenizers" / "ggml-vocab-qwen2.gguf", folder)


def describe_machine(blas: str) -> dict[str, str]:
    """The machine a run measured, label -> value in display order."""
    import mlx.core as mx

    return {
        "CPU": _cpu_model(),
        "OS": platform.platform(),
        "MLX device": str(mx.default_device()),
        "BLAS": blas,
    }


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    if platform.system() == "Darwin":
        return _output(["sysctl", "-n", "machdep.cpu.brand_string"]) or platform.machine()
    return platform.processor() or platform.machine()


def describe_versions() -> dict[str, str]:
    """mlx, mlx-lm, Python and this checkout's commit (flagged when the package or the
    benchmarks have uncommitted changes)."""
    import mlx.core as mx

    commit = _output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]) or "unknown"
    changed = _output(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no",
                       "--", "mlx_speculate", "benchmarks"])
    if changed:
        commit += " (with uncommitted changes to the package or benchmarks)"
    return {
        "mlx": mx.__version__,
        "mlx-lm": version("mlx-lm"),
        "Python": platform.python_version(),
        "mlx_speculate commit": commit,
    }


def _output(command: list[str]) -> str:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout.strip() if result.returncode == 0 else ""
