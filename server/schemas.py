"""Request bodies of the OpenAI-compatible API, validated by pydantic.

Unknown fields are accepted and ignored, as OpenAI-compatible servers do, so that SDKs
sending newer fields keep working; known fields are checked strictly. A field sent as
`null` counts as absent (OpenAI's spec marks most of them nullable). The fields we
cannot honour and refuse are listed in `UNSUPPORTED_CHAT_FIELDS`; the README's table
says which others are ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

MAX_STOP_SEQUENCES = 16
MAX_N = 8
MAX_BATCH_CHOICES = 64  # prompts in one /v1/completions batch
DEFAULT_PROMPT = "<|endoftext|>"


class TextPart(BaseModel):
    """A content part. Text is read; an assistant's `refusal` part reads as its text;
    any other kind (image_url, input_audio, file) is refused by `ChatMessage`."""

    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None
    refusal: str | None = None

    def value(self) -> str:
        return self.text if self.type == "text" else (self.refusal or "")


READABLE_PARTS = ("text", "refusal")


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str = ""


class ToolCallIn(BaseModel):
    """A call the assistant made earlier in the conversation."""

    model_config = ConfigDict(extra="ignore")
    id: str = ""
    type: Literal["function"] = "function"  # OpenAI's "custom" tools are not supported
    function: FunctionCallIn


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="after")
    @classmethod
    def _text_only(cls, value: str | list[TextPart] | None) -> str | list[TextPart] | None:
        if isinstance(value, list):
            for part in value:
                if part.type not in READABLE_PARTS:
                    raise ValueError(f"content parts of type '{part.type}' are not supported: this "
                                     "server reads text only")
                if part.type == "text" and part.text is None:
                    raise ValueError("a text content part needs 'text'")
        return value

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it (developer reads as system)."""
        # developer reads as system; the deprecated `function` role as a tool result
        role = {"developer": "system", "function": "tool"}.get(self.role, self.role)
        out: dict[str, Any] = {"role": role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.value() for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


def _drop_nulls(data: Any) -> Any:
    """`"field": null` means "not given": the defaults apply."""
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if v is not None}
    return data


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="allow")  # extras are ignored, but seen by `unsupported`
    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0: no generation (completions score the prompt)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)  # 0 keeps only the most likely token
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    user: str | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None

    _nulls = model_validator(mode="before")(_drop_nulls)

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids; got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values lie in [-100, 100]; got {bias}")
        return value

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    def unsupported(self) -> str | None:
        """The first field sent that this server refuses rather than ignores."""
        for name, check in UNSUPPORTED_FIELDS.items():
            value = (self.model_extra or {}).get(name)
            if value is not None and check(value):
                return name
        return None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        return [s for s in stops if s]  # an empty stop string can never match: ignored

    @property
    def stop_list(self) -> list[str]:
        return list(self.stop or [])


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _check_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        # A field validator (not a model one), so the 400 names `top_logprobs` as its param.
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingFields):
    # One prompt (text or token ids) or a batch of them, one choice (times n) per prompt.
    # Absent, null or "": OpenAI's documented default, "<|endoftext|>".
    prompt: str | list[int] | list[str] | list[list[int]] = Field(DEFAULT_PROMPT, min_length=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    # Fill-in-the-middle: the text after the completion; the model writes what goes between
    # the prompt and it, when its tokenizer has the markers for it (engine.fim).
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if value == "":
            return DEFAULT_PROMPT
        for p in cls._as_batch(value):
            if len(p) == 0:
                raise ValueError("a prompt must not be empty")
            if isinstance(p, list) and any(t < 0 for t in p):
                raise ValueError("token ids must be non-negative")
        if len(cls._as_batch(value)) > MAX_BATCH_CHOICES:
            raise ValueError(f"at most {MAX_BATCH_CHOICES} prompts in one request")
        return value

    @staticmethod
    def _as_batch(value: Any) -> list[str | list[int]]:
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]
        return list(value)

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request as a batch (one element when a single prompt)."""
        return self._as_batch(self.prompt)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


def _always(_: Any) -> bool:
    return True


def _not_text_only(value: Any) -> bool:
    return not (isinstance(value, list) and all(m == "text" for m in value))


# Fields OpenAI defines that this server cannot honour: refused with a 400 naming the
# field (as vLLM does), rather than silently ignored, because ignoring them would change
# what the client gets back. The check decides per value (modalities ["text"] is fine).
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "audio": _always,
    "modalities": _not_text_only,
    "web_search_options": _always,
    "prediction": _always,
    "functions": _always,
    "function_call": _always,
}


class MemoryGuardUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool | None = None
    tier: Literal["safe", "balanced", "aggressive", "custom"] | None = None
    ceiling_bytes: int | None = Field(None, gt=0)
