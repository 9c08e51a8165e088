"""The language model of `mistral3` folders (HF `Mistral3ForConditionalGeneration`: Ministral 3,
Mistral Small 3.1 / 3.2): its `text_config` is a `ministral3` or a `mistral` model, its
weights under `model.language_model.` (transformers >= 4.52) or `language_model.model.` names
beside a vision tower and projector this package does not run.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .base import CausalLM
from .ministral3 import Model as Ministral3Model
from .ministral3 import ModelArgs as Ministral3Args
from .mistral import Model as MistralModel
from .mistral import ModelArgs as MistralArgs
from .rope import rope_both_forms
from .wrapper import text_config, under_language_model, unwrap

_TEXT = {"mistral": MistralArgs, "ministral3": Ministral3Args}
# Checkpoint prefixes of the language model (transformers, then older transformers and
# mlx-community) and the parts of these folders that are not text.
_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_NOT_TEXT = ("vision_tower", "multi_modal_projector", "model.vision_tower", "model.multi_modal")


def text_family(config: dict[str, Any]) -> type[MistralArgs]:
    """The arguments of a `mistral3` config's text model (transformers' default: mistral)."""
    kind = (config.get("text_config") or {}).get("model_type", "mistral")
    if kind not in _TEXT:
        raise ValueError(
            f"mistral3 text_config model_type {kind!r} is not supported "
            f"(supported: {', '.join(_TEXT)})"
        )
    return _TEXT[kind]


class ModelArgs:
    """Reads a `mistral3` config as its text model's arguments (model_type `mistral3`; the
    text config's tied-embeddings setting, else the folder's)."""

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> MistralArgs:
        return text_family(config).from_dict(text_config(config))


class _Folder(CausalLM):
    """A `mistral3` folder's names around the text model of the concrete class's family."""

    def rename(self, name: str) -> str | None:
        name = unwrap(name, _PREFIXES, _NOT_TEXT)
        return None if name is None else super().rename(name)

    def mlx_lm_layout(
        self, config: dict[str, Any], weights: dict[str, mx.array]
    ) -> tuple[dict[str, Any], dict[str, mx.array]]:
        """What mlx-lm's `mistral3` reads: the text config as the text family writes it (with
        legacy rope keys, which its `llama` reads for a `mistral` text model) and the
        language model's names and per-module quantization under `language_model.`."""
        text = rope_both_forms({**(config.get("text_config") or {})})
        text, _ = super().mlx_lm_layout(text, {})
        return under_language_model({**config, "text_config": text}, weights)


class MistralText(_Folder, MistralModel):
    pass


class Ministral3Text(_Folder, Ministral3Model):
    pass


def Model(args: MistralArgs) -> CausalLM:  # noqa: N802 (the families' constructor name)
    """The text model of the folder's family, under the folder's names."""
    return Ministral3Text(args) if isinstance(args, Ministral3Args) else MistralText(args)
