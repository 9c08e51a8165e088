"""Many generations over one model at once: continuous batching with speculation per sequence.

    from mlx_speculate import load
    from mlx_speculate.batch import batch_generate

    model, tokenizer = load("path/to/model")
    result = batch_generate(model, tokenizer, ["Once upon a time", "The sea"], max_tokens=64,
                            prompt_lookup=True)
    print(result.texts)

`batch_generate` is mlx-lm's call of that name with the speculative methods and sampling
settings of `stream_generate`; the server runs the same engine (engine.py) under its requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import arguments
from ..chat import plain_tokens
from ..drafters import DrafterSpec, make_drafter, spec_from_keywords
from ..generation import Session, SpeculativeStats, split_options
from ..models.base import CausalLM
from ..sampling import SamplingParams
from .engine import BatchEngine, Handle, batch_stream, check_batchable

__all__ = ["BatchEngine", "BatchResponse", "Handle", "batch_generate", "check_batchable"]


@dataclass(frozen=True)
class BatchResponse:
    """What each prompt got, in the prompts' order."""

    texts: list[str]
    tokens: list[list[int]]  # emitted token ids (an EOS that ended one is not emitted)
    finish_reasons: list[str]  # "stop", "length" or "context"
    stats: list[SpeculativeStats]


def batch_generate(
    model: CausalLM,
    tokenizer,
    prompts: Sequence[str | Sequence[int]],
    *,
    max_tokens: int = 256,
    sampling: SamplingParams | None = None,
    stop: Sequence[str] = (),
    drafter: DrafterSpec | None = None,
    max_batch: int = 32,
    max_kv_size: int | None = None,
    **options: Any,
) -> BatchResponse:
    """Generates for every prompt, up to `max_batch` at once in one forward per step, each as
    `stream_generate` would alone (greedy: the same tokens; sampled: the same distribution).
    `drafter` (a method's spec) or the method keywords of `stream_generate` (`prompt_lookup=True`,
    `draft_model=...`, `eagle=...`, ...) give every prompt its own drafter of that method.
    `max_kv_size` bounds each context as in `stream_generate` (the batch keeps a float cache:
    no `kv_bits`)."""
    arguments.check_max_tokens(max_tokens)
    stop = arguments.check_stop(stop)
    for prompt in prompts:
        arguments.check_prompt(prompt)
    sampling, keywords = split_options(options, sampling)
    if keywords:
        if drafter is not None:
            raise ValueError(f"give drafter or {', '.join(keywords)}, not both")
        drafter = spec_from_keywords(**keywords)
    spec = None if drafter is None else drafter.resolve(model)  # read from disk once
    engine = BatchEngine(model, max_batch)
    handles = []
    for prompt in prompts:
        tokens = plain_tokens(tokenizer, [prompt]) if isinstance(prompt, str) else list(prompt)
        draft = None if spec is None else make_drafter(spec, model, tokenizer)
        typical = spec is not None and spec.typical_acceptance
        session = Session(
            model, tokenizer, draft, typical_acceptance=typical, max_kv_size=max_kv_size
        )
        asked = None if spec is None else spec.num_draft_tokens
        handles.append(Handle(session, tokens, sampling, max_tokens, stop, num_draft_tokens=asked))
    texts: list[list[str]] = [[] for _ in prompts]
    emitted: list[list[int]] = [[] for _ in prompts]
    for i, response in batch_stream(engine, handles):
        texts[i].append(response.text)
        if response.generation_tokens > len(emitted[i]):
            emitted[i].append(response.token)
    return BatchResponse(
        ["".join(t) for t in texts],
        emitted,
        [h.last.finish_reason for h in handles],
        [h.last.stats for h in handles],
    )
