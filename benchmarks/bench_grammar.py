"""Structured output under speculation: fast-forwarded tokens and tokens per forward.

    python benchmarks/bench_grammar.py [--openblas] [--models stories,smollm2] [--schemas a,b]

For each model, every JSON schema of tests/json_schemas.json (20) is generated with plain
decoding, prompt lookup and a draft model (stories260K: llama2xs281K; SmolLM2: itself), at
temperature 0 and 0.8, the methods interleaved per schema. Reported per model, method and
temperature, summed over the schemas: the fraction of output tokens (EOS included) the
grammar fast-forwarded,
tokens per verify forward, draft acceptance, tokens/s (median over schemas) and how many
outputs parse and validate. Greedy outputs are checked equal across methods.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import CACHE, MODELS, add_blas_argument, header, median, setup_blas  # noqa: E402

SCHEMAS = Path(__file__).resolve().parents[1] / "tests" / "json_schemas.json"
STORY = "Lily and Tom went to the park."
COUNTS = ("tokens", "emitted", "ff", "forwards", "drafted", "accepted", "valid", "runs")


def models(name: str):
    """(target, tokenizer, draft model, prompt for a schema)."""
    from mlx_speculate.loading import load

    if name == "stories":
        target, tokenizer = load(MODELS / "stories260K-llama")
        draft, _ = load(MODELS / "llama2xs281K-llama")
        return target, tokenizer, draft, lambda schema: tokenizer.encode(STORY)
    if name == "smollm2":
        folder = CACHE / "smollm2-f32-mlx"  # bench_server's float32 conversion
        if not folder.exists():
            from mlx_speculate.convert import convert
            from mlx_speculate.default_model import gguf_path

            convert(gguf_path(), folder, dtype="float32")
        target, tokenizer = load(folder)

        def prompt(schema):
            request = f"Reply in JSON following this schema: {json.dumps(schema)}"
            chat = [{"role": "user", "content": request}]
            text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            return tokenizer.encode(text, add_special_tokens=False)

        return target, tokenizer, target, prompt
    raise SystemExit(f"unknown model {name!r} (stories, smollm2)")


def run(name: str, schemas: dict, num_draft_tokens: int, max_tokens: int) -> None:
    import jsonschema

    from mlx_speculate.drafters import DraftModelSpec, LookupSpec
    from mlx_speculate.generation import stream_generate
    from mlx_speculate.grammar import Grammar

    target, tokenizer, draft, prompt_for = models(name)
    methods = {
        "plain": None,
        "lookup": LookupSpec(num_draft_tokens=num_draft_tokens),
        "draft_model": DraftModelSpec(model=draft, num_draft_tokens=num_draft_tokens),
    }
    totals: dict[tuple[str, float], dict] = {}
    mismatches = []
    for schema_name, schema in schemas.items():
        grammar, prompt = Grammar.json_schema(schema), prompt_for(schema)
        greedy = {}
        for temperature in (0.0, 0.8):
            for method, spec in methods.items():
                start = time.perf_counter()
                responses = list(
                    stream_generate(
                        target, tokenizer, prompt, grammar=grammar, drafter=spec,
                        max_tokens=max_tokens, temperature=temperature, seed=0,
                    )
                )  # fmt: skip
                seconds = time.perf_counter() - start
                stats = responses[-1].stats
                try:
                    jsonschema.validate(json.loads("".join(r.text for r in responses)), schema)
                    valid = 1
                except (ValueError, jsonschema.ValidationError):
                    valid = 0
                if temperature == 0:
                    greedy[method] = [r.token for r in responses]
                t = totals.setdefault((method, temperature), {"tps": []} | dict.fromkeys(COUNTS, 0))
                t["tokens"] += stats.generated
                t["emitted"] += len(responses)  # the EOS included
                t["ff"] += stats.fast_forwarded
                t["forwards"] += stats.target_forwards
                t["drafted"] += stats.drafted
                t["accepted"] += stats.accepted
                t["valid"] += valid
                t["runs"] += 1
                t["tps"].append(len(responses) / seconds)
        if any(tokens != greedy["plain"] for tokens in greedy.values()):
            mismatches.append(schema_name)
        print(f"{name}: {schema_name} done", file=sys.stderr, flush=True)
    print(f"\n## {name}: {len(schemas)} schemas, {num_draft_tokens} draft tokens")
    print("| method | temp | valid | fast-forwarded | tokens/forward | accepted/drafted | tok/s |")
    print("|---|---|---|---|---|---|---|")
    for (method, temperature), t in totals.items():
        print(
            f"| {method} | {temperature} | {t['valid']}/{t['runs']} "
            f"| {t['ff'] / max(t['emitted'], 1):.1%} ({t['ff']}/{t['emitted']}) "
            f"| {t['tokens'] / max(t['forwards'], 1):.2f} "
            f"| {t['accepted']}/{t['drafted']} | {median(t['tps']):.1f} |"
        )
    print(f"greedy outputs equal across methods: {'yes' if not mismatches else mismatches}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="stories,smollm2")
    parser.add_argument("--schemas", default=None, help="comma-separated names (default: all)")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=300)
    add_blas_argument(parser)
    args = parser.parse_args(argv)
    blas = setup_blas(args.openblas)
    header("structured output: fast-forward and tokens per forward", blas)
    schemas = json.loads(SCHEMAS.read_text())
    if args.schemas:
        unknown = set(args.schemas.split(",")) - set(schemas)
        if unknown:
            raise SystemExit(f"unknown schemas: {', '.join(sorted(unknown))}")
        schemas = {k: v for k, v in schemas.items() if k in args.schemas.split(",")}
    for name in args.models.split(","):
        run(name, schemas, args.num_draft_tokens, args.max_tokens)


if __name__ == "__main__":
    main()
