"""A scripted stand-in target for server tests: it says what the test tells it to, token for
token, under any tokenizer, so tool-call paths run end to end without a model that can call
tools. Its next token continues the script from the longest tail of its context that is a
prefix of the script (so a drafter's wrong guesses are rejected as a real model's would be),
and is EOS once the script is said."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx

from mlx_speculate.cache import KVCache
from mlx_speculate.loading import load_tokenizer, token_count
from mlx_speculate.models.base import ModelOutput

TEMPLATES = Path(__file__).resolve().parent / "templates"


def token_cache() -> KVCache:
    """A cache of token ids rather than keys and values: slot i of its one layer holds the token
    written there, so it truncates, compacts and serves a step's view as a real cache does."""
    return KVCache(1, like=mx.zeros((1, 1, 0, 1), mx.float32))


class ScriptedLM:
    traceable = False  # it reads its context on the host
    recurrent = False  # its cache rolls back to any length
    implementation = "native"  # the package's forward contract, trees included
    verifies_trees = True

    def __init__(self, tokenizer, max_context: int = 4096):
        self.tokenizer = tokenizer
        vocab = token_count(tokenizer)
        self.args = SimpleNamespace(
            vocab_size=vocab,
            hidden_size=vocab,
            num_hidden_layers=1,
            max_position_embeddings=max_context,
        )
        self.eos = min(tokenizer.eos_token_ids)
        self.script: list[int] = []

    def say(self, text: str) -> None:
        """What the model answers next (each of its turns, until told otherwise)."""
        self.script = list(self.tokenizer.encode(text, add_special_tokens=False))

    def make_cache(self) -> KVCache:
        return token_cache()

    def next_token(self, context: list[int]) -> int:
        script = self.script
        for k in range(min(len(script), len(context)), 0, -1):
            if context[-k:] == script[:k]:
                return self.eos if k == len(script) else script[k]
        return script[0] if script else self.eos

    def __call__(self, tokens, cache=None, *, positions=None, mask=None, taps=()):
        row = tokens[0].tolist()
        committed = []
        if cache is not None:  # the tokens go in as keys, at the host offset or a step's slot
            start = cache.offset if cache.start is None else int(cache.start.item())
            ids = tokens.astype(mx.float32).reshape(1, 1, -1, 1)
            end = start + len(row) if cache.start is None else None
            keys, _ = cache.write(0, ids, ids, mx.array(start, mx.int32), end)
            committed = [int(t) for t in keys[0, 0, :start, 0].tolist()]
            cache.advance(len(row))
        if mask is None:  # a chain: each row sees every row before it
            seen = [list(range(i + 1)) for i in range(len(row))]
        else:  # a tree: bool (N, N) visibility among the new rows
            seen = [[j for j, a in enumerate(r) if a] for r in mask.tolist()]
        nexts = [self.next_token(committed + [row[j] for j in s]) for s in seen]
        hidden = mx.eye(self.args.vocab_size)[mx.array(nexts)][None]  # (1, L, V)
        return ModelOutput(self.project(hidden), hidden, tuple(hidden for _ in taps))

    def project(self, hidden: mx.array) -> mx.array:
        return 30.0 * hidden


def scripted(tokenizer_path: Path, template: str) -> tuple[ScriptedLM, object]:
    """A scripted model over the tokenizer in `tokenizer_path`, which gets the chat template
    tests/templates/`template`.jinja."""
    tokenizer = load_tokenizer(tokenizer_path)
    tokenizer.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    tokenizer.has_chat_template = True
    return ScriptedLM(tokenizer), tokenizer
