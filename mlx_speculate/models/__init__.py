"""Model families by HF `model_type`."""

from . import llama, phi3, qwen2

MODEL_TYPES = {"llama": llama, "qwen2": qwen2, "phi3": phi3}
