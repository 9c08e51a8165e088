"""`stream_generate` / `generate` in mlx-lm's style: typed responses with speculative stats."""

from __future__ import annotations

import inspect
import time
from collections import abc
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import mlx.core as mx

from . import arguments
from .chat import plain_tokens
from .decode import Decoder
from .device import wired_limit
from .drafters import (
    Drafter,
    DrafterSpec,
    make_drafter,
    spec_from_keywords,
    speculative_keywords,
)
from .grammar import Grammar
from .grammar.constraint import Constraint
from .models.base import CausalLM
from .models.quantized_kv import DEFAULT_START, KVQuantization, kv_quantization
from .policy.adaptive import FixedPolicy, Policy
from .policy.measure import default_policy
from .prompt_cache import resume
from .sampling import SamplingParams
from .sequence import PrefillCancelled, Sequence, Step


@dataclass(frozen=True)
class SpeculativeStats:
    """What speculation did for one generation; every count is exact.

    The first token comes from the prompt's own forward; every later forward verifies a draft
    (or nothing) and yields at least one token, so `tokens_per_forward` is the papers' tau:
    accepted drafts + 1 per verify forward, at least 1 (a grammar's forced tokens add to it,
    and so does a forced ending, emitted without a forward).
    """

    drafted: int  # draft tokens proposed to the target (tree: nodes below the root)
    accepted: int  # of those, accepted and emitted (drafts cut off by a stop do not count)
    target_forwards: int  # verify forwards (the prompt's forward is not one)
    generated: int  # tokens after the first that the stream took (emitted ones, and the EOS
    # that ended the generation if one did): the verify forwards' and a grammar's forced ending
    # Under a grammar: tokens it forced (the first token and EOS included), emitted without
    # being sampled; they count in neither drafted nor accepted.
    fast_forwarded: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Mean tokens per verify forward (0 when the first token was the only one)."""
        return self.generated / self.target_forwards if self.target_forwards else 0.0


@dataclass(frozen=True)
class GenerationResponse:
    text: str  # the new text segment (may be empty while a character or stop string is pending)
    token: int
    from_draft: bool  # proposed by the drafter and accepted, rather than chosen by the target
    logprobs: mx.array  # (V,) target log-probabilities at this position
    prompt_tokens: int
    prompt_tps: float  # prompt tokens prefilled per second, up to the first token
    generation_tokens: int  # tokens emitted so far (an EOS is not emitted)
    generation_tps: float  # tokens emitted after the first, per second since the first
    peak_memory: float  # GB
    # On the last response: "stop" (EOS or a stop string), "length" (max_tokens) or
    # "context" (the model's context is full).
    finish_reason: str | None = None
    # So far: up to this response's token, the drafts of its whole step (final on the last).
    stats: SpeculativeStats | None = None
    cached_tokens: int = 0  # prompt tokens whose cache carried over from the previous prompt


_SAMPLING_KEYS = {f.name for f in fields(SamplingParams)}


def stream_generate(
    model: CausalLM,
    tokenizer,
    prompt: str | abc.Sequence[int],
    *,
    max_tokens: int = 256,
    sampling: SamplingParams | None = None,
    stop: abc.Sequence[str] = (),
    drafter: DrafterSpec | Drafter | None = None,
    policy: Policy | None = None,
    grammar: Grammar | None = None,
    prompt_cache_file: str | Path | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_START,
    max_kv_size: int | None = None,
    **options: Any,
) -> Iterator[GenerationResponse]:
    """Yields one response per emitted token.

    `prompt_cache_file` (made by `python -m mlx_speculate.cache_prompt` or `prompt_cache`)
    starts from its cached prompt: `prompt` continues it, as with mlx-lm's `prompt_cache`, and
    only `prompt` is prefilled (prompt_cache/).

    `kv_bits`, `kv_group_size`, `quantized_kv_start` (mlx-lm's): keys and values cached at
    that many bits once the context reaches `quantized_kv_start` tokens, speculation exact
    for that cache (models/quantized_kv.py); `max_kv_size`: at most that many tokens of
    context, the prompt included (a longer prompt is refused, generation stops at it with
    finish_reason "context"; nothing is dropped, unlike mlx-lm's rotating cache).

    `grammar` (`Grammar.json_schema(...)`, `.json_object()`, `.lark(...)`) constrains the
    output, with speculation still exact for the constrained distribution (grammar/constraint.py):
    with any drafter (chains and trees alike).

    `drafter` is a method's spec (`LookupSpec()`, `DraftModelSpec(model=...)`, `MedusaSpec()`,
    `EagleSpec()`, ...) or a ready `Drafter`; `policy` chooses the draft length each step
    (default: the spec's `num_draft_tokens`, else chosen from measured costs and acceptance,
    possibly none).
    `options` are sampling settings (temperature, top_p, top_k, min_p, seed) when `sampling`
    is not given, and mlx-lm style shortcuts for a spec, each method's own (drafters.METHODS):
    `draft_model=` (with `draft_tokenizer=`), `prompt_lookup=True` (with `max_ngram=`,
    `lookup_branches=`), `medusa=` (with `medusa_tree=`, `typical_acceptance=`: LOSSY, opt-in)
    `eagle=` (with `eagle_tree=`) and `mtp=True` (a Qwen3-Next / Qwen3.5 checkpoint's own head),
    and `num_draft_tokens=` for any of them.
    """
    arguments.check_prompt(prompt)
    arguments.check_max_tokens(max_tokens)
    stop = arguments.check_stop(stop)
    kv = kv_quantization(kv_bits, kv_group_size, quantized_kv_start)
    sampling, keywords = split_options(options, sampling, _NAMED)
    num_draft_tokens = keywords.get("num_draft_tokens")
    typical = bool(keywords.get("typical_acceptance", False))
    if isinstance(drafter, DrafterSpec) or drafter is None:
        spec = drafter
        if keywords:
            if spec is not None:
                raise ValueError(f"give drafter or {', '.join(keywords)}, not both")
            spec = spec_from_keywords(**keywords)
        drafter = None if spec is None else make_drafter(spec, model, tokenizer)
        if spec is not None:
            num_draft_tokens, typical = spec.num_draft_tokens, spec.typical_acceptance
    elif set(keywords) - {"num_draft_tokens", "typical_acceptance"}:
        raise ValueError(f"a ready drafter takes no {', '.join(keywords)}")
    session = Session(
        model, tokenizer, drafter, typical_acceptance=typical, kv=kv, max_kv_size=max_kv_size
    )
    if prompt_cache_file is not None:
        prompt = resume(session.sequence, prompt_cache_file, prompt, tokenizer)
    yield from session.stream(
        prompt,
        sampling=sampling,
        max_tokens=max_tokens,
        stop=stop,
        # A fixed length when asked for; else the session's default, built once the method
        # is known to fit the request (calibrating a drafter runs it).
        policy=policy
        or (None if drafter is None or num_draft_tokens is None else FixedPolicy(num_draft_tokens)),
        grammar=grammar,
    )


def split_options(
    options: dict[str, Any], sampling: SamplingParams | None, named: Iterable[str] = ()
) -> tuple[SamplingParams, dict[str, Any]]:
    """The sampling settings and the method keywords among a generation call's `options`
    (sampling settings when `sampling` is not given, method shortcuts); a TypeError naming an
    unknown keyword (a caller's own keyword-only `named` ones count as known, for the
    suggestion), a ValueError when both `sampling` and its settings are given."""
    arguments.check_keywords(options, _SAMPLING_KEYS | set(speculative_keywords()) | set(named))
    sampling_options = {k: v for k, v in options.items() if k in _SAMPLING_KEYS}
    if sampling is not None and sampling_options:
        raise ValueError(f"give sampling or {', '.join(sampling_options)}, not both")
    keywords = {k: v for k, v in options.items() if k not in _SAMPLING_KEYS}
    return sampling or SamplingParams(**sampling_options), keywords


class Session:
    """A model and one method's drafter, whose cache carries over from prompt to prompt: a new
    prompt only prefills what follows the prefix it shares with the last context (a chat's
    earlier turns, say). One generation at a time."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer,
        drafter: Drafter | None = None,
        *,
        typical_acceptance: bool = False,
        kv: KVQuantization | None = None,
        max_kv_size: int | None = None,
    ):
        """`kv`: the cache's quantization; `max_kv_size`: the context's bound (Decoder)."""
        self.model = model
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.typical_acceptance = typical_acceptance
        # its context and cache carry over
        self.sequence = Sequence(model, drafter, max_kv_size, kv)
        self.decoder = Decoder(self.sequence)
        self._policy: Policy | None = None  # the default one, built while the drafter is fresh

    def stream(
        self,
        prompt: str | abc.Sequence[int],
        *,
        sampling: SamplingParams,
        max_tokens: int,
        stop: abc.Sequence[str] = (),
        policy: Policy | None = None,
        cancelled: Callable[[], bool] | None = None,
        grammar: Grammar | None = None,
    ) -> Iterator[GenerationResponse]:
        """Yields one response per emitted token, as `stream_generate` does, with the wired
        memory limit raised to the model's size meanwhile (Metal only). `cancelled` is asked
        between prefill chunks: when it says so, the stream ends with no response (the prompt's
        prefix done so far stays cached). Between tokens the caller stops reading. `grammar`
        constrains the output (constraint.py)."""
        arguments.check_prompt(prompt)
        with wired_limit(self.model):
            yield from self._stream(
                prompt, sampling, max_tokens, stop, policy, cancelled, grammar
            )

    def _stream(
        self,
        prompt: str | abc.Sequence[int],
        sampling: SamplingParams,
        max_tokens: int,
        stop: abc.Sequence[str],
        policy: Policy | None,
        cancelled: Callable[[], bool] | None,
        grammar: Grammar | None,
    ) -> Iterator[GenerationResponse]:
        tokenizer, sequence = self.tokenizer, self.sequence
        constraint = None
        if grammar is not None:
            constraint = Constraint(grammar, tokenizer, self.model.args.vocab_size)
        tokens = plain_tokens(tokenizer, [prompt]) if isinstance(prompt, str) else list(prompt)
        if policy is None and self.drafter is not None:
            if self._policy is None:  # calibrating on first use rewinds the drafter
                self._policy = default_policy(self.drafter, self.model)
            policy = self._policy
        mx.reset_peak_memory()
        start = time.perf_counter()
        try:
            cached = sequence.prefill(tokens, cancelled)
        except PrefillCancelled:
            return
        responder = Responder(tokenizer, len(tokens), cached, max_tokens, stop, start)
        steps = self.decoder.steps(
            sampling,
            policy,
            max_tokens=max_tokens,
            typical_acceptance=self.typical_acceptance,
            constraint=constraint,
        )
        for step in steps:
            yield from responder.feed(step, sequence.room() < 0, sequence.context_full)
            if responder.finished:
                steps.close()
                return


class Responder:
    """One generation's steps as responses: the text each token adds (held back while it may
    grow into a stop string), the finish reason and the counts. The loop and the batch engine
    feed it alike, so a stream reads the same whichever ran it."""

    def __init__(
        self,
        tokenizer,
        prompt_tokens: int,
        cached: int,
        max_tokens: int,
        stop: abc.Sequence[str],
        started: float,
    ):
        """`cached`: prompt tokens whose cache carried over; `started`: when the prefill began."""
        self.prompt_tokens = prompt_tokens
        self.cached = cached
        self.max_tokens = max_tokens
        self.stop = stop
        self._started, self._first_time, self._prompt_tps = started, 0.0, 0.0
        self._eos = set(tokenizer.eos_token_ids)
        self._detokenizer = tokenizer.detokenizer
        self._detokenizer.reset()
        self._steps = 0
        self.emitted = self.drafted = self.accepted = self.forwards = self.generated = 0
        self.forced = self._text_sent = 0
        self.finished = False

    def feed(
        self, step: Step, last_step: bool, context_full: bool
    ) -> Iterator[GenerationResponse]:
        """The responses of `step`'s tokens, up to the one that finishes the generation;
        `last_step`: no step follows (the context or the tokens wanted ran out), `context_full`:
        the context did."""
        first, self._steps = self._steps == 0, self._steps + 1
        if first:  # the first token, chosen by the prompt's forward
            self._first_time = time.perf_counter()
            # Counts the tokens prefilled now, not those whose cache carried over.
            prefilled = self.prompt_tokens - self.cached
            self._prompt_tps = prefilled / max(self._first_time - self._started, 1e-9)
        self.forwards += step.verified
        self.drafted += step.drafted
        detokenizer, stop = self._detokenizer, self.stop
        for i, token in enumerate(step.tokens):
            self.generated += not first
            was_forced = i < len(step.forced) and step.forced[i]
            from_draft = i < len(step.tokens) - 1 and not was_forced
            self.accepted += from_draft
            self.forced += was_forced
            finish = None
            if token in self._eos:
                finish = "stop"
            else:
                self.emitted += 1
                detokenizer.add_token(token)
            text = detokenizer.text
            cut = _find_stop(text, stop, self._text_sent)
            if cut >= 0:
                finish = "stop"
            elif finish is None and self.emitted >= self.max_tokens:
                finish = "length"
            elif finish is None and last_step and i == len(step.tokens) - 1:
                finish = "context" if context_full else "length"
            if finish is not None:
                detokenizer.finalize()
                text = detokenizer.text
                end = cut if cut >= 0 else len(text)
            else:
                end = len(text) - _stop_hold(text, stop)
            segment = text[self._text_sent : end] if end > self._text_sent else ""
            self._text_sent = max(self._text_sent, end)
            elapsed = time.perf_counter() - self._first_time
            emitted = self.emitted
            yield GenerationResponse(
                text=segment,
                token=token,
                from_draft=from_draft,
                logprobs=step.logprobs[i],
                prompt_tokens=self.prompt_tokens,
                prompt_tps=self._prompt_tps,
                generation_tokens=emitted,
                generation_tps=(emitted - 1) / elapsed if emitted > 1 else 0.0,
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=finish,
                stats=self.stats,
                cached_tokens=self.cached,
            )
            if finish is not None:
                self.finished = True
                return

    @property
    def stats(self) -> SpeculativeStats:
        return SpeculativeStats(
            self.drafted, self.accepted, self.forwards, self.generated, self.forced
        )


# stream_generate's own keywords: a misspelling of one is suggested as readily as of an option.
_NAMED = {
    p.name
    for p in inspect.signature(stream_generate).parameters.values()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
}


def generate(model: CausalLM, tokenizer, prompt: str | abc.Sequence[int], **kwargs) -> str:
    """The whole generated text."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, **kwargs))


def _stop_hold(text: str, stops: abc.Sequence[str]) -> int:
    """Length of the tail of `text` that could still grow into a stop string."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                hold = max(hold, n)
                break
    return hold


def _find_stop(text: str, stops: abc.Sequence[str], sent: int) -> int:
    """Where the first stop string starts in `text`, or -1; only new text is searched."""
    hits = [i for s in stops if (i := text.find(s, max(0, sent - len(s) + 1))) >= 0]
    return min(hits, default=-1)
