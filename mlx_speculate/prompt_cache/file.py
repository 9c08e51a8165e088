"""The prompt-cache file: a prefilled cache and the prompt it holds, written atomically and read
back only into the model (and compute dtype) that made it.

mlx-lm's layout, so that mlx-lm's `load_prompt_cache` reads the file of an attention model: a
safetensors file whose arrays are `"{entry}.{i}"`, the i-th array of each cache entry, and
whose metadata is mlx-lm's flattened `[metadata, classes, scalars]`: `"0.{key}"` the metadata
strings (mlx-lm's `model` and `tokenizer_config`, then ours), `"1.{entry}"` each entry's class,
`"2.0"` an empty scalar list. Entries follow the cache's layers: a `KVCache` layer holds its
keys and values of the prompt, (1, H_kv, N, D) each; a hybrid's cache (state_cache.py) has one
entry per model layer, its recurrent ones `RecurrentState`: the conv inputs (1, kernel - 1 +
rows, channels) and the ring of delta-rule states (rows + 1, 1, H, Dk, Dv) that its last
forward kept from slot `base` on, so that the loaded cache rolls back as the saved one could.
A sliding layer kept as a ring (cache.py) is a `SlidingKVCache` entry (ours; mlx-lm reads files
of models without one): the keys and values of the prompt's last `window - 1` slots, all that a
later token sees, then the prompt's length.

Ours beside mlx-lm's metadata: the format, the prompt's token ids, the model's `model_type`,
a digest of its config and parameter shapes (`architecture`), one of the leading values of
every parameter (`weights`: a fine-tune of the same architecture differs there), the compute
dtype, and a hybrid's `base`. A mismatch of any is a one-line ValueError naming it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..atomic import check_space, check_writable, install_file, staging_folder
from ..cache import KVCache
from ..models.base import CausalLM
from ..state_cache import ROWS, HybridCache

FORMAT = "mlx_speculate.prompt_cache/1"
# Entry classes (mlx-lm's name for the first)
ATTENTION, RECURRENT, SLIDING = "KVCache", "RecurrentState", "SlidingKVCache"
_LEADING = 16  # values of each parameter the weights digest reads
_MAX_HEADER = 1 << 28  # a safetensors header longer than this is not one


@dataclass(frozen=True)
class PromptCache:
    """A cache that holds exactly `tokens` (its offset is their number)."""

    tokens: tuple[int, ...]
    cache: KVCache
    model: str = ""  # what the model was loaded from (mlx-lm's `model`); "" when unknown


def save_prompt_cache(path: str | Path, model: CausalLM, prompt: PromptCache) -> None:
    """Writes `prompt` (made with `model`) to `path` atomically: a reader sees the old file or
    the whole new one. OSError when `path` cannot be written, ValueError for an empty cache."""
    path = Path(path)
    cache, tokens = prompt.cache, [int(t) for t in prompt.tokens]
    if cache.offset == 0 or cache.offset != len(tokens):
        raise ValueError(
            f"a prompt cache must hold its {len(tokens)} prompt tokens, it holds {cache.offset}"
        )
    classes, arrays = _entries(cache)
    mx.eval(list(arrays.values()))
    architecture, weights = identity(model)
    metadata = {
        "model": prompt.model,
        "tokenizer_config": "{}",
        "format": FORMAT,
        "model_type": model.args.model_type,
        "architecture": architecture,
        "weights": weights,
        "dtype": _dtype_name(model.compute_dtype),
        "tokens": json.dumps(tokens),
    }
    if isinstance(cache, HybridCache):
        metadata["base"] = str(int(cache.base.item()))
    flat = {f"0.{k}": v for k, v in metadata.items()}
    flat |= {f"1.{i}": c for i, c in enumerate(classes)}
    # mlx-lm's scalar list: "" first, then (array name, "scalar") per attention offset
    scalars = [name for name, a in arrays.items() if name.endswith(".2")]
    flat["2.0"] = ""
    for i, name in enumerate(scalars, 1):
        flat[f"2.{i}.0"], flat[f"2.{i}.1"] = name, "scalar"
    check_writable(path)
    check_space(next(p for p in path.parents if p.exists()), sum(a.nbytes for a in arrays.values()))
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = staging_folder(path)
    try:
        staged = folder / "cache.safetensors"  # MLX adds the suffix to a name without it
        mx.save_safetensors(str(staged), arrays, flat)
        install_file(staged, path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def read_metadata(path: str | Path) -> dict[str, str]:
    """The metadata strings of a prompt-cache file (its `"0.{key}"` entries), read from its
    header alone: FileNotFoundError when it is missing, ValueError when it is not one."""
    return _header(Path(path))[0]


def _header(path: Path) -> tuple[dict[str, str], list[str]]:
    """The file's metadata and its entries' classes, from the safetensors header."""
    if not path.is_file():
        raise FileNotFoundError(
            f"prompt-cache file {path} does not exist"
            + (" (it is a folder)" if path.is_dir() else "")
        )
    with path.open("rb") as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        text = f.read(size) if 0 < size < _MAX_HEADER else b""
    try:
        header = json.loads(text) if text and len(text) == size else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a prompt-cache file (no safetensors header)")
    flat = header.get("__metadata__") or {}
    metadata = {k[2:]: v for k, v in flat.items() if k.startswith("0.")}
    if metadata.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not a prompt-cache file of mlx_speculate (format {FORMAT}); make one "
            "with python -m mlx_speculate.cache_prompt"
        )
    count = sum(k.startswith("1.") for k in flat)
    return metadata, [flat.get(f"1.{i}", "") for i in range(count)]


def load_prompt_cache(path: str | Path, model: CausalLM) -> PromptCache:
    """The prompt cache in `path`, in a fresh cache of `model`: ValueError on one line when the
    file was made with another model, other weights or another compute dtype, or is corrupt
    (truncated, altered); FileNotFoundError when it is missing."""
    path = Path(path)
    metadata, classes = _header(path)
    _check_model(path, metadata, model)
    try:
        arrays = mx.load(str(path), format="safetensors")
        mx.eval(list(arrays.values()))
        tokens = json.loads(metadata["tokens"])
        base = int(metadata.get("base", "0"))
    except (RuntimeError, ValueError, KeyError) as e:
        raise ValueError(f"{path} is a corrupt prompt-cache file ({_first_line(e)})") from None
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and 0 <= t < model.args.vocab_size for t in tokens
    ):
        raise ValueError(f"{path} is a corrupt prompt-cache file (its prompt tokens)")
    cache = model.make_cache()
    try:
        _fill(cache, classes, arrays, len(tokens), base)
    except (ValueError, KeyError) as e:
        raise ValueError(f"{path} is a corrupt prompt-cache file ({_first_line(e)})") from None
    return PromptCache(tuple(tokens), cache, metadata.get("model", ""))


def identity(model: CausalLM) -> tuple[str, str]:
    """Digests of `model`'s architecture (its config, parameter names and shapes) and of its
    weights (the first values of every parameter, as stored: in the compute dtype)."""
    params = sorted(tree_flatten(model.parameters()), key=lambda p: p[0])
    config = dataclasses.asdict(model.args)
    shapes = [(name, list(p.shape)) for name, p in params]
    text = json.dumps([config, shapes], sort_keys=True, default=str)
    architecture = hashlib.sha256(text.encode()).hexdigest()
    leading = [mx.view(p.reshape(-1)[:_LEADING], mx.uint8) for _, p in params]
    data = np.array(mx.concatenate(leading)) if leading else np.zeros(0, np.uint8)
    return architecture, hashlib.sha256(data.tobytes()).hexdigest()


def _check_model(path: Path, metadata: dict[str, str], model: CausalLM) -> None:
    made = f"{path} was made with"
    model_type = model.args.model_type
    if metadata.get("model_type") != model_type:
        raise ValueError(f"{made} a {metadata.get('model_type')} model, not this {model_type} one")
    architecture, weights = identity(model)
    if metadata.get("architecture") != architecture:
        raise ValueError(f"{made} another {model_type} model (its config or shapes differ)")
    dtype = _dtype_name(model.compute_dtype)
    if metadata.get("dtype") != dtype:
        raise ValueError(
            f"{made} the model computing in {metadata.get('dtype')}, not {dtype} "
            f"(--dtype {metadata.get('dtype')})"
        )
    if metadata.get("weights") != weights:
        raise ValueError(f"{made} other weights of this {model_type} architecture")


def _entries(cache: KVCache) -> tuple[list[str], dict[str, mx.array]]:
    """Each entry's class and the arrays of all, by mlx-lm's `"{entry}.{i}"` names."""
    n = cache.offset
    kinds = cache.linear if isinstance(cache, HybridCache) else (False,) * len(cache.keys)
    classes, arrays = [], {}
    attention = recurrent = 0
    for entry, linear in enumerate(kinds):
        if linear:
            first, second = cache.conv[recurrent], cache.ring[recurrent]
            recurrent += 1
        else:
            keys, values = cache.keys[attention], cache.values[attention]
            sliding = cache.rings[attention] is not None
            first = None if keys is None else _slots(cache, attention, keys, n)
            second = None if values is None else _slots(cache, attention, values, n)
            attention += 1
        if first is None or second is None:
            raise ValueError(f"layer {entry} of the cache holds nothing: prefill the prompt first")
        classes.append(RECURRENT if linear else SLIDING if sliding else ATTENTION)
        arrays[f"{entry}.0"], arrays[f"{entry}.1"] = first, second
        if not linear:
            arrays[f"{entry}.2"] = mx.array(n)  # mlx-lm's KVCache state ends with its offset
    return classes, arrays


def _kept(cache: KVCache, layer: int, n: int) -> int:
    """How many of a prompt's last slots of `n` the file holds for `layer`: all, or a ring's
    window - 1 (what the next token sees)."""
    return n if cache.rings[layer] is None else min(n, cache.window - 1)


def _slots(cache: KVCache, layer: int, array: mx.array, n: int) -> mx.array:
    """`layer`'s keys or values of the prompt's last `_kept` slots, in slot order."""
    m = _kept(cache, layer, n)
    if cache.rings[layer] is None or array.shape[2] < cache.rings[layer]:
        return array[..., n - m : n, :]
    return mx.take(array, mx.remainder(mx.arange(n - m, n), cache.rings[layer]), axis=2)


def _fill(
    cache: KVCache, classes: Sequence[str], arrays: dict[str, mx.array], n: int, base: int
) -> None:
    """Puts the file's entries into `cache` (fresh from `make_cache`), checking each array's
    shape and dtype against what the model writes; then its offset is `n`."""
    hybrid = isinstance(cache, HybridCache)
    kinds = cache.linear if hybrid else (False,) * len(cache.keys)
    rings = iter(cache.rings)
    expected = [RECURRENT if linear else SLIDING if next(rings) else ATTENTION for linear in kinds]
    if list(classes) != expected or len(arrays) != 3 * len(expected) - sum(kinds):
        raise ValueError(f"{len(classes)} cache entries, the model has {len(expected)} layers")
    likes = [cache.like] * len(cache.keys) if hybrid else cache.likes
    rows = 0
    attention = recurrent = 0
    for entry, linear in enumerate(kinds):
        first, second = arrays[f"{entry}.0"], arrays[f"{entry}.1"]
        if linear:
            s = cache.shape
            rows = second.shape[0] - 1
            _expect(entry, second, (rows + 1, 1, s.heads, s.key_dim, s.value_dim), mx.float32)
            _expect(entry, first, (1, s.kernel - 1 + rows, s.channels), cache.like.dtype)
            if not 0 <= rows <= ROWS or not base <= n <= base + rows:
                raise ValueError(f"layer {entry}'s recurrent state is not at the prompt's end")
            cache.conv[recurrent], cache.ring[recurrent] = first, second
            recurrent += 1
        else:
            like = likes[attention]
            if (slots := arrays[f"{entry}.2"].item()) != n:
                raise ValueError(f"entry {entry} holds {slots} slots, not {n}")
            m = _kept(cache, attention, n)
            shape = (1, like.shape[1], m, like.shape[3])
            _expect(entry, first, shape, like.dtype)
            _expect(entry, second, shape, like.dtype)
            cache.reserve(n)
            at = mx.array(n - m, mx.int32)
            cache.write(entry if hybrid else attention, first, second, at, None)
            attention += 1
    if hybrid:
        cache.as_after(base, rows, n)
    else:
        cache.advance(n)


def _expect(entry: int, array: mx.array, shape: tuple[int, ...], dtype: mx.Dtype) -> None:
    if tuple(array.shape) != shape or array.dtype != dtype:
        raise ValueError(
            f"entry {entry} holds a {array.dtype} array of shape {tuple(array.shape)}, the model "
            f"a {dtype} one of shape {shape}"
        )


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def _first_line(error: BaseException) -> str:
    return " ".join(str(error).split())
