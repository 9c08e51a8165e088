"""Request bodies of the OpenAI API as pydantic models, checked strictly: a wrong type or an
out-of-range value is a 400 naming the field, never a silent coercion.

Fields that would change the output in ways this server does not implement (penalties, logit
bias, tools, n > 1, ...) are refused when set to anything but their neutral value, rather than
ignored; unknown fields are ignored, as OpenAI's clients send a few of their own.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..sampling import SamplingParams

MAX_STOPS = 16


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class Speculative(_Body):
    """The extension object `speculative`: which method drafts for this request ("none" turns
    speculation off) and how many tokens it drafts per step (default: chosen adaptively)."""

    method: str | None = None  # default: the method the server was started with
    num_draft_tokens: Annotated[int, Field(ge=1)] | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    """What chat and text completions share."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0  # 0: off
    min_p: Annotated[float, Field(ge=0, lt=1)] = 0.0
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None  # MLX's generator takes a uint64
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    speculative: Speculative | None = None
    # Refused unless neutral: this server decodes exactly the model's distribution.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported (one choice per request)")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("penalties are not supported (only 0)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.min_p, self.seed)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_input(self) -> dict[str, str]:
        """{"role", "content"} as chat templates expect; "developer" is OpenAI's new name for
        the system role, which templates do not know."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_Generation):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Any] | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, tools: list[Any] | None) -> list[Any] | None:
        if tools:
            raise ValueError("tools are not supported")
        return tools

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def token_limit(self) -> int | None:
        # The newer name wins: clients that send both mean it.
        return self.max_completion_tokens or self.max_tokens

    def top_count(self) -> int | None:
        """Alternatives per token to report; None when no log-probabilities are wanted."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Generation):
    prompt: str | Annotated[list[int], Field(min_length=1)] | list[str]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if prompt == []:
            raise ValueError("the prompt is empty")
        texts = isinstance(prompt, list) and any(isinstance(p, str) for p in prompt)
        if texts and len(prompt) != 1:
            raise ValueError("one prompt per request: a string, token ids, or a list of 1 string")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix (insertion) is not supported")
        return suffix

    def top_count(self) -> int | None:
        return self.logprobs

    def text_or_ids(self) -> str | list[int]:
        prompt = self.prompt
        return prompt[0] if isinstance(prompt, list) and isinstance(prompt[0], str) else prompt
