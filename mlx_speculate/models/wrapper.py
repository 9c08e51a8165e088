"""The language model of a multimodal folder (Gemma 3 and 4, Mistral 3, Qwen3.5): its text
config, the checkpoint prefixes its weights sit under beside parts that are not text, and
mlx-lm's layout of such a folder (the language model under `language_model.`).

The families each name their own prefixes; what they do with them is one rule, kept here.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """A wrapper's `text_config` (with its model_type, and the top-level tied-embeddings
    setting when the text config has none); a text config as it is."""
    if "text_config" not in config:
        return config
    text = dict(config["text_config"] or {})
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in config:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return {**text, "model_type": config.get("model_type")}


def unwrap(
    name: str, prefixes: tuple[tuple[str, str], ...], not_text: tuple[str, ...]
) -> str | None:
    """A wrapper checkpoint's parameter or module path in the language model's names: the
    first (old, new) of `prefixes` that it starts with (or whose module it names) replaced;
    None for a part that is not text (it starts with one of `not_text`)."""
    for old, new in prefixes:
        if name.startswith(old) or name == old[:-1]:  # a parameter, or a module path
            name = (new + name[len(old) :]).rstrip(".")
            break
    return None if name.startswith(not_text) else name


def under_language_model(
    config: dict[str, Any], weights: dict[str, mx.array]
) -> tuple[dict[str, Any], dict[str, mx.array]]:
    """`config` and `weights` as mlx-lm's wrapper models read them: the weights and the
    per-module quantization overrides (dict or bool entries) under `language_model.`."""
    config = dict(config)
    for key in ("quantization", "quantization_config"):
        if isinstance(config.get(key), dict):
            config[key] = {
                (f"language_model.{k}" if isinstance(v, dict | bool) else k): v
                for k, v in config[key].items()
            }
    return config, {f"language_model.{k}": v for k, v in weights.items()}
