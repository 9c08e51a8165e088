"""Draft heads that read the target's own hidden states: Medusa (`medusa.py`).

Each module holds one head family: its MLX module in the official parameter names, the
published checkpoint formats, and conversion to the MLX heads folder written beside a converted
model. Weights are read by `checkpoint.read_weights` and loaded by `checkpoint.load_into`, as
models are.
"""
