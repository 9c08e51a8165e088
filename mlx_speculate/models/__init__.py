"""Model families by HF `model_type`."""

from . import (
    gemma2,
    gemma3,
    gemma4,
    gpt_oss,
    llama,
    ministral,
    ministral3,
    mistral,
    mistral3,
    phi3,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)

MODEL_TYPES = {
    "llama": llama,
    "mistral": mistral,
    "ministral": ministral,
    "ministral3": ministral3,
    "mistral3": mistral3,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "qwen3_moe": qwen3_moe,
    "phi3": phi3,
    "gemma2": gemma2,
    "gemma3_text": gemma3,
    "gemma3": gemma3,
    "gemma4_text": gemma4,
    "gemma4": gemma4,
    "gpt_oss": gpt_oss,
    "qwen3_next": qwen3_next,
    "qwen3_5_text": qwen3_5,
    "qwen3_5": qwen3_5,
    "qwen3_5_moe_text": qwen3_5_moe,
    "qwen3_5_moe": qwen3_5_moe,
}


def needs_native(what: str, model_type: str) -> str:
    """The one-line refusal of a tree or a head method (`what`) on a model that runs through
    mlx-lm, naming the types this package implements."""
    return (
        f"{what} needs a model type this package implements ({', '.join(MODEL_TYPES)}); "
        f"{model_type} runs through mlx-lm's module, which verifies chains from the target's "
        "logits only: use a draft model (--draft-model) or prompt lookup (--prompt-lookup, "
        "--lookup-branches 1)"
    )
