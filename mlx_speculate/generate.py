"""`stream_generate` / `generate` in mlx-lm's style, and the generation CLI."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .decode import Decoder
from .drafters import Drafter
from .drafters.draft_model import DraftModelDrafter, check_vocabularies
from .drafters.lookup import LookupDrafter
from .drafters.medusa import DEFAULT_TREE, MedusaDrafter, TreeSpec
from .heads import MedusaHeads, load_medusa_heads
from .models.base import CausalLM
from .policy import AdaptivePolicy, FixedPolicy, Policy
from .sampling import SamplingParams
from .tree import MEDUSA_TREES


@dataclass(frozen=True)
class SpeculativeStats:
    drafted: int  # tokens proposed by the drafter
    accepted: int  # of those, accepted by the target
    target_forwards: int  # verification forwards (one per step)
    generated: int  # tokens emitted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.generated / self.target_forwards if self.target_forwards else 0.0


@dataclass(frozen=True)
class GenerationResponse:
    text: str  # the new text segment (may be empty while a character or stop string is pending)
    token: int
    from_draft: bool  # proposed by the drafter and accepted, rather than chosen by the target
    logprobs: mx.array  # (V,) target log-probabilities at this position
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str | None = None  # "stop" or "length" on the last response
    stats: SpeculativeStats | None = None  # on the last response


MAX_DRAFT_TOKENS = 8  # the adaptive policy's longest draft


def _encode(tokenizer, prompt: str | Sequence[int]) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    return list(prompt)


def _stop_hold(text: str, stops: Sequence[str]) -> int:
    """Length of the tail of `text` that could still grow into a stop string."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                hold = max(hold, n)
                break
    return hold


def stream_generate(
    model: CausalLM,
    tokenizer,
    prompt: str | Sequence[int],
    *,
    max_tokens: int = 256,
    sampling: SamplingParams | None = None,
    stop: Sequence[str] = (),
    drafter: Drafter | None = None,
    policy: Policy | None = None,
    draft_model: CausalLM | None = None,
    draft_tokenizer=None,
    num_draft_tokens: int | None = None,
    prompt_lookup: bool = False,
    max_ngram: int = 3,
    medusa: bool | str | Path | MedusaHeads | None = None,
    tree: TreeSpec | None = None,
    typical_acceptance: bool = False,
    **sampling_kwargs,
) -> Iterator[GenerationResponse]:
    """Yields one response per emitted token.

    `sampling_kwargs` (temperature, top_p, top_k, min_p, seed) build a SamplingParams when
    `sampling` is not given. With a `drafter`, `policy` chooses the draft length each step.
    Speculation by a `draft_model` (its `draft_tokenizer`, when given, must agree with
    `tokenizer`) or by `prompt_lookup` (n-grams of up to `max_ngram` tokens) drafts
    `num_draft_tokens` tokens per step, or, when that is None, as many as measured costs and
    acceptance say pay (possibly none).

    `medusa` drafts a tree with Medusa heads: True uses the heads beside the loaded model
    (`medusa/` in its folder), a path names a heads folder (MLX or published Medusa-1), or give
    `MedusaHeads`. `tree` is a name in MEDUSA_TREES, a list of choices or a Tree (default
    mc_sim_7b_63); the policy picks how many of its nodes to verify. `typical_acceptance`
    switches tree verification at temperature > 0 to Medusa's typical acceptance, which is
    LOSSY: the output no longer follows the target's distribution.
    """
    sampling = sampling or SamplingParams(**sampling_kwargs)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)
    speculative = draft_model is not None or prompt_lookup
    use_medusa = medusa is not None and medusa is not False
    built_in = speculative or use_medusa
    if use_medusa:
        if drafter is not None or speculative:
            raise ValueError("give only one of drafter, draft_model, prompt_lookup and medusa")
        drafter = _medusa_drafter(model, medusa, tree)
    elif tree is not None or typical_acceptance:
        raise ValueError("tree and typical_acceptance apply to Medusa: pass medusa=...")
    if speculative:
        if drafter is not None or (draft_model is not None and prompt_lookup):
            raise ValueError("give only one of drafter, draft_model and prompt_lookup")
        max_k = num_draft_tokens or MAX_DRAFT_TOKENS
        drafter = _builtin_drafter(
            model, tokenizer, sampling, draft_model, draft_tokenizer, max_ngram, max_k
        )
    if drafter is not None and policy is None:
        if num_draft_tokens is not None:
            policy = FixedPolicy(num_draft_tokens)
        elif built_in:
            policy = AdaptivePolicy(getattr(drafter, "max_draft", MAX_DRAFT_TOKENS))
        else:
            policy = FixedPolicy(3)
    tokens = _encode(tokenizer, prompt)
    decoder = Decoder(model, sampling, drafter, policy, typical_acceptance=typical_acceptance)
    mx.reset_peak_memory()
    start = time.perf_counter()
    decoder.prefill(tokens)
    eos = set(tokenizer.eos_token_ids)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    emitted = drafted = accepted = forwards = text_sent = 0
    prompt_tps, gen_start = 0.0, start
    for step in decoder.steps():
        if forwards == 0:
            gen_start = time.perf_counter()
            prompt_tps = len(tokens) / (gen_start - start)
        forwards += 1
        drafted += step.drafted
        accepted += step.accepted
        context_full = decoder.room() <= 0
        for i, token in enumerate(step.tokens):
            finish = None
            if token in eos:
                finish = "stop"
            else:
                emitted += 1
                detokenizer.add_token(token)
            text = detokenizer.text
            cut = _find_stop(text, stop, text_sent)
            if cut >= 0:
                finish = "stop"
            elif finish is None and (
                emitted >= max_tokens or (context_full and i == len(step.tokens) - 1)
            ):
                finish = "length"
            if finish is not None:
                detokenizer.finalize()
                text = detokenizer.text
                end = cut if cut >= 0 else len(text)
            else:
                end = len(text) - _stop_hold(text, stop)
            segment = text[text_sent:end] if end > text_sent else ""
            text_sent = max(text_sent, end)
            elapsed = time.perf_counter() - gen_start
            yield GenerationResponse(
                text=segment,
                token=token,
                from_draft=i < step.accepted,
                logprobs=step.logprobs[i],
                prompt_tokens=len(tokens),
                prompt_tps=prompt_tps,
                generation_tokens=emitted,
                generation_tps=emitted / elapsed if elapsed > 0 else 0.0,
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=finish,
                stats=SpeculativeStats(drafted, accepted, forwards, emitted) if finish else None,
            )
            if finish is not None:
                return


def _builtin_drafter(
    model: CausalLM,
    tokenizer,
    sampling: SamplingParams,
    draft_model: CausalLM | None,
    draft_tokenizer,
    max_ngram: int,
    max_k: int,
) -> Drafter:
    vocab_size = model.args.vocab_size
    if draft_model is None:
        return LookupDrafter(vocab_size, max_ngram, max_k)
    check_vocabularies(vocab_size, draft_model.args.vocab_size, tokenizer, draft_tokenizer)
    return DraftModelDrafter(draft_model, vocab_size, sampling)


def _medusa_drafter(
    model: CausalLM, medusa: bool | str | Path | MedusaHeads, tree: TreeSpec | None
) -> MedusaDrafter:
    if isinstance(medusa, MedusaHeads):
        heads = medusa
        heads.check_fits(model.args.hidden_size, model.args.vocab_size)
    elif medusa is True:
        if model.source is None:
            raise ValueError(
                "medusa=True looks for heads beside a model loaded from a folder with load(); "
                "pass the heads folder or MedusaHeads instead"
            )
        heads = load_medusa_heads(model.source, model)
    elif isinstance(medusa, str | Path):
        heads = load_medusa_heads(medusa, model)
    else:
        raise ValueError(f"medusa must be True, a folder or MedusaHeads, got {medusa!r}")
    return MedusaDrafter(heads, DEFAULT_TREE if tree is None else tree)


def _find_stop(text: str, stops: Sequence[str], sent: int) -> int:
    """Where the first stop string starts in `text`, or -1; only new text is searched."""
    hits = [
        i for s in stops if (i := text.find(s, max(0, sent - len(s) + 1))) >= 0
    ]
    return min(hits, default=-1)


def generate(model: CausalLM, tokenizer, prompt: str | Sequence[int], **kwargs) -> str:
    """The whole generated text."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, **kwargs))


def apply_chat_template(tokenizer, prompt: str, system: str | None = None) -> list[int]:
    """The tokenizer's chat template with a generation prompt (the prompt as is without one)."""
    if not getattr(tokenizer, "has_chat_template", False):
        return list(tokenizer.encode(prompt))
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mlx_speculate.generate",
        description="Generate text with an MLX model, optionally with speculative decoding.",
    )
    parser.add_argument("--model", required=True, help="local folder or Hugging Face hub id")
    parser.add_argument("--prompt", default="-", help="prompt text, or - to read stdin")
    parser.add_argument("--max-tokens", "-m", type=int, default=256)
    parser.add_argument("--temp", type=float, default=0.0, help="temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0: off")
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--system-prompt", default=None)
    parser.add_argument(
        "--ignore-chat-template", action="store_true", help="feed the prompt as raw text"
    )
    parser.add_argument("--verbose", action="store_true", help="print speed and statistics")
    speculative = parser.add_argument_group("speculative decoding")
    speculative.add_argument(
        "--draft-model", default=None, help="draft model folder or hub id (same tokenizer)"
    )
    speculative.add_argument(
        "--num-draft-tokens", type=int, default=None,
        help="tokens drafted per step (default: chosen each step from measured costs)",
    )
    speculative.add_argument(
        "--prompt-lookup", action="store_true", help="draft by n-gram lookup in the context"
    )
    speculative.add_argument(
        "--max-ngram", type=int, default=3, help="longest n-gram prompt lookup matches"
    )
    speculative.add_argument(
        "--medusa", nargs="?", const=True, default=False, metavar="DIR",
        help="draft trees with Medusa heads: those beside the model (its medusa/ folder), "
        "or the heads folder DIR",
    )
    speculative.add_argument(
        "--medusa-tree", choices=list(MEDUSA_TREES), default=None,
        help=f"Medusa tree (default: {DEFAULT_TREE})",
    )
    speculative.add_argument(
        "--typical-acceptance", action="store_true",
        help="Medusa's typical acceptance when sampling: faster but LOSSY (the output no "
        "longer follows the model's distribution)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .loading import load

    try:
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        sampling = SamplingParams(args.temp, args.top_p, args.top_k, args.min_p, args.seed)
        model, tokenizer = load(args.model)
        draft_model = draft_tokenizer = None
        if args.draft_model is not None:
            draft_model, draft_tokenizer = load(args.draft_model)
        tokens = (
            list(tokenizer.encode(prompt))
            if args.ignore_chat_template
            else apply_chat_template(tokenizer, prompt, args.system_prompt)
        )
        response = None
        for response in stream_generate(
            model, tokenizer, tokens, max_tokens=args.max_tokens, sampling=sampling,
            stop=args.stop, draft_model=draft_model, draft_tokenizer=draft_tokenizer,
            num_draft_tokens=args.num_draft_tokens, prompt_lookup=args.prompt_lookup,
            max_ngram=args.max_ngram, medusa=args.medusa, tree=args.medusa_tree,
            typical_acceptance=args.typical_acceptance,
        ):
            print(response.text, end="", flush=True)
        print()
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.verbose and response is not None:
        _print_stats(response)
    return 0


def _print_stats(response: GenerationResponse) -> None:
    print("=" * 10, file=sys.stderr)
    print(
        f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tokens-per-sec\n"
        f"Generation: {response.generation_tokens} tokens, "
        f"{response.generation_tps:.1f} tokens-per-sec\n"
        f"Peak memory: {response.peak_memory:.3f} GB",
        file=sys.stderr,
    )
    stats = response.stats
    if stats is not None and stats.drafted:
        print(
            f"Speculation: {stats.accepted}/{stats.drafted} drafted tokens accepted "
            f"({stats.acceptance_rate:.1%}), {stats.tokens_per_forward:.2f} tokens per "
            f"target forward",
            file=sys.stderr,
        )


if __name__ == "__main__":
    sys.exit(main())
