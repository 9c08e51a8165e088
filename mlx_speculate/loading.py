"""Local folder or hub id -> (model, tokenizer).

Reads HF checkpoints (single or sharded safetensors) and mlx-lm / mlx-community folders
(`quantization` in config.json, per-module overrides included). A model type this package
does not implement but mlx-lm does runs through mlx-lm's own module (models/mlx_lm_model.py).

The compute dtype follows the device: MLX's CPU backend runs float16/bfloat16 arithmetic
(quantized matmuls with such scales included) far slower than float32, so on the CPU
every floating-point tensor, quantization scales and biases included, is loaded as float32;
on the GPU (Metal) the checkpoint's own dtypes are kept. `load(..., dtype=)` overrides both.
On the CPU, quantized linear layers dequantize for the prompt's wide matmuls
(quantized_prefill.py).
"""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from .checkpoint import evaluate, load_into, read_weights
from .models import MODEL_TYPES, config_checks, quantized_prefill
from .models.base import CausalLM, Origin
from .parallel.ranks import check_same_model, model_digest
from .parallel.sharding import Split

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_DOWNLOAD_PATTERNS = ["*.json", "model*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]


def resolve_path(path_or_hub_id: str | Path, allow_patterns: list[str] | None = None) -> Path:
    """A local path as is; otherwise a hub id (`owner/name`) fetched with `huggingface_hub`.

    What looks like a path is one, so a mistyped path is reported missing rather than looked
    up on the hub: a `Path`, anything starting with `.`, `/` or `~` (no hub id does), and
    `dir/name` where `dir` exists here.
    """
    path = Path(path_or_hub_id).expanduser()
    if path.exists():
        return path
    name = str(path_or_hub_id)
    looks_local = (
        isinstance(path_or_hub_id, Path)
        or name.startswith((".", "/", "~"))
        or Path(name.split("/")[0]).is_dir()
    )
    if looks_local or not _HUB_ID.match(name):
        raise FileNotFoundError(f"model path {name!r} does not exist")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=allow_patterns or _DOWNLOAD_PATTERNS))
    except Exception as e:  # the hub raises many types: network, auth, missing repo
        raise FileNotFoundError(
            f"{name!r} is not a local folder and could not be fetched from the Hugging Face "
            f"Hub ({type(e).__name__}: {e})"
        ) from e


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file starting with GGUF's magic, whatever its name."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:  # absent, a folder, unreadable: not a GGUF file to read
        return False


def load_config(path: Path) -> dict[str, Any]:
    if path.is_file() and (path.suffix == ".gguf" or is_gguf(path)):
        raise ValueError(
            f"{path} is a GGUF file, not a model folder: convert it first with "
            f"python -m mlx_speculate.convert --hf-path {path} --mlx-path "
            f"{path.with_suffix('')}-mlx -q (-q keeps a quantized GGUF's own quantization)"
        )
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a folder")
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"no config.json in {path}")
    return read_json(config_file)


def model_class(config: dict[str, Any]):
    """The family module of a type this package implements (ValueError for any other)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(MODEL_TYPES)})"
        )
    return MODEL_TYPES[model_type]


def implementation(config: dict[str, Any]) -> str:
    """What runs the config's model type: "native" for a type this package implements;
    "mlx-lm" for another one that mlx-lm has a module for (models/mlx_lm_model.py);
    ValueError in one line for any other."""
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in MODEL_TYPES:
        return "native"
    # mlx-lm's package imports transformers (and torch): only for a type not native here.
    from .models.mlx_lm_model import mlx_lm_class

    if isinstance(model_type, str) and mlx_lm_class(config) is not None:
        return "mlx-lm"
    raise ValueError(
        f"model_type {model_type!r} is not supported (supported: {', '.join(MODEL_TYPES)}, "
        "and through mlx-lm every type it loads)"
    )


def load_weights(path: Path) -> dict[str, mx.array]:
    files = sorted(Path(f) for f in glob.glob(str(path / "model*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no model*.safetensors weights in {path}")
    return read_weights(files)


def build_model(
    config: dict[str, Any],
    weights: dict[str, mx.array],
    dtype: mx.Dtype | None = None,
    lazy: bool = False,
) -> CausalLM:
    """A model with `weights` loaded (`lazy`: not yet read, see checkpoint.load_into); shapes
    are checked against `config`."""
    module = model_class(config)
    config_checks.check_sizes(config)
    config_checks.check_rope(config)
    config_checks.check_quantization(config, weights)
    try:
        args = module.ModelArgs.from_dict(config)
    except TypeError as e:  # a required size is absent
        raise ValueError(f"{config.get('model_type')} config is incomplete: {e}") from e
    model = module.Model(args)
    quantization = config.get("quantization")
    if isinstance(quantization, dict):  # per-module overrides are keyed by checkpoint paths
        quantization = {
            new: v for k, v in quantization.items() if (new := model.rename(k)) is not None
        }
    return load_into(
        model,
        model.sanitize(weights),
        quantization=quantization,
        dtype=dtype,
        what=f"the {config.get('model_type')} config",
        lazy=lazy,
    )


def load_model(
    path: Path, dtype: mx.Dtype | None = None, tokenizer: Any = None, split: Split | None = None
) -> tuple[CausalLM, dict[str, Any]]:
    """The model in the folder `path`, its `origin` recording the folder and `tokenizer`;
    with `split`, only this rank's part of it is read, once every rank is known to have
    found the same checkpoint."""
    config = load_config(path)
    if implementation(config) == "mlx-lm":
        if split is not None:
            raise ValueError(
                f"{config['model_type']} runs through mlx-lm's module, which this package "
                "does not split across machines"
            )
        from .models.mlx_lm_model import load_mlx_lm

        model = load_mlx_lm(path, config, dtype)
        model.origin = Origin(path, tokenizer)
        return model, config
    if split is None:
        model = build_model(config, load_weights(path), dtype)
    else:
        # Memory-mapped and unread; once this call returns the model holds the only reference
        # to each whole tensor, and the split drops the parts other ranks keep.
        model = build_model(config, load_weights(path), dtype, lazy=True)
        check_same_model(model_digest(config, model), split.group)
        split.apply(model)
        evaluate(model)
    model.origin = Origin(path, tokenizer)
    return model, config


def eos_token_ids(path: Path, config: dict[str, Any], vocab_size: int) -> list[int]:
    """EOS ids from config.json and generation_config.json (the tokenizer adds its own);
    ValueError for one that is not a token id of the vocabulary."""
    ids: list[int] = []
    sources = [config]
    if (path / "generation_config.json").exists():
        sources.append(read_json(path / "generation_config.json"))
    for source, where in zip(sources, ("config.json", "generation_config.json"), strict=False):
        if source.get("eos_token_id") is None:
            continue
        for i in config_checks.check_eos(source["eos_token_id"], vocab_size, where):
            if i not in ids:
                ids.append(i)
    return ids


def _detokenizer_class(path: Path):
    """mlx-lm's choice of streaming detokenizer, from the tokenizer.json decoder."""
    # Imported here, as in load_tokenizer: mlx_lm's package imports transformers (and torch).
    from mlx_lm.tokenizer_utils import (
        BPEStreamingDetokenizer,
        NaiveStreamingDetokenizer,
        SPMStreamingDetokenizer,
    )

    file = path / "tokenizer.json"
    if not file.exists():
        return NaiveStreamingDetokenizer
    decoder = read_json(file).get("decoder") or {}
    if decoder.get("type") == "ByteLevel":
        return BPEStreamingDetokenizer
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else []
    replaces_metaspace = any(
        d.get("type") == "Replace" and d.get("pattern", {}).get("String") == "\u2581" for d in steps
    )
    if replaces_metaspace and any(d.get("type") == "ByteFallback" for d in steps):
        strips = any(d.get("type") == "Strip" for d in steps)
        return lambda tok: SPMStreamingDetokenizer(tok, trim_space=strips)
    return NaiveStreamingDetokenizer


# One of these makes a tokenizer transformers can load (tokenizer.model: SentencePiece,
# vocab.json: BPE with merges.txt; tiktoken files for some Qwen releases).
TOKENIZER_SOURCES = ("tokenizer.json", "tokenizer.model", "vocab.json", "*.tiktoken")


def check_tokenizer_files(path: Path) -> None:
    if not any(any(path.glob(pattern)) for pattern in TOKENIZER_SOURCES):
        raise FileNotFoundError(
            f"no tokenizer in {path} (expected one of {', '.join(TOKENIZER_SOURCES)})"
        )


def load_tokenizer(path: Path, eos_ids: list[int] | None = None) -> TokenizerWrapper:
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    check_tokenizer_files(path)
    detokenizer = _detokenizer_class(path)
    try:
        # tokenizer.json is the full truth; AutoTokenizer may pick a class by model_type that
        # rebuilds the pipeline differently (transformers 5.x does so for qwen2 folders).
        if (path / "tokenizer.json").exists():
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # tokenizers and transformers raise plain Exception for bad files
        raise ValueError(f"cannot read the tokenizer in {path}: {e}") from e
    return TokenizerWrapper(tokenizer, detokenizer, eos_token_ids=eos_ids)


def token_count(tokenizer) -> int:
    """Highest token id + 1, added tokens included (len() is not forwarded by wrappers)."""
    return max(tokenizer.get_vocab().values()) + 1


def default_dtype() -> mx.Dtype | None:
    """float32 on the CPU backend; None (the checkpoint's own dtypes) on the GPU."""
    return mx.float32 if mx.default_device() == mx.cpu else None


def compute_dtype(dtype: mx.Dtype | str | None) -> mx.Dtype | None:
    """`dtype` as an MLX dtype: one of DTYPES, by value or by name."""
    if dtype is None or dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(
        f"dtype must be one of {', '.join(DTYPES)} (a name or mlx.core's dtype), got {dtype!r}"
    )


def load(
    path_or_hub_id: str | Path,
    *,
    dtype: mx.Dtype | str | None = None,
    split: Split | None = None,
) -> tuple[CausalLM, TokenizerWrapper]:
    """Loads a model and its tokenizer from a local folder or a Hugging Face hub id.

    `dtype` (an MLX dtype or its name: "float32", "float16", "bfloat16") casts every
    floating-point tensor, quantization scales and biases included; by default float32 on the
    CPU backend and the checkpoint's own dtypes on the GPU. `split` (under `mlx.launch`)
    loads only this rank's part of the model (`parallel.sharding.Split`: tensor or pipeline).
    """
    dtype = compute_dtype(dtype)
    path = resolve_path(path_or_hub_id)
    if path.is_dir():  # what is quick to check first: a model's config, then the tokenizer
        implementation(load_config(path))
        check_tokenizer_files(path)
    model, config = load_model(path, dtype or default_dtype(), split=split)
    if mx.default_device() == mx.cpu:
        quantized_prefill.install(model)
    tokenizer = load_tokenizer(path, eos_token_ids(path, config, model.args.vocab_size))
    if (count := token_count(tokenizer)) > model.args.vocab_size:
        raise ValueError(
            f"the tokenizer in {path} has {count} token ids but the model's vocabulary has "
            f"{model.args.vocab_size}: they do not belong together"
        )
    model.origin = Origin(path, tokenizer)
    return model, tokenizer
