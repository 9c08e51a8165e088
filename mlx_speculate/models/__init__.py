"""Model families by HF `model_type`."""

from . import (
    gemma2,
    gemma3,
    gemma4,
    gpt_oss,
    llama,
    ministral3,
    mistral,
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
    "ministral3": ministral3,
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
