"""Local folder or hub id -> (model, tokenizer).

Reads HF checkpoints (single or sharded safetensors) and mlx-lm / mlx-community folders
(`quantization` in config.json, per-module overrides included).

The compute dtype follows the device: MLX's CPU backend runs float16/bfloat16 arithmetic
(quantized matmuls with such scales included) about 45x slower than float32, so on the CPU
every floating-point tensor, quantization scales and biases included, is loaded as float32;
on the GPU (Metal) the checkpoint's own dtypes are kept. `load(..., dtype=)` overrides both.
"""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    NaiveStreamingDetokenizer,
    SPMStreamingDetokenizer,
    TokenizerWrapper,
)

from .checkpoint import load_into, read_weights
from .models import MODEL_TYPES
from .models.base import CausalLM, Origin

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
        return Path(
            snapshot_download(name, allow_patterns=allow_patterns or _DOWNLOAD_PATTERNS)
        )
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


def load_config(path: Path) -> dict[str, Any]:
    if path.is_file() and path.suffix == ".gguf":
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
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(MODEL_TYPES)})"
        )
    return MODEL_TYPES[model_type]


def load_weights(path: Path) -> dict[str, mx.array]:
    files = sorted(Path(f) for f in glob.glob(str(path / "model*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no model*.safetensors weights in {path}")
    return read_weights(files)


def build_model(
    config: dict[str, Any], weights: dict[str, mx.array], dtype: mx.Dtype | None = None
) -> CausalLM:
    """A model with `weights` loaded; shapes are checked against `config`."""
    module = model_class(config)
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
    )


def load_model(
    path: Path, dtype: mx.Dtype | None = None, tokenizer: Any = None
) -> tuple[CausalLM, dict[str, Any]]:
    """The model in the folder `path`, its `origin` recording the folder and `tokenizer`."""
    config = load_config(path)
    model_class(config)
    model = build_model(config, load_weights(path), dtype)
    model.origin = Origin(path, tokenizer)
    return model, config


def eos_token_ids(path: Path, config: dict[str, Any]) -> list[int]:
    """EOS ids from config.json and generation_config.json (the tokenizer adds its own)."""
    ids: list[int] = []
    sources = [config]
    if (path / "generation_config.json").exists():
        sources.append(read_json(path / "generation_config.json"))
    for source in sources:
        eos = source.get("eos_token_id")
        for i in eos if isinstance(eos, list) else [eos]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def _detokenizer_class(path: Path):
    """mlx-lm's choice of streaming detokenizer, from the tokenizer.json decoder."""
    file = path / "tokenizer.json"
    if not file.exists():
        return NaiveStreamingDetokenizer
    decoder = read_json(file).get("decoder") or {}
    if decoder.get("type") == "ByteLevel":
        return BPEStreamingDetokenizer
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else []
    replaces_metaspace = any(
        d.get("type") == "Replace" and d.get("pattern", {}).get("String") == "\u2581"
        for d in steps
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


def load(
    path_or_hub_id: str | Path, *, dtype: mx.Dtype | None = None
) -> tuple[CausalLM, TokenizerWrapper]:
    """Loads a model and its tokenizer from a local folder or a Hugging Face hub id.

    `dtype` casts every floating-point tensor, quantization scales and biases included; by
    default float32 on the CPU backend and the checkpoint's own dtypes on the GPU.
    """
    path = resolve_path(path_or_hub_id)
    config = load_config(path)  # what is quick to check first: the config, then the tokenizer
    model_class(config)
    tokenizer = load_tokenizer(path, eos_token_ids(path, config))
    model, _ = load_model(path, dtype or default_dtype(), tokenizer)
    if (count := token_count(tokenizer)) > model.args.vocab_size:
        raise ValueError(
            f"the tokenizer in {path} has {count} token ids but the model's vocabulary has "
            f"{model.args.vocab_size}: they do not belong together"
        )
    return model, tokenizer
