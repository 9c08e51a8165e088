"""Every method on the shared models and SmolLM2-135M-Instruct (float32 and 4-bit), interleaved
with mlx-lm's plain decoding on the same weights: a markdown table and a PNG chart of tokens/s,
tau (tokens per verify forward) and the ratio to our plain decoding.

    python benchmarks/report.py [--openblas] [--runs 3] [--max-tokens 96] [--out report]
        [--models stories,smollm2-f32,smollm2-4bit]

Writes OUT.md and OUT.png (matplotlib: `pip install mlx_speculate[bench]`). Tokens/s are
medians over interleaved rounds (the first warms up, and calibrates the adaptive policy, and is
dropped); greedy decoding, so every method emits the same tokens as plain decoding. mlx-lm
computes in our dtype: by default it keeps the checkpoint's float16 scales, and on a CPU a
one-token forward of the 4-bit SmolLM2 then takes 6.9 s against 0.2 s in float32.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import CACHE, SHARED, add_blas_argument, header, median, setup_blas  # noqa: E402

STORY = "Once upon a time, there was a little girl named Lily. She"
EDIT = (
    "Fix the typos in this text and return it unchanged otherwise:\n\n"
    "The quick brown fox jumpd over the lazy dog. The dog was not amused, and it barkd at the "
    "fox. The fox ran into the forest, where it met an owl. The owl said: it is late, little fox, "
    "go home. The fox went home and slept until the morning sun woke it up again."
)


def smollm2_f32() -> Path:
    from mlx_speculate.convert import convert
    from mlx_speculate.default_model import smollm2_gguf

    folder = CACHE / "smollm2-f32-mlx"
    if not folder.exists():
        convert(smollm2_gguf(), folder, dtype="float32")
    return folder


def cases(names: list[str]):
    """(label, model folder, prompt text, chat?, {method: stream_generate keywords})."""
    from mlx_speculate.default_model import default_model_path

    eagle1, eagle3 = SHARED / "eagle" / "smollm2-eagle1", SHARED / "eagle" / "smollm2-eagle3"
    for name in names:
        if name == "stories":
            folder = SHARED / "models" / "stories260K-llama"
            draft = SHARED / "models" / "llama2xs281K-llama"
            yield "stories260K", folder, STORY, False, {
                "draft model (llama2xs281K)": {"draft_model": str(draft)},
                "prompt lookup (trees, the default)": {"prompt_lookup": True},
                "prompt lookup chain": {"prompt_lookup": True, "lookup_branches": 1},
            }
        elif name in ("smollm2-f32", "smollm2-4bit"):
            f32, q4 = smollm2_f32(), default_model_path()
            folder = f32 if name == "smollm2-f32" else q4
            methods = {
                "prompt lookup (trees, the default)": {"prompt_lookup": True},
                "prompt lookup chain": {"prompt_lookup": True, "lookup_branches": 1},
                "EAGLE-1 adaptive": {"eagle": str(eagle1)},
                "EAGLE-3 adaptive": {"eagle": str(eagle3)},
            }
            if name == "smollm2-f32":
                methods["draft model (its 4-bit copy)"] = {"draft_model": str(q4)}
            yield f"SmolLM2-135M {name.split('-')[1]}", folder, EDIT, True, methods
        else:
            raise SystemExit(f"unknown model {name!r} (stories, smollm2-f32, smollm2-4bit)")


def ours(model, tokenizer, prompt, max_tokens, **kwargs):
    from mlx_speculate import stream_generate

    start = time.perf_counter()
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs))
    seconds = time.perf_counter() - start
    stats = responses[-1].stats
    tau = stats.tokens_per_forward if stats and stats.target_forwards else 1.0
    return len(responses) / seconds, tau


def theirs(model, tokenizer, prompt, max_tokens):
    import mlx_lm

    start, n = time.perf_counter(), 0
    for _ in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        n += 1
    return n / (time.perf_counter() - start), 1.0


def measure(label, folder, text, chat, methods, runs, max_tokens) -> list[tuple]:
    import mlx_lm

    from mlx_speculate import load
    from mlx_speculate.chat import apply_chat_template, plain_tokens
    from mlx_speculate.drafters import spec_from_keywords

    model, tokenizer = load(folder)
    their_model, their_tokenizer = mlx_lm.load(str(folder))
    their_model.set_dtype(model.compute_dtype)  # same weights, same arithmetic
    prompt = apply_chat_template(tokenizer, text) if chat else plain_tokens(tokenizer, [text])
    rows = {
        "plain": lambda: ours(model, tokenizer, prompt, max_tokens),
        "mlx-lm plain": lambda: theirs(their_model, their_tokenizer, prompt, max_tokens),
    }
    for name, kwargs in methods.items():
        # Draft models and heads are loaded once here, not inside each timed generation.
        spec = spec_from_keywords(**kwargs).resolve(model)
        rows[name] = lambda spec=spec: ours(model, tokenizer, prompt, max_tokens, drafter=spec)
    results = {name: [] for name in rows}
    for _ in range(runs + 1):
        for name, run in rows.items():
            results[name].append(run())
    out = []
    for name, values in results.items():
        tps = median([v[0] for v in values[1:]])
        tau = median([v[1] for v in values[1:]])
        out.append((label, name, tps, tau))
        print(f"{label:<18} {name:<30} {tps:>8.2f} tok/s  tau {tau:.2f}", flush=True)
    return out


def write(rows: list[tuple], out: Path, title: str) -> None:
    plain = {label: tps for label, name, tps, _ in rows if name == "plain"}
    lines = [f"# {title}", "", "| model | method | tokens/s | tau | vs plain |"]
    lines.append("|---|---|---|---|---|")
    for label, name, tps, tau in rows:
        lines.append(f"| {label} | {name} | {tps:.1f} | {tau:.2f} | {tps / plain[label]:.2f}x |")
    _install(out.with_suffix(".md"), lambda path: path.write_text("\n".join(lines) + "\n"))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(label for label, *_ in rows))
    fig, axes = plt.subplots(1, len(labels), figsize=(5 * len(labels), 4), squeeze=False)
    for ax, label in zip(axes[0], labels, strict=True):
        mine = [r for r in rows if r[0] == label]
        ratios = [tps / plain[label] for _, _, tps, _ in mine]
        bars = ax.barh([name for _, name, _, _ in mine], ratios)
        for bar, (_, _, tps, tau) in zip(bars, mine, strict=True):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                    f" {tps:.0f} tok/s, tau {tau:.2f}", va="center", fontsize=7)
        ax.axvline(1.0, color="grey", linewidth=0.8)
        ax.set_xlim(0, 1.7 * max(ratios))  # room for the labels
        ax.set_title(label)
        ax.set_xlabel("tokens/s relative to plain decoding")
        ax.invert_yaxis()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    _install(out.with_suffix(".png"), lambda path: fig.savefig(path, dpi=120))


def _install(path: Path, write) -> None:
    """Writes `path` through `write(staged)` in one rename: a re-run never leaves half a file."""
    from mlx_speculate.atomic import install_file, staging_folder

    path.parent.mkdir(parents=True, exist_ok=True)
    staged = staging_folder(path) / path.name
    write(staged)
    install_file(staged, path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="stories,smollm2-f32,smollm2-4bit")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=Path("report"))
    add_blas_argument(parser)
    args = parser.parse_args(argv)
    blas = setup_blas(args.openblas)
    header("Every method against plain decoding and mlx-lm (greedy, same weights)", blas)

    import mlx.core as mx

    rows = []
    for case in cases(args.models.split(",")):
        rows += measure(*case, args.runs, args.max_tokens)
    title = f"{mx.default_device()}, {blas.split(' (')[0]}, mlx {mx.__version__}, greedy"
    write(rows, args.out, title)
    print(f"wrote {args.out.with_suffix('.md')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
