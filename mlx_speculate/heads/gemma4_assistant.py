"""Gemma 4 assistant drafters (transformers' `Gemma4AssistantForCausalLM`, model_type
`gemma4_assistant`) in transformers' parameter names, and reading them from a folder.

An assistant is a few Gemma 4 decoder layers (`text_config`, a `gemma4_text` config) that make
no keys or values: each layer's queries attend to the TARGET's keys and values of its type, those
of the target's last writing layer of that type (transformers' `shared_kv_states`). Its input
is the target's scaled embedding of a token concatenated with a state of the target's width
(`backbone_hidden_size`), projected down (`pre_projection`); its output, normed, gives the
logits (its own tied `model.embed_tokens`, or `lm_head`) and, projected back up
(`post_projection`), the state the next step reads in the target's place.

One query at a time, at the position of the token it reads: it sees the target's keys of every
earlier position (full-attention layers) or of the last `sliding_window` + 1 of them (sliding
layers: transformers builds that mask bidirectionally, |distance| <= window, then flips it).
No logit soft cap (the assistant's forward applies none).

With `use_ordered_embeddings` the logits are sparse: `masked_embedding.centroids` scores
`num_centroids` clusters of `vocab_size / num_centroids` tokens each (`token_ordering`, a
permutation of the vocabulary, row by cluster); the tokens of the `centroid_intermediate_top_k`
best clusters get their lm_head logits, every other token the smallest of those minus 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..checkpoint import load_into
from ..loading import load_config, load_weights
from ..models import gemma4
from ..models.base import CausalLM, attention, rotate
from ..models.context import ForwardContext, additive_mask
from ..models.rope import RotaryEmbedding

MODEL_TYPE = "gemma4_assistant"
SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' Gemma4AssistantConfig defaults.
_DEFAULTS = {
    "backbone_hidden_size": 1536,
    "use_ordered_embeddings": False,
    "num_centroids": 2048,
    "centroid_intermediate_top_k": 32,
    "tie_word_embeddings": True,
}
# What transformers' validate_architecture refuses in an assistant's text_config, with the
# value each must have.
_TEXT_FIXED = {
    "hidden_size_per_layer_input": 0,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
}


@dataclass(frozen=True)
class AssistantArgs:
    text: gemma4.ModelArgs  # its layers: sizes, layer types, window, ropes
    backbone_hidden_size: int  # the target's hidden size
    tie_word_embeddings: bool = True
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32

    @classmethod
    def from_dict(cls, config: dict[str, Any], where: str) -> AssistantArgs:
        """The settings of a transformers config.json; a one-line ValueError naming `where`
        for another model type or what this module cannot run."""
        model_type = config.get("model_type")
        if model_type != MODEL_TYPE:
            raise ValueError(
                f"{where} is not a Gemma 4 assistant (model_type {model_type!r}, expected "
                f"{MODEL_TYPE!r})"
            )
        if "quantization" in config or "quantization_config" in config:
            raise ValueError(
                f"{where} is quantized; Gemma 4 assistants are read from transformers' float "
                "checkpoints"
            )
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"{where} has no text_config (the assistant's Gemma 4 layers)")
        for name, value in _TEXT_FIXED.items():
            if text.get(name, value) not in (value, None):
                raise ValueError(
                    f"{where}: an assistant's text_config must have {name}={value!r}, got "
                    f"{text[name]!r}"
                )
        # Every layer reads the target's keys (here, not by in-model sharing) and none takes
        # per-layer inputs (transformers' Gemma4TextConfig would default them on).
        text = {"model_type": "gemma4_text", **text, "num_kv_shared_layers": 0}
        text |= {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}
        try:
            args = gemma4.ModelArgs.from_dict(text)
        except (TypeError, ValueError) as e:  # TypeError: a required size is absent
            raise ValueError(f"{where}: text_config: {e}") from None
        settings = {k: config.get(k, v) for k, v in _DEFAULTS.items()}
        for name, value in settings.items():
            if isinstance(_DEFAULTS[name], bool):
                fits, what = isinstance(value, bool), "true or false"
            else:
                fits = isinstance(value, int) and not isinstance(value, bool) and value > 0
                what = "a positive integer"
            if not fits:
                raise ValueError(f"{where}: {name} must be {what}, got {value!r}")
        result = cls(args, **settings)
        if result.use_ordered_embeddings:
            centroids, top_k = result.num_centroids, result.centroid_intermediate_top_k
            if args.vocab_size % centroids or top_k > centroids:
                raise ValueError(
                    f"{where}: {centroids} centroids must divide the vocabulary of "
                    f"{args.vocab_size}, and centroid_intermediate_top_k ({top_k}) be at most "
                    "their number"
                )
        return result


class SharedAttention(nn.Module):
    """Gemma 4 attention with queries only: the keys and values are the context's `kv` of
    the layer (the target's), in transformers' names (`q_proj`, `q_norm`, `o_proj`)."""

    def __init__(self, args: gemma4.ModelArgs, index: int, rope: RotaryEmbedding):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads, self.head_dim = args.kv_shape(index)
        dim, bias, size = args.hidden_size, args.attention_bias, self.head_dim
        self.q_proj = nn.Linear(dim, self.n_heads * size, bias=bias)
        self.q_norm = gemma4.RMSNorm(size, eps=args.rms_norm_eps)
        self.o_proj = nn.Linear(self.n_heads * size, dim, bias=bias)
        self._rope = rope

    def __call__(self, x: mx.array, ctx: ForwardContext, layer: int) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        (q,) = rotate(ctx, self._rope, q)  # (B, H, L, D)
        k, v = ctx.kv[layer]
        return self.o_proj(attention(ctx, layer, q, k, v, 1.0))


class AssistantModel(nn.Module):
    """transformers' `model.`: the layers, the final norm and (tied) the embedding table that
    scores the vocabulary (its input embeddings are never read: the target's are)."""

    def __init__(self, args: gemma4.ModelArgs, tied: bool):
        super().__init__()
        if tied:
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        ropes: dict[tuple[str, int], RotaryEmbedding] = {}
        self.layers = []
        for i, layer_type in enumerate(args.layer_types):
            size = args.kv_shape(i)[1]
            if (layer_type, size) not in ropes:
                params = args.layer_rope(layer_type)
                ropes[layer_type, size] = RotaryEmbedding(
                    size, params, args.max_position_embeddings
                )
            attn = SharedAttention(args, i, ropes[layer_type, size])
            self.layers.append(gemma4.TransformerBlock(args, i, attn))
        self.norm = gemma4.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.ropes = tuple(ropes.values())


class MaskedEmbedder(nn.Module):
    """transformers' `masked_embedding`: logits for the tokens of the best clusters only."""

    def __init__(self, args: AssistantArgs):
        super().__init__()
        text = args.text
        self.centroids = nn.Linear(text.hidden_size, args.num_centroids, bias=False)
        self.token_ordering = mx.zeros((text.vocab_size,), mx.int32)
        self._top_k = args.centroid_intermediate_top_k
        self._vocab = text.vocab_size

    def __call__(self, hidden: mx.array, rows) -> mx.array:
        """(..., hidden) -> (..., V) logits, `rows(ids)` giving lm_head's rows of `ids`. The
        floor is the smallest chosen logit of each row (transformers takes it over the whole
        batch; a chain step has one row)."""
        scores = self.centroids(hidden)  # (..., C)
        k = self._top_k
        best = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]  # (..., k) clusters
        clusters = self.token_ordering.reshape(scores.shape[-1], -1)  # (C, V / C)
        ids = clusters[best].reshape(*hidden.shape[:-1], -1)  # (..., k * V / C)
        picked = (rows(ids) @ hidden[..., None]).squeeze(-1)  # (..., k * V / C)
        floor = picked.min(axis=-1, keepdims=True) - 1
        logits = mx.broadcast_to(floor, (*hidden.shape[:-1], self._vocab))
        return mx.put_along_axis(logits, ids, picked, axis=-1)


class Gemma4Assistant(nn.Module):
    """The assistant in transformers' names: `model`, `pre_projection`, `post_projection`,
    `lm_head` (untied) and `masked_embedding` (ordered embeddings)."""

    def __init__(self, args: AssistantArgs):
        super().__init__()
        self.args = args
        text, backbone = args.text, args.backbone_hidden_size
        self.model = AssistantModel(text, args.tie_word_embeddings)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.pre_projection = nn.Linear(2 * backbone, text.hidden_size, bias=False)
        self.post_projection = nn.Linear(text.hidden_size, backbone, bias=False)
        if args.use_ordered_embeddings:
            self.masked_embedding = MaskedEmbedder(args)
        self._sliding = text.sliding_layers()

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(self.args.text.layer_types)

    @property
    def traceable(self) -> bool:
        """Whether a step's graph can be independent of the position (models/base.py)."""
        return not any(rope.depends_on_length for rope in self.model.ropes)

    def __call__(self, inputs: mx.array, ctx: ForwardContext) -> tuple[mx.array, mx.array]:
        """(B, L, 2 * backbone) [target's scaled embedding; state] -> (B, L, V) logits and
        the (B, L, backbone) state the next step reads."""
        x = self.pre_projection(inputs)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, ctx, i)
        out = self.model.norm(x)
        return self.logits(out), self.post_projection(out)

    def logits(self, out: mx.array) -> mx.array:
        if self.args.use_ordered_embeddings:
            return self.masked_embedding(out, self._rows)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(out)
        return self.lm_head(out)

    def _rows(self, ids: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens(ids)
        return self.lm_head.weight[ids]

    def context(
        self,
        position: mx.array,
        kv: dict[str, tuple[mx.array, mx.array]],
        seq_len: int,
    ) -> ForwardContext:
        """The context of one query at `position` (an int32 scalar) over the target's keys
        and values per layer type, (1, H_kv, S, D) by slot = position: full-attention layers
        see the slots before `position`, sliding ones the last `sliding_window` + 1 of
        them. `seq_len`: what length-dependent rope frequencies read."""
        span = next(iter(kv.values()))[0].shape[2]
        dtype = self.model.norm.weight.dtype
        slots = mx.arange(span, dtype=mx.int32)
        seen = slots < position
        near = seen & (slots >= position - 1 - self.args.text.sliding_window)
        full = additive_mask(seen, dtype).reshape(1, 1, 1, span)
        window = additive_mask(near, dtype).reshape(1, 1, 1, span)
        layers = {i: kv[t] for i, t in enumerate(self.layer_types)}
        return ForwardContext(
            None, position, None, None, seq_len, full, window, self._sliding, span, kv=layers
        )

    def check_fits(self, target: CausalLM) -> dict[str, int]:
        """Raises a one-line ValueError unless `target` is a whole Gemma 4 in this process
        whose width, vocabulary and keys this assistant reads; returns, per layer type of the
        assistant, the target layer whose keys and values its layers of that type read."""
        if not isinstance(target, gemma4.Model):
            raise ValueError(
                f"a Gemma 4 assistant drafts for Gemma 4 targets, not {target.args.model_type}"
            )
        args, text = target.args, self.args.text
        if self.args.backbone_hidden_size != args.hidden_size:
            raise ValueError(
                f"the Gemma 4 assistant reads states of width {self.args.backbone_hidden_size} "
                f"(backbone_hidden_size), the target's hidden size is {args.hidden_size}"
            )
        if text.vocab_size != args.vocab_size:
            raise ValueError(
                f"the Gemma 4 assistant predicts a vocabulary of {text.vocab_size}, the target's "
                f"is {args.vocab_size}"
            )
        sources = writers(args)
        if len(target.layers) != args.num_hidden_layers or any(
            target.layers[p].self_attn.n_kv_heads != args.kv_shape(p)[0] for p in sources.values()
        ):
            raise ValueError(
                "the Gemma 4 assistant reads the target's keys in this process; this target is "
                "split across processes"
            )
        for i, layer_type in enumerate(text.layer_types):
            if layer_type not in sources:
                raise ValueError(f"the target has no {layer_type} layer for the assistant to read")
            ours, theirs = text.kv_shape(i), args.kv_shape(sources[layer_type])
            if ours != theirs:
                raise ValueError(
                    f"the Gemma 4 assistant's layer {i} reads {ours[0]} key/value heads of size "
                    f"{ours[1]}; the target's {layer_type} keys have {theirs[0]} of size "
                    f"{theirs[1]}"
                )
        return {t: sources[t] for t in dict.fromkeys(text.layer_types)}

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """transformers' tensors in this module's names: the tied lm_head and an untied
        model's unread embedding table dropped, the token ordering as int32."""
        tied = self.args.tie_word_embeddings
        out = {}
        for name, value in weights.items():
            if (tied and name == "lm_head.weight") or (
                not tied and name == "model.embed_tokens.weight"
            ):
                continue
            if name == "masked_embedding.token_ordering":
                value = value.astype(mx.int32)
            out[name] = value
        return out


def writers(args: gemma4.ModelArgs) -> dict[str, int]:
    """Per layer type, the target's last layer of that type that writes its own keys: the
    one transformers returns in `shared_kv_states` (its kv_sharing_modes' "store")."""
    return {t: i for i, t in enumerate(args.layer_types) if args.kv_source(i) is None}


def load_assistant(folder: str | Path, target: CausalLM) -> Gemma4Assistant:
    """The assistant transformers saved in `folder` (config.json, model*.safetensors), checked
    to fit `target` and computing in its dtype; a one-line ValueError otherwise."""
    folder = Path(folder).expanduser()
    where = str(folder)
    args = AssistantArgs.from_dict(load_config(folder), where)
    assistant = Gemma4Assistant(args)
    assistant.check_fits(target)
    weights = assistant.sanitize(load_weights(folder))
    what = f"the Gemma 4 assistant at {where}"
    return load_into(assistant, weights, dtype=target.compute_dtype, what=what)
