"""Request bodies of Anthropic's Messages API (pydantic, strict, as schemas.py's), and the
conversation they hold as chat-template messages: `tool_use` blocks become an assistant's
`tool_calls`, `tool_result` blocks become `tool` messages, as Hugging Face templates expect.

Content blocks other than text, tool_use and tool_result (images, documents, thinking) are
refused with a 400 naming them rather than dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from ..sampling import SamplingParams
from .schemas import MAX_STOPS, Speculative, ToolName


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        content = self.content
        text = content if isinstance(content, str) else "".join(b.text for b in content)
        return f"Error: {text}" if self.is_error else text


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class InputMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, content: Any) -> Any:
        known = ("text", "tool_use", "tool_result")
        for block in content if isinstance(content, list) else []:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in known:
                raise ValueError(f"content blocks of type {kind!r} are not supported here")
        return content

    def as_template_input(self) -> list[dict[str, Any]]:
        """This message as template messages: a user's tool results become `tool` messages."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        if self.role == "assistant":
            if any(isinstance(b, ToolResultBlock) for b in self.content):
                raise ValueError("tool_result blocks belong in user messages")
            message: dict[str, Any] = {
                "role": "assistant",
                "content": "".join(b.text for b in self.content if isinstance(b, TextBlock)),
            }
            calls = [b for b in self.content if isinstance(b, ToolUseBlock)]
            if calls:
                message["tool_calls"] = [
                    {
                        "id": b.id,
                        "type": "function",
                        "function": {"name": b.name, "arguments": b.input},
                    }
                    for b in calls
                ]
            return [message]
        messages: list[dict[str, Any]] = []
        for block in self.content:
            if isinstance(block, ToolUseBlock):
                raise ValueError("tool_use blocks belong in assistant messages")
            if isinstance(block, ToolResultBlock):
                messages.append(
                    {"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()}
                )
            elif messages and messages[-1]["role"] == "user":
                messages[-1]["content"] += block.text
            else:
                messages.append({"role": "user", "content": block.text})
        return messages


class ToolDefinition(_Body):
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # Anthropic's server tools are not offered here

    def as_template_input(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    format: OutputFormat | None = None  # structured output: the answer is JSON of this schema


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Conversation(_Body):
    """What count_tokens and messages share: the prompt."""

    model: str
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None

    @field_validator("messages")
    @classmethod
    def _ends_with_user(cls, messages: list[InputMessage]) -> list[InputMessage]:
        if messages[-1].role != "user":
            raise ValueError("the last message must be the user's (prefilling is not supported)")
        return messages

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        names = [t.name for t in tools or []]
        if len(set(names)) < len(names):
            raise ValueError("two tools have the same name")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, choice: ToolChoice | None, info: ValidationInfo) -> Any:
        names = [t.name for t in info.data.get("tools") or []]
        if choice is None:
            return choice
        if choice.type != "none" and not names:
            raise ValueError(f"tool_choice {choice.type!r} needs tools")
        if choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not one of the tools")
        return choice

    @property
    def tool_mode(self) -> str:
        """ "none", "auto", "any" or "tool" (the one tool_choice names)."""
        if self.tool_choice is not None:
            return self.tool_choice.type
        return "auto" if self.tools else "none"

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat-template messages; a ValueError for a misplaced block."""
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system
            text = system if isinstance(system, str) else "".join(b.text for b in system)
            messages.append({"role": "system", "content": text})
        for message in self.messages:
            messages.extend(message.as_template_input())
        return messages

    def template_tools(self) -> list[dict[str, Any]]:
        return [tool.as_template_input() for tool in self.tools or []]


class MessagesRequest(Conversation):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False
    output_config: OutputConfig | None = None
    speculative: Speculative | None = None  # the extension the OpenAI routes take too

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, stops: list[str] | None) -> list[str] | None:
        if len(stops or []) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops or [])}")
        if any(s == "" for s in stops or []):
            raise ValueError("stop sequences must not be empty")
        return stops

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p or 1.0, self.top_k or 0)

    def stops(self) -> list[str]:
        return list(self.stop_sequences or [])

    def token_limit(self) -> int:
        return self.max_tokens

    def top_count(self) -> None:
        return None
