"""Request body of POST /v1/responses, and its translation into a chat conversation.

Input items map onto chat messages the chat template already knows: messages stay
messages, consecutive `function_call` items become one assistant turn with `tool_calls`,
and `function_call_output` items become `tool` messages.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.schemas import _drop_nulls
from server.tools import FunctionTool, ToolChoice

# Fields this server refuses rather than ignores (a 400 names the field).
UNSUPPORTED = ("background", "conversation", "prompt")


class InputText(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = ""
    id: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(BaseModel):
    """A reasoning item a client echoes back from another server's output: skipped (this
    server produces none, and the template has no place for it)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning"]


InputItem = FunctionCallItem | FunctionCallOutputItem | ReasoningItem | MessageItem


class FunctionToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str


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
    input: str | list[InputItem] = ""
    instructions: str | None = None
    tools: list[FunctionToolDef] = Field(default_factory=list)
    tool_choice: Literal["auto", "none", "required"] | NamedFunctionChoice = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    text: TextConfig = Field(default_factory=TextConfig)
    stream: bool = False
    store: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    _nulls = model_validator(mode="before")(_drop_nulls)

    def unsupported(self) -> str | None:
        extra = self.model_extra or {}
        return next((name for name in UNSUPPORTED if extra.get(name) not in (None, False)), None)

    def function_tools(self) -> list[FunctionTool]:
        return [FunctionTool(t.name, t.description, t.parameters, bool(t.strict)) for t in self.tools]

    def choice(self) -> ToolChoice:
        if isinstance(self.tool_choice, NamedFunctionChoice):
            return ToolChoice("named", self.tool_choice.name)
        if self.tool_choice == "auto" and not self.tools:
            return ToolChoice("none")
        return ToolChoice(self.tool_choice)

    def messages(self) -> list[dict[str, Any]]:
        """This request's own input as chat messages (instructions are added by the route)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}] if self.input else []
        return items_to_messages(self.input)


def items_to_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": item.text()})
        elif isinstance(item, ReasoningItem):
            continue
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out
