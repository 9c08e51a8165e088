"""Model types mlx-lm knows and this package does not implement: mlx-lm's own module
(`mlx_lm.models.<type>`, built and loaded by mlx-lm's `load_model`, its quantization included)
behind the `CausalLM` contract, for every method that reads only the target's logits.

An mlx-lm module returns logits and masks causally from its caches' offsets, so this path
verifies chains (contiguous positions, mlx_lm_cache.py rolls its caches back) and hands the
drafters no features: trees and the head methods (Medusa, EAGLE, DFlash, MTP, assistant) need
a family of this package (models/__init__.py), and say so in one line
(`models.needs_native`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from . import needs_native
from .base import CausalLM, ModelOutput
from .mlx_lm_cache import MlxLmCache, MlxLmState, trims

# A context for configs that name none (state-space models have no position limit).
DEFAULT_CONTEXT = 32768


def mlx_lm_class(config: dict[str, Any]) -> type[nn.Module] | None:
    """mlx-lm's model class for `config` (its own type remapping included), or None when
    mlx-lm has no module for the type."""
    from mlx_lm.utils import _get_classes

    try:
        return _get_classes(config)[0]
    except (ValueError, KeyError):  # mlx-lm's "not supported" (an import error inside)
        return None


@dataclass(frozen=True)
class MlxLmArgs:
    """What the loop and the methods read of a model's config."""

    model_type: str
    vocab_size: int
    max_position_embeddings: int
    num_hidden_layers: int

    @classmethod
    def from_config(cls, config: dict[str, Any], module: nn.Module) -> MlxLmArgs:
        """From config.json (a multimodal config's text part where the top level lacks a key)
        and the module: its layers, and the width of its logits where no vocabulary size is
        given (configs that nest it elsewhere)."""
        text = config.get("text_config") or {}

        def field(name: str, default: Any) -> Any:
            value = config.get(name, text.get(name, default))
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"config field {name!r} must be int, got {value!r}")
            return value

        vocab = config.get("vocab_size", text.get("vocab_size"))
        if vocab is None:
            vocab = module(mx.array([[0]])).shape[-1]
        return cls(
            config["model_type"],
            field("vocab_size", vocab),
            field("max_position_embeddings", DEFAULT_CONTEXT),
            len(module.layers),
        )


class MlxLmModel(CausalLM):
    """An mlx-lm module (`module`) behind the forward contract. Its `hidden` is the logits
    (whatever a family does after its final norm, soft-capping or scaling, is inside mlx-lm's
    forward), so `project` is the identity; it takes no `positions`, `mask` or `taps`."""

    implementation: ClassVar[str] = "mlx-lm"

    def __init__(self, module: nn.Module, args: MlxLmArgs):
        nn.Module.__init__(self)
        self.module = module
        self.args = args
        # Whether some layer's cache rolls back by a copy and a replay (mlx_lm_cache.py).
        self._replays = not all(trims(c) for c in make_prompt_cache(module))

    def __call__(
        self,
        tokens: mx.array,
        cache: MlxLmCache | None = None,
        *,
        positions: mx.array | None = None,
        mask: mx.array | None = None,
        taps: tuple[int, ...] = (),
    ) -> ModelOutput:
        if taps:
            raise ValueError(needs_native("reading the target's hidden states", self.type))
        if positions is not None or mask is not None:
            raise ValueError(needs_native("a draft tree", self.type))
        if cache is None:
            logits = self.module(tokens)
        elif isinstance(cache, MlxLmCache):
            logits = cache.forward(tokens)
        else:
            raise ValueError(f"an mlx-lm {self.type} model takes its own cache (make_cache)")
        return ModelOutput(logits, logits)

    @property
    def type(self) -> str:
        return self.args.model_type

    def project(self, hidden: mx.array) -> mx.array:
        return hidden  # `hidden` is the logits already

    @property
    def layers(self) -> list[nn.Module]:
        return self.module.layers

    @property
    def recurrent(self) -> bool:  # type: ignore[override]
        return self._replays

    @property
    def traceable(self) -> bool:
        """Never: a forward reads its slot on the host, where mlx-lm's caches stand."""
        return False

    @property
    def compute_dtype(self) -> mx.Dtype:
        """The dtype of its first floating-point parameter (a quantized layer's scales)."""
        params = tree_flatten(self.module.parameters())
        return next(v.dtype for _, v in params if mx.issubdtype(v.dtype, mx.floating))

    def make_cache(self) -> MlxLmCache:
        state = MlxLmState(self.module, lambda: make_prompt_cache(self.module))
        return MlxLmCache(state, self.type)

    def kv_shapes(self) -> list[tuple[int, int]]:
        raise ValueError(f"{self.type} runs through mlx-lm, whose caches are its own")


def load_mlx_lm(path: Path, config: dict[str, Any], dtype: mx.Dtype | None) -> MlxLmModel:
    """mlx-lm's model for the folder `path` (quantized or not), every floating-point tensor
    cast to `dtype` (None: as stored); ValueError in one line where mlx-lm cannot build it."""
    from mlx_lm.utils import load_model

    try:
        module, _ = load_model(path, lazy=True)  # read once cast, not before
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # its config or weights
        reason = " ".join(str(e).split())
        raise ValueError(
            f"mlx-lm cannot load the {config.get('model_type')} model in {path}: {reason}"
        ) from e
    if dtype is not None:
        module.set_dtype(dtype)
    mx.eval(module.parameters())
    return MlxLmModel(module, MlxLmArgs.from_config(config, module))
