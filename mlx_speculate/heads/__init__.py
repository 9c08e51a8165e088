"""Draft heads that read the target's own hidden states, one family behind one protocol
(`base.DraftHead`): EAGLE-1 and EAGLE-3 (`eagle.py`, checkpoints in `eagle_format.py`) and
Medusa (`medusa.py`); the MTP head that Qwen3-Next and Qwen3.5 checkpoints carry (`mtp.py`,
read from the model's own folder); and Gemma 4's assistant drafters, which read the target's
keys (`gemma4_assistant.py`).

Each head module holds its MLX module in the official parameter names; the format modules read
and write the published checkpoint layouts and the MLX heads folder written beside a converted
model. Weights are read by `checkpoint.read_weights` and loaded by `checkpoint.load_into`, as
models are.
"""
