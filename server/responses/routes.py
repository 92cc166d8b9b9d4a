"""POST /v1/responses (and GET/DELETE of stored responses): OpenAI's Responses API over
the same generation plumbing as chat completions.

A request becomes a chat conversation (`schemas.items_to_messages`), goes through
`plan_chat` (template, tools, grammar) and `Generation` like a chat request with n=1,
and its output is parsed for tool calls into `message` and `function_call` items.
Streaming holds the HTTP status until the first token or a refusal, so a memory refusal
is a real 507 before any event; then the documented events follow in order, each with
its `sequence_number`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from server import fastjson
from server.chat_plan import plan_chat
from server.errors import APIError, BadRequest, NotFound
from server.generation import Generation, gather, prepare
from server.model_pool import check_served_model, serving_state
from server.responses.builder import ResponseBuilder
from server.responses.schemas import ResponsesRequest
from server.responses.store import ResponseStore
from server.state import get_state
from server.structured import response_format_grammar

router = APIRouter()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class _Sampling:
    """The fields `prepare` reads, from a Responses request."""

    requested_max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_list: list[str] = field(default_factory=list)
    n: int = 1

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return ()


def _store(request: Request) -> ResponseStore:
    app_state = request.app.state
    store: ResponseStore | None = getattr(app_state, "responses_store", None)
    if store is None:
        settings = get_state(request).settings
        store = ResponseStore(max_entries=settings.responses_store_entries,
                              max_bytes=settings.responses_store_bytes)
        app_state.responses_store = store
    return store


def _sse(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + fastjson.dumps(event) + b"\n\n"


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> JSONResponse | StreamingResponse:
    state = await serving_state(request, body.model, check_served_model)
    name = body.unsupported()
    if name is not None:
        raise BadRequest(f"'{name}' is not supported by this server", code="unsupported_parameter",
                         param=name)
    store = _store(request)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise BadRequest(
                f"Previous response with id '{body.previous_response_id}' not found: this server keeps "
                f"only responses created with store=true, in memory, up to "
                f"{store.max_entries} entries and {store.max_bytes} bytes",
                code="previous_response_not_found", param="previous_response_id",
            )
        history = list(previous.conversation)
    conversation = history + body.messages()
    if not conversation:
        raise BadRequest("input is empty", param="input")
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages = system + conversation  # instructions do not carry over to a continuation
    fmt = body.text.format
    grammar = response_format_grammar(fmt.type, fmt.schema_, param="text.format")
    plan = await plan_chat(state, messages, tools=body.function_tools(), choice=body.choice(),
                           parallel_tool_calls=body.parallel_tool_calls, response_format=grammar,
                           messages_param="input", format_param="text.format")
    prepared = prepare(
        prompt_tokens=plan.tokens, body=_Sampling(body.max_output_tokens, body.temperature, body.top_p),
        context_length=state.context_length, default_max_tokens=state.settings.default_max_tokens,
        max_tokens_cap=state.settings.max_tokens_cap, logprobs=False, top_logprobs=0,
        new_processor=plan.new_processor,
    )
    generation = Generation(state.engine, state.tokenizer, prepared,
                            timeout_s=state.settings.request_timeout_s)
    request.state.generation = generation
    builder = ResponseBuilder(body, body.model, plan.parser())

    def remember() -> None:
        if body.store:
            store.put(builder.snapshot(), conversation + builder.conversation())

    if body.stream:
        try:
            first = await generation.first_event()
        except BaseException:
            generation.close()
            raise
        return StreamingResponse(_stream(generation, builder, first, remember),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    try:
        await gather(generation, request)
    finally:
        generation.close()
    result = generation.choices[0]
    builder.feed(result.text.text, final=True)
    builder.finish(result.finish_reason, generation.usage())
    remember()
    return JSONResponse(builder.snapshot())


async def _stream(generation: Generation, builder: ResponseBuilder, first: Any,
                  remember: Any) -> AsyncIterator[bytes]:
    try:
        for event in builder.start():
            yield _sse(event)

        async def events() -> AsyncIterator[Any]:
            if first is not None:
                yield first
            async for item in generation.rest():
                yield item

        async for _choice, delta, finish in events():
            for event in builder.feed(delta.text, final=finish is not None):
                yield _sse(event)
            if finish is not None:
                for event in builder.finish(finish, generation.usage()):
                    yield _sse(event)
                remember()
    except APIError as exc:
        error = exc.body()["error"]
        yield _sse({"type": "error", "sequence_number": builder.sequence, "code": error["code"],
                    "message": error["message"], "param": error["param"]})
    finally:
        generation.close()


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    entry = _store(request).get(response_id)
    if entry is None:
        raise NotFound(f"Response with id '{response_id}' not found", code="response_not_found")
    return entry.response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    if not _store(request).delete(response_id):
        raise NotFound(f"Response with id '{response_id}' not found", code="response_not_found")
    return {"id": response_id, "object": "response", "deleted": True}
