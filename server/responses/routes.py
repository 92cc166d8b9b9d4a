"""POST /v1/responses (and GET/DELETE of stored responses): OpenAI's Responses API over
the same generation plumbing as chat completions.

A request's tools become template functions (`toolset.py`), its input items a chat
conversation (`items.py`); it goes through `plan_chat` (template, tools, grammar) and
`Generation` like a chat request with n=1, and its output is parsed for tool calls into
`message`, `function_call` and `custom_tool_call` items. What the server cannot use
(hosted tools, unknown item types and fields) is skipped and named in the log, never
refused.

Streaming holds the HTTP status for up to `HOLD_S` while the request is admitted, so a
quick refusal (memory, queue) is a real status; then `response.created` goes out even if
the first token is still far off (a long prompt prefills for a while, and agents give up
on a silent stream), with `response.in_progress` every `HEARTBEAT_S` until it comes.
Errors after that end the stream with `response.failed`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from server import fastjson
from server.chat_plan import plan_chat
from server.errors import BadRequest, NotFound, from_engine_error
from server.generation import Generation, gather, prepare
from server.model_pool import check_served_model, serving_state
from server.responses.builder import ResponseBuilder
from server.responses.items import Conversation, ImageOnlyInput, to_conversation
from server.responses.schemas import ResponsesRequest
from server.responses.store import ResponseStore
from server.responses.toolset import Toolset
from server.state import get_state
from server.structured import response_format_grammar

router = APIRouter()
log = logging.getLogger("mlx_headroom.server.responses")

HOLD_S = 2.0  # how long a stream waits for admission before it starts without a token
HEARTBEAT_S = 10.0  # response.in_progress while the first token is awaited

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


def _log_ignored(body: ResponsesRequest, toolset: Toolset, conv: Conversation) -> None:
    """Names of what was skipped, never text."""
    ignored = {f"field:{name}" for name in body.ignored_fields()}
    ignored |= {f"tool:{kind}" for kind in toolset.ignored}
    ignored |= {f"input:{kind}" for kind in conv.ignored}
    if conv.images_dropped:
        ignored.add(f"images:{conv.images_dropped}")
    if ignored:
        log.info("/v1/responses: ignored %s", ", ".join(sorted(ignored)))


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
    toolset = Toolset.build(body.tools)
    try:
        conv = to_conversation(body.items(), toolset)
    except ImageOnlyInput as exc:
        raise BadRequest(str(exc), code="image_input_unsupported", param="input") from exc
    choice = toolset.choice(body.tool_choice)
    _log_ignored(body, toolset, conv)
    conversation = history + conv.messages
    system_texts = [t for t in [body.instructions, *conv.system] if t]
    if not conversation and system_texts:  # only developer text: it is the request
        conversation, system_texts = [{"role": "user", "content": "\n\n".join(system_texts)}], []
    if not conversation:
        raise BadRequest("input is empty, and there are no instructions or previous response to "
                         "answer instead", code="empty_input", param="input")
    # Instructions do not carry over to a continuation: they are not stored.
    system = [{"role": "system", "content": "\n\n".join(system_texts)}] if system_texts else []
    fmt = body.text.format
    grammar = response_format_grammar(fmt.type, fmt.schema_, param="text.format")
    plan = await plan_chat(state, system + conversation, tools=toolset.functions, choice=choice,
                           parallel_tool_calls=body.parallel_tool_calls, response_format=grammar,
                           messages_param="input", format_param="text.format")
    prepared = prepare(
        prompt_tokens=plan.tokens, body=_Sampling(body.max_output_tokens, body.temperature, body.top_p),
        # No max_output_tokens (Codex sends none) means up to the room left, as at OpenAI: the
        # server's default_max_tokens would cut a long answer short and fail the agent's turn.
        context_length=state.context_length, default_max_tokens=state.settings.max_tokens_cap,
        max_tokens_cap=state.settings.max_tokens_cap, logprobs=False, top_logprobs=0,
        new_processor=plan.new_processor, prompt_param="input",
    )
    generation = Generation(state.engine, state.tokenizer, prepared,
                            timeout_s=state.settings.request_timeout_s)
    request.state.generation = generation
    parser = plan.parser()
    builder = ResponseBuilder(body, body.model, parser, toolset,
                              reasoning_tokens=lambda: parser.reasoning_tokens(state.tokenizer))

    def remember() -> None:
        if body.store:
            store.put(builder.snapshot(), conversation + builder.conversation())

    if body.stream:
        first = asyncio.ensure_future(generation.first_event())
        await asyncio.wait({first}, timeout=HOLD_S)
        if first.done() and first.exception() is not None:
            generation.close()
            raise first.exception()  # type: ignore[misc]
        return StreamingResponse(_stream(generation, builder, first, remember),
                                 media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **prepared.headers()})

    try:
        await gather(generation, request)
    finally:
        generation.close()
    result = generation.choices[0]
    builder.feed(result.text.text, final=True)
    builder.finish(result.finish_reason, generation.usage())
    remember()
    return JSONResponse(builder.snapshot(), headers=prepared.headers())


async def _stream(generation: Generation, builder: ResponseBuilder, first: asyncio.Future[Any],
                  remember: Callable[[], None]) -> AsyncIterator[bytes]:
    try:
        for event in builder.start():
            yield _sse(event)
        while not first.done():
            await asyncio.wait({first}, timeout=HEARTBEAT_S)
            if not first.done():
                yield _sse(builder.heartbeat())

        async def events() -> AsyncIterator[Any]:
            head = first.result()
            if head is not None:
                yield head
            async for item in generation.rest():
                yield item

        async for _choice, delta, finish in events():
            for event in builder.feed(delta.text, final=finish is not None):
                yield _sse(event)
            if finish is not None:
                for event in builder.finish(finish, generation.usage()):
                    yield _sse(event)
                remember()
    except Exception as exc:
        for event in builder.fail(from_engine_error(exc)):
            yield _sse(event)
    finally:
        first.cancel()
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
