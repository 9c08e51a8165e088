"""What a head is trained with: `Recipe` and `TrainConfig`, the defaults of each kind.

Plain data, importable without MLX: the CLI builds its flags from these fields (options.py)
before it loads anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..cli import bounded, non_negative_int
from .options import option

share = bounded(float, lambda v: 0 <= v < 1, "in [0, 1)")
# The layouts heads/eagle_format.save_official writes (its LAYOUTS; a test keeps them equal),
# named here so that reading the settings imports no MLX.
LAYOUTS = ("official", "speculators")


@dataclass(frozen=True)
class TrainConfig:
    """How a head trains; each field is a flag of `python -m mlx_speculate.train` (options.py)."""

    epochs: int = option(10, "passes over the data at most")
    learning_rate: float = option(
        1e-3, "AdamW's peak learning rate, after warmup, then cosine decay", flag="--lr"
    )
    warmup: int = option(50, "steps of linear warmup", type=non_negative_int)
    weight_decay: float = option(0.0, "AdamW's weight decay")
    clip: float = option(0.5, "the gradient norm steps are clipped to")
    # About one conversation a step, as the official trainer's batch of 1.
    batch_tokens: int = option(256, "padded tokens a training step")
    holdout: float = option(
        0.05, "share of conversations held out to measure top-1 accuracy", type=share
    )
    patience: int = option(2, "epochs without a better held-out accuracy before stopping")
    save_every: int = option(100, "steps between checkpoints")
    seed: int = option(
        0, "the split, the shuffles, the initialisation and the noise", type=non_negative_int
    )
    max_steps: int | None = option(None, "stop after this many steps in all, with a checkpoint")

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_tokens < 1 or not 0 <= self.holdout < 1:
            raise ValueError(
                f"need epochs >= 1, batch_tokens >= 1 and holdout in [0, 1), got {self.epochs}, "
                f"{self.batch_tokens}, {self.holdout}"
            )


KINDS = ("eagle1", "eagle3", "medusa", "dflash")
DRAFT_VOCAB = 32000  # EAGLE-3's default draft vocabulary, or the whole one where smaller
# A kind's training settings where they differ from TrainConfig's. DFlash: the recipe that
# made a stories260K drafter pay (docs/results.md); TrainConfig's trained it to a drafter
# slower than plain decoding. A drafter starts from nothing but the target's embedding and
# lm_head, and larger batches at a higher rate learn it in fewer, cheaper steps.
TRAINING: dict[str, dict[str, Any]] = {
    "dflash": {"epochs": 8, "learning_rate": 3e-3, "batch_tokens": 1024},
}
EAGLE, DFLASH, MEDUSA = ("eagle1", "eagle3"), ("dflash",), ("medusa",)
EAGLE_DEPTH = 7  # the drafts of an EAGLE chain as deep as its default tree (EagleGrowth.depth)


def default_training(kind: str) -> TrainConfig:
    """TrainConfig with `kind`'s own defaults (TRAINING)."""
    return TrainConfig(**TRAINING.get(kind, {}))


@dataclass(frozen=True)
class Recipe:
    """Everything a head is trained with; each field but `kind` and `train` is a flag of
    `python -m mlx_speculate.train` (options.py). `train` None: the kind's defaults
    (`default_training`)."""

    kind: str
    max_tokens: int = option(200, "answer length")
    temperature: float = option(0.0, "the target's answers: 0 greedy, else sampled")
    self_samples: int = option(
        0, "train on N samples from BOS (models without a chat template)", type=non_negative_int
    )
    sample_prefix: int = option(
        16, "self samples: tokens drawn at T=1 before answering", type=non_negative_int
    )
    data_batch: int = option(
        16, "prompts answered together (32 is faster; self samples depend on it)"
    )
    top_k: int = option(16, "target logits kept a token, the distribution the losses match")
    draft_vocab: int | None = option(
        None,
        "EAGLE-3: the most frequent answer tokens the head predicts, at most the target's "
        "vocabulary",
        kinds=("eagle3",),
        shown=f"{DRAFT_VOCAB}, or the whole vocabulary where smaller",
    )
    taps: tuple[int, ...] | None = option(
        None,
        "EAGLE-3: the target layers whose input states it reads; DFlash: the layers whose "
        "outputs it reads",
        kinds=("eagle3", "dflash"),
        shown="EAGLE-3: 2, L//2 and L-3, a shallow target's last three; DFlash: "
        "max(2, draft layers) layers spread from 1 to L-2",
    )
    ttt_steps: int = option(
        7, "EAGLE-3: draft steps unrolled in training (training-time test)", kinds=("eagle3",)
    )
    intermediate_size: int | None = option(
        None,
        "EAGLE, DFlash: the draft layers' MLP width",
        kinds=EAGLE + DFLASH,
        shown="the target's",
    )
    medusa_heads: int = option(4, "Medusa: heads, one per future token", kinds=MEDUSA)
    medusa_layers: int = option(1, "Medusa: residual blocks a head", kinds=MEDUSA)
    block_size: int = option(8, "DFlash: tokens a block, the verified one included", kinds=DFLASH)
    draft_layers: int = option(1, "DFlash: the drafter's decoder layers", kinds=DFLASH)
    anchors: int = option(
        512,
        "DFlash: blocks a conversation a step at most, anchored at random answer tokens "
        "(SpecForge's num_anchors)",
        kinds=DFLASH,
    )
    layout: str = option(
        "official",
        "EAGLE: SafeAILab's keys, or vllm-project/speculators' (EAGLE-3 only)",
        kinds=EAGLE,
        choices=LAYOUTS,
    )
    train: TrainConfig | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"head kind {self.kind!r} is unknown (known: {', '.join(KINDS)})")
        if self.train is None:
            object.__setattr__(self, "train", default_training(self.kind))
        width = 1 if self.intermediate_size is None else self.intermediate_size
        draft = 1 if self.draft_vocab is None else self.draft_vocab
        sizes = (self.max_tokens, self.top_k, draft, self.ttt_steps, self.data_batch, width)
        if min(*sizes, self.draft_layers, self.anchors) < 1:
            raise ValueError(
                "max_tokens, top_k, draft_vocab, ttt_steps, data_batch, intermediate_size, "
                "draft_layers and anchors must be >= 1"
            )
        if self.block_size < 2:
            raise ValueError(f"DFlash block_size must be >= 2, got {self.block_size}")
        if self.layout not in LAYOUTS or (self.layout == "speculators" and self.kind != "eagle3"):
            raise ValueError(
                f"layout {self.layout!r} is not one for {self.kind} heads "
                f"(EAGLE: {', '.join(LAYOUTS)}; speculators: eagle3 only)"
            )

    @property
    def drafts(self) -> int:
        """The tokens a step of this head drafts in a chain: a DFlash block's B - 1, a
        Medusa head each, EAGLE's default depth."""
        return {"dflash": self.block_size - 1, "medusa": self.medusa_heads}.get(
            self.kind, EAGLE_DEPTH
        )
