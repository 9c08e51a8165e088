"""Decoding on every rank of an `mx.distributed` group (what `mlx.launch` starts), the target
split over them (sharding.py).

Decoding runs unchanged on every rank: drafters, acceptance and sampling run identically
everywhere, from the same seed and the same all-summed logits, so their decisions agree without
being sent. Two things are not deterministic by themselves and are taken from rank 0: the
sampling seed when none is given (`shared_seed`) and the adaptive draft length, which follows
measured timings (`SharedPolicy`, one scalar all-sum per step). Only rank 0 prints.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import cli
from ..device import GENERATION_STREAM
from ..policy.adaptive import Policy
from .ranks import DEFAULT_TIMEOUT, check_same_model, drafter_digest
from .sharding import PARALLEL_MODES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every CLI that runs under `mlx.launch` takes (generate, server)."""
    parser.add_argument(
        "--parallel",
        choices=PARALLEL_MODES,
        default="tensor",
        help="under mlx.launch: how the target is split across ranks (default: tensor)",
    )
    parser.add_argument(
        "--rank-timeout",
        type=cli.bounded(float, lambda v: v > 0, "a positive number of seconds"),
        default=DEFAULT_TIMEOUT,
        help="under mlx.launch: end with an error when no step finishes in this many seconds "
        f"(a rank died or hangs; default {DEFAULT_TIMEOUT:g})",
    )


def init_group() -> mx.distributed.Group | None:
    """The group `mlx.launch` set up, or None when this process runs alone."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def from_rank0(value: int, group: mx.distributed.Group) -> int:
    """Rank 0's int32 `value` on every rank (one scalar all-sum). It runs on the generation
    stream, after the step queued there: that step's own collectives must meet the other
    ranks' in the same order, which a second stream would race."""
    mine = mx.array(value if group.rank() == 0 else 0, mx.int32)
    return int(mx.distributed.all_sum(mine, group=group, stream=GENERATION_STREAM).item())


def shared_seed(seed: int | None, group: mx.distributed.Group) -> int:
    """`seed`, or one rank 0 drew: every rank must sample with the same one."""
    if seed is not None:
        return seed
    return from_rank0(int(np.random.default_rng().integers(2**31)), group)


def rank0_says(flag: bool, group: mx.distributed.Group) -> bool:
    """Rank 0's `flag` on every rank: calibrating a sharded target times its forwards, and
    every choice that follows a timing must be the same on all ranks (they run the forwards
    together)."""
    return bool(from_rank0(int(flag), group))


class SharedPolicy:
    """A draft-length policy whose choice is rank 0's: the adaptive policy times each step, and
    ranks that drafted different lengths would run forwards of different shapes."""

    def __init__(self, policy: Policy, group: mx.distributed.Group):
        self.policy = policy
        self.group = group

    def choose(self) -> int:
        return from_rank0(self.policy.choose() if self.group.rank() == 0 else 0, self.group)

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        self.policy.observe(drafted, accepted, seconds)


def shared_spec(spec, model: nn.Module, group: mx.distributed.Group):
    """`spec` resolved (its draft model or heads loaded), checked to be the same on every
    rank: ValueError naming the ranks otherwise (they would draft different tokens)."""
    spec = spec.resolve(model)
    check_same_model(drafter_digest(spec), group, "drafter")
    return spec


def shared_policy(drafter, model: nn.Module, num_draft_tokens: int | None, group) -> Policy:
    """The draft-length policy of `default_policy`, calibrated and chosen by rank 0 when a
    `group` is given (every rank then drafts the same lengths)."""
    from ..policy.measure import default_policy

    if group is None:
        return default_policy(drafter, model, num_draft_tokens)
    costs = default_policy(drafter, model, num_draft_tokens, lambda b: rank0_says(b, group))
    return SharedPolicy(costs, group)


def decoding_options(model, tokenizer, spec, group: mx.distributed.Group) -> dict:
    """stream_generate's `drafter`, `policy` (and `typical_acceptance`) for a sharded target:
    the drafter built here so that its policy can be wrapped in a SharedPolicy."""
    if spec is None:
        return {"drafter": None}
    from ..drafters import make_drafter

    spec = shared_spec(spec, model, group)
    drafter = make_drafter(spec, model, tokenizer)
    policy = shared_policy(drafter, model, spec.num_draft_tokens, group)
    return {"drafter": drafter, "policy": policy, "typical_acceptance": spec.typical_acceptance}
