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

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from server.chat_plan import plan_chat
from server.errors import APIError, BadRequest, NotFound
from server.generation import Generation, gather, prepare
from server.responses.schemas import ResponsesRequest
from server.responses.store import ResponseStore
from server.state import get_state
from server.structured import response_format_grammar
from server.tools import ArgumentsDelta, CallDone, CallStarted, ContentText, ParseEvent, ToolCallParser

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


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """The response object and its output items, built as the text arrives; with
    `events` on, also the stream's events in order, numbered."""

    def __init__(self, body: ResponsesRequest, model: str, parser: ToolCallParser | None) -> None:
        self.body = body
        self.model = model
        self.parser = parser
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.sequence = 0
        self._message: dict[str, Any] | None = None  # the open message item, if any
        self._calls: dict[str, dict[str, Any]] = {}  # function_call items still streaming
        self.status = "in_progress"
        self.incomplete: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None

    # -- the response object -------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        body = self.body
        choice = body.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "background": False,
            "error": None,
            "incomplete_details": self.incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": [dict(item) for item in self.output],
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store,
            "temperature": body.temperature,
            "text": {"format": body.text.format.public()},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [{**t.model_dump(), "strict": bool(t.strict)} for t in body.tools],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": self.usage,
            "metadata": body.metadata or {},
            "user": body.user,
        }

    def output_text(self) -> str:
        return "".join(
            part["text"] for item in self.output if item["type"] == "message" for part in item["content"]
        )

    def conversation(self) -> list[dict[str, Any]]:
        """This output as chat messages, for a later previous_response_id."""
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.output if i["type"] == "function_call"]
        message: dict[str, Any] = {"role": "assistant", "content": self.output_text()}
        if calls:
            message["tool_calls"] = calls
        return [message]

    # -- events ----------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.snapshot()),
                self._event("response.in_progress", response=self.snapshot())]

    def feed(self, text: str, *, final: bool = False) -> list[dict[str, Any]]:
        if self.parser is None:
            parsed: list[ParseEvent] = [ContentText(text)] if text else []
        else:
            piece = self.parser.feed(text)
            if final:
                piece.extend(self.parser.finish())
            parsed = piece.events
        events: list[dict[str, Any]] = []
        for item in parsed:
            if isinstance(item, ContentText):
                events += self._text(item.text)
            elif isinstance(item, CallStarted):
                events += self._close_message()
                events += self._call_started(item)
            elif isinstance(item, ArgumentsDelta):
                events += self._arguments(item)
            else:
                events += self._call_done(item)
        return events

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._message is None:
            self._message = {"type": "message", "id": _new_id("msg"), "status": "in_progress",
                             "role": "assistant", "content": []}
            self.output.append(self._message)
            index = len(self.output) - 1
            events.append(self._event("response.output_item.added", output_index=index,
                                      item={**self._message, "content": []}))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._message["content"].append(part)
            events.append(self._event("response.content_part.added", item_id=self._message["id"],
                                      output_index=index, content_index=0, part=dict(part)))
        self._message["content"][0]["text"] += text
        events.append(self._event("response.output_text.delta", item_id=self._message["id"],
                                  output_index=self.output.index(self._message), content_index=0,
                                  delta=text, logprobs=[]))
        return events

    def _close_message(self) -> list[dict[str, Any]]:
        message = self._message
        if message is None:
            return []
        self._message = None
        index = self.output.index(message)
        part = message["content"][0]
        message["status"] = "completed"
        return [
            self._event("response.output_text.done", item_id=message["id"], output_index=index,
                        content_index=0, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", item_id=message["id"], output_index=index,
                        content_index=0, part=dict(part)),
            self._event("response.output_item.done", output_index=index,
                        item={**message, "content": [dict(part)]}),
        ]

    def _call_started(self, started: CallStarted) -> list[dict[str, Any]]:
        item = {"type": "function_call", "id": _new_id("fc"), "call_id": started.call_id,
                "name": started.name, "arguments": "", "status": "in_progress"}
        self.output.append(item)
        self._calls[started.call_id] = item
        return [self._event("response.output_item.added", output_index=len(self.output) - 1,
                            item=dict(item))]

    def _arguments(self, delta: ArgumentsDelta) -> list[dict[str, Any]]:
        item = self._calls[delta.call_id]
        item["arguments"] += delta.delta
        return [self._event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=self.output.index(item), delta=delta.delta)]

    def _call_done(self, done: CallDone) -> list[dict[str, Any]]:
        item = self._calls.pop(done.call.id)
        item["status"] = "completed"
        index = self.output.index(item)
        return [
            self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        name=item["name"], arguments=item["arguments"]),
            self._event("response.output_item.done", output_index=index, item=dict(item)),
        ]

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close_message()
        prompt = usage["prompt_tokens"]
        self.usage = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        }
        if finish_reason == "length":
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
            events.append(self._event("response.incomplete", response=self.snapshot()))
        else:
            self.status = "completed"
            events.append(self._event("response.completed", response=self.snapshot()))
        return events


def _sse(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> JSONResponse | StreamingResponse:
    state = get_state(request)
    if not state.serves(body.model):
        raise NotFound(f"The model '{body.model}' does not exist; this server serves '{state.model_name}'",
                       code="model_not_found", param="model")
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
