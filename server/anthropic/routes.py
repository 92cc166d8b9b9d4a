"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

Over the same plumbing as the OpenAI routes (server/generation.py): the conversation is
rendered by the model's chat template, submitted as one engine request, and answered as
an Anthropic message, whole or as server-sent events.

`max_tokens` is an upper bound here, clamped to what the context has room for and to
the server's cap: Claude Code asks for 32000 output tokens whatever the model, and a
local model's context is often smaller than that. The `x-max-tokens-clamped` header names
the value used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from server.anthropic.convert import to_chat
from server.anthropic.message import message_body
from server.anthropic.schemas import CountTokensRequest, MessagesRequest, PromptFields
from server.anthropic.stream import message_events
from server.chat_plan import ChatPlan, plan_chat
from server.errors import NotFound
from server.generation import Generation, gather, prepare
from server.model_pool import serving_state
from server.state import ServerState
from server.tools import FunctionTool, ToolChoice

router = APIRouter()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class _Sampling:
    """The fields `prepare` reads, from an Anthropic request."""

    requested_max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_list: list[str] = field(default_factory=list)
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1


def _check_model(state: ServerState, name: str) -> None:
    if not state.serves(name):
        raise NotFound(
            f"The model '{name}' does not exist; this server serves '{state.model_name}'. "
            "To answer other names with it, start the server with --model-alias NAME=served "
            "(NAME may be a glob such as 'claude-*')",
            code="model_not_found", param="model",
        )


def _tool_choice(body: PromptFields, tools: list[FunctionTool]) -> ToolChoice:
    """Anthropic's tool_choice in the shared terms: `any` is OpenAI's `required`."""
    choice = body.tool_choice
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if choice.type == "tool":
        return ToolChoice("named", choice.name)
    return ToolChoice({"any": "required"}.get(choice.type, choice.type))  # type: ignore[arg-type]


async def _plan(state: ServerState, body: PromptFields, *, counting: bool = False) -> ChatPlan:
    """The prompt through the chat template, the tools in play, and, when a call is
    forced (`any` or a named tool), the grammar that makes the output a valid call.
    Counting tokens needs the same prompt but no grammar."""
    tools = [FunctionTool(t.name, t.description, t.input_schema) for t in body.tools or []]
    choice = _tool_choice(body, tools)
    if counting and choice.forces_call:
        choice = ToolChoice("auto")
    parallel = not (body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use)
    return await plan_chat(state, to_chat(body, state.model_name), tools=tools, choice=choice,
                           parallel_tool_calls=parallel, tools_param="tool_choice")


def _start(state: ServerState, body: MessagesRequest, plan: ChatPlan) -> Generation:
    sampling = _Sampling(
        requested_max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop_list=list(body.stop_sequences or []),
    )
    prepared = prepare(
        prompt_tokens=plan.tokens,
        body=sampling,
        context_length=state.context_length,
        default_max_tokens=state.settings.default_max_tokens,
        max_tokens_cap=state.settings.max_tokens_cap,
        logprobs=False,
        top_logprobs=0,
        new_processor=plan.new_processor,
    )
    return Generation(state.engine, state.tokenizer, prepared,
                      timeout_s=state.settings.request_timeout_s)


@router.post("/v1/messages", response_model=None)
async def create_message(body: MessagesRequest, request: Request) -> JSONResponse | StreamingResponse:
    state = await serving_state(request, body.model, _check_model)
    plan = await _plan(state, body)
    generation = _start(state, body, plan)
    request.state.generation = generation
    if body.stream:
        try:
            first = await generation.first_event()  # a refusal is still a real status
        except BaseException:
            generation.close()
            raise
        return StreamingResponse(
            message_events(generation, first, body.model, plan.parser(), thinking=body.thinking_enabled),
            media_type="text/event-stream", headers={**SSE_HEADERS, **generation.prepared.headers()})
    try:
        await gather(generation, request)
    finally:
        generation.close()
    return JSONResponse(message_body(generation, body.model, plan.parser(), thinking=body.thinking_enabled),
                        headers=generation.prepared.headers())


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    state = await serving_state(request, body.model, _check_model)
    return {"input_tokens": len((await _plan(state, body, counting=True)).tokens)}
