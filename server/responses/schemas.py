"""Request body of POST /v1/responses.

Only what this server acts on is validated. `input` items and `tools` are read by
`items.py` and `toolset.py`, which skip what they do not know instead of refusing it, and
unknown top-level fields are accepted: agents send many (`include`, `prompt_cache_key`,
`reasoning`, `service_tier`, `client_metadata`, ...). `ignored_fields` names them for the log.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.schemas import _drop_nulls

# Fields this server refuses rather than ignores (a 400 names the field): each changes
# what the request means, and this server cannot do it.
UNSUPPORTED = ("background", "conversation", "prompt")


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def public(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "json_schema":
            out.update(name=self.name or "response", schema=self.schema_ or {}, strict=bool(self.strict),
                       description=self.description)
        return out


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    input: str | list[Any] = ""
    instructions: str | None = None
    tools: list[Any] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    text: TextConfig = Field(default_factory=TextConfig)
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None

    _nulls = model_validator(mode="before")(_drop_nulls)

    def unsupported(self) -> str | None:
        extra = self.model_extra or {}
        return next((name for name in UNSUPPORTED if extra.get(name) not in (None, False)), None)

    def ignored_fields(self) -> list[str]:
        return sorted(name for name in (self.model_extra or {}) if name not in UNSUPPORTED)

    def items(self) -> list[Any]:
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}] if self.input else []
        return list(self.input)
