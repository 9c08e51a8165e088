"""Request bodies of the OpenAI API as pydantic models, checked strictly: a wrong type or an
out-of-range value is a 400 naming the field, never a silent coercion.

Fields that would change the output in ways this server does not implement (penalties, logit
bias, n > 1, ...) are refused when set to anything but their neutral value, rather than
ignored; unknown fields are ignored, as OpenAI's clients send a few of their own.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..grammar import Grammar
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


class FunctionCall(_Body):
    name: str
    arguments: str  # a JSON object, as OpenAI sends it

    def as_template_input(self) -> dict[str, Any]:
        """{"name", "arguments"} with the arguments decoded: templates write them out as JSON."""
        try:
            arguments = json.loads(self.arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"the arguments of {self.name!r} are not JSON: {e}") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"the arguments of {self.name!r} are not a JSON object")
        return {"name": self.name, "arguments": arguments}


class AssistantToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.tool_calls:
            for call in self.tool_calls:
                call.function.as_template_input()
        return self

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates expect it (Hugging Face's convention): "developer" is
        OpenAI's new name for the system role, which templates do not know; calls carry their
        arguments decoded."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": c.function.as_template_input()}
                for c in self.tool_calls
            ]
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionDefinition(_Body):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition

    def as_template_input(self) -> dict[str, Any]:
        function = self.function.model_dump(exclude_none=True, exclude={"strict"})
        function["parameters"] = self.arguments_schema()
        return {"type": "function", "function": function}

    def arguments_schema(self) -> dict[str, Any]:
        return self.function.parameters or {"type": "object", "properties": {}}


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Body):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs json_schema")
        return self

    def grammar(self) -> Grammar | None:
        """What the output must follow; every schema is enforced, and with `strict` its
        objects take only the properties they declare (as OpenAI's strict mode requires of
        a schema). A schema the engine cannot compile is a ValueError."""
        if self.type == "text":
            return None
        if self.json_schema is None or self.json_schema.schema_ is None:
            return Grammar.json_object()
        strict = bool(self.json_schema.strict)
        return Grammar.json_schema(self.json_schema.schema_, strict=strict)


class ChatCompletionRequest(_Generation):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in tools or []]
        if len(set(names)) < len(names):
            raise ValueError("two tools have the same name")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, choice: Any, info: ValidationInfo) -> Any:
        names = [t.function.name for t in info.data.get("tools") or []]
        if choice is not None and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"{choice.function.name!r} is not one of the tools")
        return choice

    @property
    def tool_mode(self) -> str:
        """ "none", "auto", "required", or "function" (the one `forced_tool` names)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "function"
        return self.tool_choice or ("auto" if self.tools else "none")

    @property
    def forced_tool(self) -> str | None:
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return None

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
    response_format: ResponseFormat | None = None  # as chat's (vLLM takes it here too)

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
