"""Prompts as the model expects them: the tokenizer's chat template, or the text as is."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Message = Mapping[str, str]  # {"role": ..., "content": ...}


def apply_chat_template(
    tokenizer, prompt: str | Sequence[Message], system: str | None = None
) -> list[int]:
    """Token ids of `prompt` (a user message, or a whole conversation of messages) through the
    tokenizer's chat template with a generation prompt; `system` goes first when given.

    A tokenizer without a chat template gets the messages' text as is, one after another.
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system:
        messages = [{"role": "system", "content": system}, *messages]
    if not has_chat_template(tokenizer):
        return list(tokenizer.encode("\n".join(m["content"] for m in messages)))
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "has_chat_template", False))
