"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine import TokenLogprob
from server import anthropic
from server.errors import APIError, BadRequest, NotFound
from server.generation import ChoiceResult, Generation, gather, prepare
from server.schemas import ChatCompletionRequest, CompletionRequest
from server.state import ServerState, get_state
from server.text_stream import TextDelta

router = APIRouter()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _check_model(state: ServerState, name: str) -> None:
    if not state.serves(name):
        raise NotFound(
            f"The model '{name}' does not exist; this server serves '{state.model_name}'",
            code="model_not_found", param="model",
        )


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token])


def _chat_logprobs(tokenizer: Any, items: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in items
        ]
    }


def _completion_logprobs(tokenizer: Any, items: list[TokenLogprob], offset: int) -> dict[str, Any]:
    tokens, values, tops, offsets = [], [], [], []
    for lp in items:
        text = _token_text(tokenizer, lp.token)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({_token_text(tokenizer, t): v for t, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


async def _tokenize_chat(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    chars = sum(len(m["content"]) for m in messages)
    state.check_prompt_size(len(messages), chars)
    tokenizer = state.tokenizer

    def run() -> list[int]:
        if tokenizer.has_chat_template:
            return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
        return list(tokenizer.encode(text))

    try:
        return await asyncio.to_thread(run)
    except Exception as exc:
        raise BadRequest(f"the messages could not be formatted: {exc}", param="messages") from exc


async def _tokenize_prompt(state: ServerState, body: CompletionRequest) -> list[int]:
    if isinstance(body.prompt, list):
        vocab = state.vocab_size
        bad = next((t for t in body.prompt if t >= vocab), None)
        if bad is not None:
            raise BadRequest(
                f"token id {bad} is outside the vocabulary (size {vocab})", param="prompt"
            )
        return list(body.prompt)
    state.check_prompt_size(1, len(body.prompt))
    return list(await asyncio.to_thread(state.tokenizer.encode, body.prompt))


def _start(state: ServerState, body: Any, tokens: list[int], logprobs: bool, top: int) -> Generation:
    prepared = prepare(
        prompt_tokens=tokens,
        body=body,
        context_length=state.context_length,
        default_max_tokens=state.settings.default_max_tokens,
        max_tokens_cap=state.settings.max_tokens_cap,
        logprobs=logprobs,
        top_logprobs=top,
    )
    return Generation(state.engine, state.tokenizer, prepared,
                      timeout_s=state.settings.request_timeout_s)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request
) -> JSONResponse | StreamingResponse:
    state = get_state(request)
    _check_model(state, body.model)
    tokens = await _tokenize_chat(state, body)
    generation = _start(state, body, tokens, body.logprobs, body.top_logprobs or 0)
    request.state.generation = generation
    tokenizer = state.tokenizer

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        payload: dict[str, Any] = {
            "id": f"chatcmpl-{generation.id}",
            "object": "chat.completion.chunk",
            "created": generation.created,
            "model": body.model,
            "choices": choices,
        }
        if body.stream_options and body.stream_options.include_usage:
            payload["usage"] = usage
        return _sse(payload)

    if body.stream:
        first = await _first_or_error(generation)

        def event(choice: ChoiceResult, delta: TextDelta, finish: str | None) -> bytes:
            return chunk([{
                "index": choice.index,
                "delta": {"content": delta.text} if delta.text else {},
                "logprobs": _chat_logprobs(tokenizer, delta.logprobs) if body.logprobs else None,
                "finish_reason": finish,
            }])

        role = chunk([
            {"index": c.index, "delta": {"role": "assistant", "content": ""},
             "logprobs": None, "finish_reason": None}
            for c in generation.choices
        ])
        wants_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _event_stream(generation, first, event, prelude=role,
                             usage=(lambda: chunk([], generation.usage())) if wants_usage else None)

    try:
        await gather(generation, request)
    finally:
        generation.close()

    def message(c: ChoiceResult) -> dict[str, Any]:
        return {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text.text},
            "logprobs": _chat_logprobs(tokenizer, c.logprobs) if body.logprobs else None,
            "finish_reason": c.finish_reason,
        }

    return JSONResponse({
        "id": f"chatcmpl-{generation.id}",
        "object": "chat.completion",
        "created": generation.created,
        "model": body.model,
        "choices": [message(c) for c in generation.choices],
        "usage": generation.usage(),
    })


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    state = get_state(request)
    _check_model(state, body.model)
    tokens = await _tokenize_prompt(state, body)
    want_logprobs = body.logprobs is not None
    generation = _start(state, body, tokens, want_logprobs, body.logprobs or 0)
    request.state.generation = generation
    tokenizer = state.tokenizer
    offsets = [0] * body.n

    def payload(choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": f"cmpl-{generation.id}",
            "object": "text_completion",
            "created": generation.created,
            "model": body.model,
            "choices": choices,
        }
        if usage is not None or not body.stream:
            out["usage"] = usage
        elif body.stream_options and body.stream_options.include_usage:
            out["usage"] = None
        return out

    def logprobs_for(index: int, items: list[TokenLogprob]) -> dict[str, Any] | None:
        if not want_logprobs:
            return None
        result = _completion_logprobs(tokenizer, items, offsets[index])
        offsets[index] += sum(len(t) for t in result["tokens"])
        return result

    if body.stream:
        first = await _first_or_error(generation)

        def event(choice: ChoiceResult, delta: TextDelta, finish: str | None) -> bytes:
            return _sse(payload([{
                "index": choice.index,
                "text": delta.text,
                "logprobs": logprobs_for(choice.index, delta.logprobs),
                "finish_reason": finish,
            }], None))

        wants_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _event_stream(generation, first, event,
                             usage=(lambda: _sse(payload([], generation.usage()))) if wants_usage else None)

    try:
        await gather(generation, request)
    finally:
        generation.close()
    prefix = body.prompt if body.echo and isinstance(body.prompt, str) else ""
    return JSONResponse(payload([
        {
            "index": c.index,
            "text": prefix + c.text.text,
            "logprobs": logprobs_for(c.index, c.logprobs),
            "finish_reason": c.finish_reason,
        }
        for c in generation.choices
    ], generation.usage()))


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = get_state(request)
    if "anthropic-version" in request.headers:
        return anthropic.model_list(state)
    return {
        "object": "list",
        "data": [{
            "id": state.model_name,
            "object": "model",
            "created": state.started_at,
            "owned_by": "mlx-headroom",
            "context_length": state.context_length if state.ready else None,
        }],
    }


def _event_stream(
    generation: Generation,
    first: Any,
    event: Callable[[ChoiceResult, TextDelta, str | None], bytes],
    *,
    prelude: bytes | None = None,
    usage: Callable[[], bytes] | None = None,
) -> StreamingResponse:
    """SSE for a generation whose first event has arrived: its events, the usage chunk if
    asked for, an error event if it fails midway, then `[DONE]`; closing aborts it."""

    async def stream() -> AsyncIterator[bytes]:
        try:
            if prelude is not None:
                yield prelude
            async for choice, delta, finish in _chain(first, generation):
                if delta.text or finish is not None or delta.logprobs:
                    yield event(choice, delta, finish)
            if usage is not None:
                yield usage()
        except APIError as exc:
            yield _sse(exc.body())
        finally:
            generation.close()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)


async def _first_or_error(generation: Generation) -> Any:
    try:
        return await generation.first_event()
    except BaseException:
        generation.close()
        raise


async def _chain(first: Any, generation: Generation) -> AsyncIterator[Any]:
    if first is not None:
        yield first
    async for event in generation.rest():
        yield event
