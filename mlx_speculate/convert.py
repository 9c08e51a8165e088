"""HF folder, hub id or GGUF file -> an mlx-lm model folder, optionally quantized.

    python -m mlx_speculate.convert --hf-path SRC --mlx-path DST [-q] [--q-bits 4] ...

The output is what `mlx_lm.convert` writes, so both this package and mlx-lm load it:
`config.json` (the source config, rope settings in both the `rope_parameters` and the legacy
`rope_theta`/`rope_scaling` forms, plus `quantization` and its mirror `quantization_config`),
`model.safetensors` or shards with `model.safetensors.index.json`, and the tokenizer files.
The folder is staged beside DST and renamed into place (`atomic.py`); DST is checked to be
writable before the source is read, and `--overwrite` replaces only a model folder (or an
empty one); without it the final rename refuses a DST that another writer made meanwhile.

A GGUF source (llama, qwen2, qwen3, phi3, gemma3, qwen3moe, gpt-oss, qwen3next, qwen35,
qwen35moe, gemma4) converted with -q keeps llama.cpp's own
Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/TQ1_0/TQ2_0 tensors bit for bit (MLX's affine quantization
at group size 32 represents them exactly) and
quantizes the others (Q2_K, Q3_K, Q6_K, IQ*, *FP4) again at group size 32 with their bits; it
says per type which it did. A mixed file (Q4_K_M) gives per-module bits in config.json, as
mlx-lm reads them.

A Qwen3-Next or Qwen3.5 checkpoint's multi-token-prediction head (`mtp.*`, heads/mtp.py) is kept
beside the model in `mtp.safetensors`, in the same dtype and quantized with it: native MTP drafts
with it, and mlx-lm does not read it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from tqdm import tqdm

from . import cli
from .atomic import carry_over, check_space, check_writable, move_into_place, staging_folder
from .checkpoint import quantize_model, write_safetensors
from .gguf.arch import ARCHITECTURES
from .heads.mtp import MTP_FILE, build_mtp, has_mtp, head_file, save_mtp
from .loading import DTYPES, build_model, is_gguf, load_config, load_weights, resolve_path
from .models import MODEL_TYPES
from .models.rope import rope_both_forms

GGUF_DEFAULT_DTYPE = "float16"
Q_BITS = (2, 3, 4, 5, 6, 8)
Q_GROUP_SIZES = (32, 64, 128)
DEFAULT_BITS = 4
DEFAULT_GROUP_SIZE = 64
GGUF_GROUP_SIZE = 32  # llama.cpp's block size (K-quants: their sub-block size)
MAX_SHARD_BYTES = 5 << 30  # mlx-lm's shard limit (5 GiB)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
    "generation_config.json",
)


def convert(
    hf_path: str | Path,
    mlx_path: str | Path,
    *,
    quantize: bool = False,
    q_bits: int | None = None,
    q_group_size: int | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    medusa_path: str | Path | None = None,
    eagle_path: str | Path | None = None,
) -> Path:
    """Converts `hf_path` into an mlx-lm folder at `mlx_path` and returns that path.

    `dtype` casts every floating-point tensor, quantization scales and biases included; None
    keeps the checkpoint's own dtypes (for GGUF: float16, but for quantization scales and biases,
    which stay as read, float16 where that is exact, else float32; F32 norms are rounded).
    `quantize` with a GGUF source keeps the file's quantization (exactly where MLX can, see
    gguf_tensors.py) and leaves its float tensors float; `q_bits` and `q_group_size` apply
    only to a GGUF holding no quantized tensor. `q_bits` defaults to 4; `q_group_size` to 64,
    and to 32 for GGUF (llama.cpp's block size).
    `medusa_path` / `eagle_path`: Medusa or EAGLE heads converted alongside (same dtype and
    quantization, checked to fit the model) into `mlx_path/medusa` or `mlx_path/eagle`.
    `overwrite` replaces only a model folder or an empty one; converting a folder onto itself
    keeps the files the conversion does not write (a README, heads, ...).
    """
    if not quantize and (q_bits is not None or q_group_size is not None):
        raise ValueError("q_bits and q_group_size need quantize=True")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (supported: {', '.join(DTYPES)})")
    if quantize and q_bits is not None and q_bits not in Q_BITS:
        raise ValueError(f"q_bits {q_bits} is not supported (supported: {Q_BITS})")
    if quantize and q_group_size is not None and q_group_size not in Q_GROUP_SIZES:
        raise ValueError(
            f"q_group_size {q_group_size} is not supported (supported: {Q_GROUP_SIZES})"
        )
    dst = Path(mlx_path).expanduser()
    src = Path(hf_path).expanduser()
    onto_itself = src.is_dir() and dst.is_dir() and src.resolve() == dst.resolve()
    check_destination(dst, overwrite)
    gguf = src.suffix == ".gguf" or is_gguf(src)  # the magic bytes, whatever the name
    kept = None  # the GGUF's own quantization, in config.json form
    if gguf:
        if not src.is_file():
            raise FileNotFoundError(f"GGUF file {str(src)!r} does not exist")
        from .gguf.reader import read_gguf
        from .gguf.tokenizer import read_gguf_tokenizer

        print(f"reading {src}")
        gguf_tokenizer = read_gguf_tokenizer(src)  # an unsupported one fails before the work
        checkpoint = read_gguf(src, keep_quantization=quantize)
        config, weights = dict(checkpoint.config), checkpoint.weights
        for kind, fate in (checkpoint.types or {}).items():
            print(f"  GGUF {kind} tensors: {fate}")
        kept = checkpoint.quantization
        if kept is not None:
            config["quantization"] = kept  # build_model quantizes the modules to fit
            if q_bits not in (None, kept["bits"]) or q_group_size not in (None, kept["group_size"]):
                print(
                    f"note: -q keeps the GGUF's own quantization ({describe_quantization(kept)}); "
                    "--q-bits/--q-group-size are ignored",
                    file=sys.stderr,
                )
            q_bits, q_group_size = kept["bits"], kept["group_size"]  # for the Medusa heads
        q_group_size = q_group_size or GGUF_GROUP_SIZE
    else:
        src = resolve_path(hf_path)
        print(f"loading {src}")
        config = load_config(src)
        _check_quantization(config, quantize)
        weights = load_weights(src)
        q_group_size = q_group_size or DEFAULT_GROUP_SIZE
    q_bits = q_bits or DEFAULT_BITS

    model = _build(config, weights)
    head = None
    if has_mtp(model):  # among the checkpoint's tensors, or in a converted folder's own file
        try:
            head = build_mtp(model, weights | head_file(src), config, str(src))
        except ValueError as e:  # the model converts all the same; native MTP then refuses it
            print(f"note: the multi-token-prediction head is not kept: {e}", file=sys.stderr)
    if head is not None:
        print("keeping the multi-token-prediction head (mtp.*)")
    del weights
    modules = [model] if head is None else [model, head]
    config = rope_both_forms(config)
    if dtype is not None or gguf:
        # A GGUF's scales and biases stay as read unless a dtype is asked for: exact.
        keep_scales = dtype is None
        dtype = dtype or GGUF_DEFAULT_DTYPE
        target = DTYPES[dtype]

        def cast(name: str, a: mx.array) -> mx.array:
            if not mx.issubdtype(a.dtype, mx.floating):
                return a
            return a if keep_scales and name.endswith((".scales", ".biases")) else a.astype(target)

        for module in modules:
            params = tree_flatten(module.parameters())
            module.update(tree_unflatten([(k, cast(k, v)) for k, v in params]))
        config["torch_dtype"] = config["dtype"] = dtype
    if kept is not None:
        config["quantization_config"] = dict(kept)
    elif quantize:
        for module in modules:
            settings = quantize_model(module, q_bits, q_group_size)
        config["quantization"] = dict(settings)
        config["quantization_config"] = dict(settings)

    written, weights = model.mlx_lm_layout(config, dict(tree_flatten(model.parameters())))
    dst.parent.mkdir(parents=True, exist_ok=True)
    params = [v for m in modules[1:] for _, v in tree_flatten(m.parameters())]
    check_space(dst.parent, sum(v.nbytes for v in [*weights.values(), *params]))
    tmp = staging_folder(dst)
    try:
        # Heads first: heads that do not fit fail before the model is written.
        options = {
            "quantize": quantize,
            "q_bits": q_bits,
            "q_group_size": q_group_size,
            "dtype": DTYPES.get(dtype),
        }
        if medusa_path is not None:
            from .heads.medusa import convert_medusa_heads

            convert_medusa_heads(medusa_path, tmp / "medusa", model_config=config, **options)
        if eagle_path is not None:
            from .heads.eagle_format import convert_eagle_heads

            convert_eagle_heads(eagle_path, tmp / "eagle", target=model, **options)
        write_weights(tmp, weights, max_shard_bytes)
        if head is not None:
            save_mtp(tmp, head)
        (tmp / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
        if gguf:
            gguf_tokenizer.save(tmp)  # chat template included
        else:
            _copy_tokenizer(src, tmp)
        if onto_itself:  # keep what the conversion does not write (README, heads, ...)
            carry_over(dst, tmp, skip=MODEL_FILES)
        try:
            move_into_place(tmp, dst, replace=overwrite)
        except FileExistsError:  # made by another writer since check_destination
            raise FileExistsError(
                f"{dst} already exists: another process wrote it meanwhile "
                "(pass --overwrite to replace it)"
            ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
    if quantize:
        kind = describe_quantization(config["quantization"])
        kind += ", as in the GGUF" if kept is not None else ""
    else:
        kind = dtype or "source dtype"
    print(f"wrote {dst} ({kind}, {size / 1e6:.1f} MB of weights)")
    return dst


def describe_quantization(quantization: dict[str, Any]) -> str:
    """'4-bit group 32', then the modules quantized otherwise: ', 8-bit group 32: lm_head'."""
    text = f"{quantization['bits']}-bit group {quantization['group_size']}"
    others: dict[str, list[str]] = {}
    for module, override in quantization.items():
        if isinstance(override, dict):
            width = f"{override['bits']}-bit group {override['group_size']}"
            others.setdefault(width, []).append(module)
    for width, modules in others.items():
        text += f", {width}: " + (
            ", ".join(modules) if len(modules) <= 2 else f"{len(modules)} modules"
        )
    return text


def make_shards(weights: dict[str, mx.array], max_bytes: int) -> list[dict[str, mx.array]]:
    """Consecutive groups of tensors of at most `max_bytes` (a larger tensor stands alone)."""
    shards: list[dict[str, mx.array]] = []
    size = 0
    for name, value in weights.items():
        if not shards or size + value.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    return shards


def write_weights(out: Path, weights: dict[str, mx.array], max_shard_bytes: int) -> None:
    shards = make_shards(weights, max_shard_bytes)
    n = len(shards)
    names = [
        "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        for i in range(n)
    ]
    # Quantization is lazy: evaluating each tensor here is where the work happens.
    with tqdm(total=len(weights), unit="tensor", desc="writing") as bar:
        for name, shard in zip(names, shards, strict=True):
            for value in shard.values():
                mx.eval(value)
                bar.update()
            _write_shard(out / name, shard)
    if n > 1:
        index = {
            "metadata": {"total_size": sum(v.nbytes for v in weights.values())},
            "weight_map": {k: names[i] for i, s in enumerate(shards) for k in sorted(s)},
        }
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_shard(path: Path, shard: dict[str, mx.array]) -> None:
    write_safetensors(path, shard)


MODEL_FILES = ("config.json", "model*.safetensors", "model.safetensors.index.json", MTP_FILE)


def check_destination(dst: Path, overwrite: bool) -> None:
    """Fails before any work when DST may not be replaced or cannot be written."""
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise FileExistsError(f"{dst} already exists (pass --overwrite to replace it)")
        empty = dst.is_dir() and not any(dst.iterdir())
        model = dst.is_dir() and all(any(dst.glob(p)) for p in MODEL_FILES[:2])
        if not (empty or model):
            raise FileExistsError(
                f"{dst} is not a model folder (config.json and model*.safetensors): "
                "--overwrite replaces only a model folder or an empty one"
            )
    check_writable(dst)


def _build(config: dict[str, Any], weights: dict[str, mx.array]) -> nn.Module:
    try:
        return build_model(config, weights)
    except TypeError as e:  # ModelArgs(...) without a required field
        raise ValueError(
            f"config.json does not describe a {config.get('model_type')} model: {e}"
        ) from e


def _check_quantization(config: dict[str, Any], quantize: bool) -> None:
    if quantize and "quantization" in config:
        raise ValueError("checkpoint is already quantized; convert from a float checkpoint")
    hf_quant = config.get("quantization_config")
    if hf_quant is not None and "quantization" not in config:
        method = hf_quant.get("quant_method", "unknown") if isinstance(hf_quant, dict) else "?"
        raise ValueError(
            f"checkpoint is quantized with {method!r}, which is not supported; "
            "convert from a float checkpoint"
        )


def _copy_tokenizer(src: Path, out: Path) -> None:
    files = [src / name for name in TOKENIZER_FILES if (src / name).is_file()]
    files += sorted(p for p in src.glob("*.jinja") if p.is_file())
    for file in files:
        shutil.copyfile(file, out / file.name)
    if not any(f.name.startswith("tokenizer") for f in files):
        print(f"warning: no tokenizer files in {src}; add them to the output", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(
        prog=cli.prog("mlx_speculate.convert"),
        description=(
            "Convert a Hugging Face checkpoint (local folder or hub id) or a GGUF file "
            "into an mlx-lm model folder, optionally quantized (MLX affine quantization). "
            f"Supported model types: {', '.join(MODEL_TYPES)}; "
            f"GGUF architectures: {', '.join(ARCHITECTURES)}."
        ),
    )
    parser.add_argument(
        "--hf-path",
        required=True,
        metavar="SRC",
        help="HF model folder, Hugging Face hub id (owner/name) or a .gguf file",
    )
    parser.add_argument(
        "--mlx-path",
        required=True,
        metavar="DST",
        help="output folder (must not exist unless --overwrite)",
    )
    parser.add_argument(
        "-q",
        "--quantize",
        action="store_true",
        help="quantize Linear/Embedding layers whose input dimension is a multiple of the "
        "group size; other layers stay float. A GGUF keeps its own quantization instead: "
        "exactly where MLX's affine form holds the type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, "
        "Q5_K, TQ1_0, TQ2_0; group 32), otherwise quantized again at group 32 with the type's "
        "bits (Q2_K, Q3_K, Q6_K, IQ*, MXFP4, NVFP4); it says which per type",
    )
    parser.add_argument(
        "--q-bits",
        type=int,
        choices=[4, 8],
        help=f"bits per weight (default: {DEFAULT_BITS}; ignored for a quantized GGUF)",
    )
    parser.add_argument(
        "--q-group-size",
        type=int,
        choices=list(Q_GROUP_SIZES),
        help=f"weights sharing one scale and bias (default: {DEFAULT_GROUP_SIZE}; "
        f"{GGUF_GROUP_SIZE} for GGUF, llama.cpp's block size; ignored for a quantized GGUF)",
    )
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        help="cast floating-point weights, quantization scales and biases included "
        "(default: keep the checkpoint's dtype; "
        f"{GGUF_DEFAULT_DTYPE} for GGUF, whose scales are float16 in the file). "
        "MLX's CPU backend computes much faster in float32 than in float16",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace DST if it is a model folder or empty"
    )
    parser.add_argument(
        "--medusa-path",
        metavar="HEADS",
        help="Medusa heads (published folder or file) to convert into DST/medusa",
    )
    parser.add_argument(
        "--eagle-path",
        metavar="HEADS",
        help="EAGLE-1/EAGLE-3 heads (folder, file or hub id; SafeAILab, SpecForge, AngelSlim "
        "or speculators layout) to convert into DST/eagle",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    given = [
        flag
        for flag, value in (("--q-bits", args.q_bits), ("--q-group-size", args.q_group_size))
        if value is not None
    ]
    if given and not args.quantize:
        parser.error(f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} -q")
    try:
        convert(
            args.hf_path,
            args.mlx_path,
            quantize=args.quantize,
            q_bits=args.q_bits,
            q_group_size=args.q_group_size,
            dtype=args.dtype,
            overwrite=args.overwrite,
            medusa_path=args.medusa_path,
            eagle_path=args.eagle_path,
        )
    except KeyboardInterrupt:  # nothing is left behind: the staging folder is removed
        return cli.INTERRUPTED
    except (ValueError, OSError, ImportError) as e:  # ImportError: a .pt checkpoint, no torch
        return cli.fail(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
