"""Prompts as the model expects them: the tokenizer's chat template, or the text as is."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# {"role": ..., "content": ...}, and Hugging Face's "tool_calls" / "tool_call_id" in a tool loop
Message = Mapping[str, Any]


def apply_chat_template(
    tokenizer,
    prompt: str | Sequence[Message],
    system: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Token ids of `prompt` (a user message, or a whole conversation of messages) through the
    tokenizer's chat template with a generation prompt; `system` goes first when given, and
    `tools` (JSON-schema function definitions) go to the template's own `tools` argument.

    A tokenizer without a chat template gets the messages' text as is, one after another.
    Text that is not valid Unicode, and a template that fails or does not parse, are a
    ValueError.
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system:
        messages = [{"role": "system", "content": system}, *messages]
    for message in messages:
        check_text(message.get("content") or "", f"the {message['role']} message")
    if not has_chat_template(tokenizer):
        if tools:
            raise ValueError("the model has no chat template to tell it about tools")
        return plain_tokens(tokenizer, [m.get("content") or "" for m in messages])
    from jinja2 import TemplateError

    extra = {} if tools is None else {"tools": list(tools)}
    try:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra))
    except TemplateError as e:  # raise_exception(...) in the template, or it does not parse
        raise ValueError(f"the tokenizer's chat template failed: {e}") from None


def plain_tokens(tokenizer, texts: Sequence[str]) -> list[int]:
    """Token ids of `texts` as plain text, one after another on their own lines."""
    return list(tokenizer.encode("\n".join(check_text(t) for t in texts)))


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "has_chat_template", False))


def check_text(text: str, what: str = "the prompt") -> str:
    """`text` as is when a tokenizer can take it. Lone surrogates cannot: they are what Python
    makes of bytes that were not UTF-8 (argv, `errors="surrogateescape"`)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{what} holds {text[e.start]!r} at character {e.start}, which is not valid "
            "Unicode (bytes that were not UTF-8?)"
        ) from None
    return text
