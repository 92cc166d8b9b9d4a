"""Request bodies of Anthropic's Messages API, validated by pydantic.

Tolerance is the point: clients such as Claude Code add fields and content-block types
faster than any server follows. Unknown fields and unknown block types are dropped with a
debug log (names only, never text), so they never turn into a 400. What we know is
checked strictly, and what we know but cannot serve (images, PDFs) is refused later, by
name, in convert.py. `cache_control` is accepted on every block and ignored: the prefix
cache reuses shared prefixes by itself.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

log = logging.getLogger("mlx_headroom.anthropic")

MAX_STOP_SEQUENCES = 16


def _known_blocks(value: Any, known: frozenset[str], where: str) -> Any:
    """Drop content blocks of types we do not know; leave everything else to validation."""
    if not isinstance(value, list):
        return value
    kept = []
    for block in value:
        kind = block.get("type") if isinstance(block, dict) else None
        # A non-string type is malformed, not unknown: validation refuses it with a 400.
        if isinstance(block, dict) and isinstance(kind, str) and kind not in known:
            log.debug("ignoring a content block of unknown type %r in %s", kind, where)
            continue
        kept.append(block)
    return kept


class _Lenient(BaseModel):
    """Unknown fields are ignored, and said so at debug level."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _note_unknown(cls, data: Any) -> Any:
        if isinstance(data, dict) and log.isEnabledFor(logging.DEBUG):
            unknown = sorted(set(data) - set(cls.model_fields) - {"cache_control"})
            if unknown:
                log.debug("ignoring unknown fields %s in %s", unknown, cls.__name__)
        return data


class TextBlock(_Lenient):
    type: Literal["text"]
    text: str


class ImageBlock(_Lenient):
    type: Literal["image"]
    source: dict[str, Any] | None = None


class DocumentBlock(_Lenient):
    type: Literal["document"]
    source: dict[str, Any] | None = None
    title: str | None = None


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


ResultPart = Annotated[TextBlock | ImageBlock | DocumentBlock, Field(discriminator="type")]
RESULT_PART_TYPES = frozenset({"text", "image", "document"})


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ResultPart] | None = None
    is_error: bool = False

    @field_validator("content", mode="before")
    @classmethod
    def _drop_unknown(cls, value: Any) -> Any:
        return _known_blocks(value, RESULT_PART_TYPES, "a tool_result")


class ThinkingBlock(_Lenient):
    type: Literal["thinking"]
    thinking: str = ""
    signature: str | None = None


class RedactedThinkingBlock(_Lenient):
    type: Literal["redacted_thinking"]
    data: str = ""


ContentBlock = Annotated[
    TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
    | RedactedThinkingBlock,
    Field(discriminator="type"),
]
BLOCK_TYPES = frozenset(
    {"text", "image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking"}
)


class Message(_Lenient):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _drop_unknown(cls, value: Any) -> Any:
        return _known_blocks(value, BLOCK_TYPES, "a message")


class Tool(_Lenient):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs the tool's name")
        return self


class PromptFields(_Lenient):
    """What makes the prompt: shared by /v1/messages and /v1/messages/count_tokens."""

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _drop_unknown_system(cls, value: Any) -> Any:
        return _known_blocks(value, frozenset({"text"}), "system")

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools_only(cls, value: Any) -> Any:
        """Server tools (web search, code execution: typed, without input_schema) run at
        Anthropic; we have none, so they are left out rather than refused."""
        if not isinstance(value, list):
            return value
        kept = []
        for tool in value:
            if isinstance(tool, dict) and tool.get("type") not in (None, "custom"):
                log.debug("ignoring a server tool of type %r", tool.get("type"))
                continue
            kept.append(tool)
        return kept


class MessagesRequest(PromptFields):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    metadata: dict[str, Any] | None = None
    stream: bool = False
    thinking: dict[str, Any] | None = None  # the served model decides whether it thinks

    @property
    def thinking_enabled(self) -> bool:
        """Whether the client wants the model's thinking as `thinking` blocks."""
        return isinstance(self.thinking, dict) and self.thinking.get("type") in ("enabled", "adaptive")

    @field_validator("stop_sequences")
    @classmethod
    def _check_stops(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        if len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(s == "" for s in value):
            raise ValueError("stop sequences must not be empty")
        return value


class CountTokensRequest(PromptFields):
    pass
