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
    extra = {} if tools is None else {"tools": list(tools)}
    return list(_render(tokenizer, messages, **extra))


def open_user_message(
    tokenizer, prompt: str, system: str | None = None, template: bool = True
) -> list[int]:
    """Token ids of `prompt` as a user message the chat template leaves open (no end of turn,
    no generation prompt), for a later prompt to continue (`continuation`): what mlx-lm's
    cache_prompt caches. Without a chat template (or `template`), the plain text."""
    texts = [system, prompt] if system else [prompt]
    if not (template and has_chat_template(tokenizer)):
        return plain_tokens(tokenizer, texts)
    messages = [{"role": "user", "content": check_text(prompt)}]
    if system:
        messages.insert(0, {"role": "system", "content": check_text(system, "the system prompt")})
    return list(
        _render(tokenizer, messages, add_generation_prompt=False, continue_final_message=True)
    )


def continuation(tokenizer, prompt: str, template: bool = True) -> list[int]:
    """Token ids that continue an open user message (`open_user_message`) with `prompt`,
    end it and start the answer: the template's text from the message's content on, as
    mlx-lm's generate takes it (no special tokens added). Without a template (or
    `template`), the text."""
    check_text(prompt)
    if not (template and has_chat_template(tokenizer)):
        return list(tokenizer.encode(prompt, add_special_tokens=False)) if prompt else []
    marker = "<query>"
    full, probe = (
        _render(tokenizer, [{"role": "user", "content": text}], tokenize=False)
        for text in (prompt, marker)
    )
    if marker not in probe:
        raise ValueError("the tokenizer's chat template does not show the message as given")
    return list(tokenizer.encode(full[probe.index(marker) :], add_special_tokens=False))


def _render(tokenizer, messages: Sequence[Message], **options: Any):
    """The chat template over `messages` (a generation prompt unless said otherwise)."""
    from jinja2 import TemplateError

    options = {"add_generation_prompt": True, **options}
    try:
        return tokenizer.apply_chat_template(list(messages), **options)
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
