"""What `stream_generate`'s own arguments must be, checked before anything runs: a wrong type
or a misspelt keyword is a TypeError naming the argument, never a comparison error from deep
inside (or a helper's name the caller never called)."""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Iterable, Sequence
from typing import Any


def check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, (bytes, bytearray, memoryview)):  # a sequence of ints, not token ids
        raise TypeError(
            f"prompt must be a string or a sequence of token ids, got {type(prompt).__name__}"
            " (decode it to a str first)"
        )
    if not isinstance(prompt, Sequence) and not _is_array(prompt):
        raise TypeError(
            f"prompt must be a string or a sequence of token ids, got {type(prompt).__name__}"
        )


def check_max_tokens(max_tokens: Any) -> None:
    if not isinstance(max_tokens, numbers.Integral) or isinstance(max_tokens, bool):
        raise TypeError(f"max_tokens must be an integer, got {max_tokens!r}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")


def check_stop(stop: Any) -> tuple[str, ...]:
    """The stop strings as a tuple; a lone string is one stop string, not one per character."""
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, Iterable) or not all(isinstance(s, str) for s in stop):
        raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
    stop = tuple(stop)
    if "" in stop:
        raise ValueError("stop strings must not be empty (an empty one would stop at once)")
    return stop


def check_keywords(given: Iterable[str], known: Iterable[str]) -> None:
    """A TypeError naming the first keyword of `given` that is not `known`, with the nearest
    known spelling."""
    known = sorted(known)
    for name in given:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(
                f"stream_generate() got an unexpected keyword argument {name!r}{hint}; "
                f"it takes {', '.join(known)}"
            )


def _is_array(value: Any) -> bool:
    return hasattr(value, "tolist") and hasattr(value, "shape")
