"""OpenAI-compatible routes: /v1/chat/completions and /v1/completions (the models list is
`server.models_routes`')."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine import TokenLogprob
from engine.fim import FimTokens, encode_text, fim_tokens
from server import fastjson
from server.chat_plan import ChatPlan, plan_chat
from server.errors import APIError, BadRequest, NotFound
from server.generation import ChoiceResult, Generation, gather, prepare
from server.model_pool import check_served_model, serving_state
from server.reasoning import ReasoningText
from server.schemas import ChatCompletionRequest, CompletionRequest
from server.state import ServerState
from server.structured import ProcessorFactory, Shaping, check_logit_bias, response_format_grammar
from server.text_stream import TextDelta
from server.tools import (
    ArgumentsDelta,
    CallStarted,
    ContentText,
    FunctionTool,
    ToolCall,
    ToolChoice,
)

router = APIRouter()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + fastjson.dumps(payload) + b"\n\n"


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
        ],
        "refusal": None,
    }


def _completion_logprobs(tokenizer: Any, items: Sequence[TokenLogprob | None], offset: int,
                         prompt: Sequence[int] = (), starts: Sequence[int] | None = None) -> dict[str, Any]:
    """The legacy completions shape. `top_logprobs` holds the `logprobs` most likely tokens
    and the sampled one, as OpenAI's does (so `logprobs: 0` gives the sampled token alone).
    A scored prompt's entries come first; its first token has nothing before it: null.
    `starts`: each token's offset into the echoed text where the tokenizer knows it."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for i, lp in enumerate(items):
        text = _token_text(tokenizer, lp.token if lp is not None else prompt[i])
        tokens.append(text)
        offsets.append(starts[i] if starts is not None else offset)
        offset += len(text)
        if lp is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(lp.logprob)
        top = {_token_text(tokenizer, t): v for t, v in lp.top}
        top.setdefault(text, lp.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _text_starts(tokenizer: Any, text: str, tokens: Sequence[int]) -> list[int] | None:
    """Where each token of `text` starts in it, from the tokenizer's own offsets (a special
    token it adds, such as BOS, starts where the next one does); None where the tokenizer
    gives none or tokenises differently."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        encoded = inner(text, return_offsets_mapping=True)
    except Exception:  # a tokenizer without offsets
        return None
    if list(encoded["input_ids"]) != list(tokens):
        return None
    spans = list(encoded["offset_mapping"])
    starts: list[int] = []
    for i, (start, end) in enumerate(spans):
        if start == end == 0 and i + 1 < len(spans):  # added, not in the text
            start = next((s for s, e in spans[i + 1:] if e > s), len(text))
        starts.append(start)
    return starts


def _decoded_starts(tokenizer: Any, tokens: Sequence[int], text: str) -> list[int]:
    """Where each token starts in `text`, the decoding of `tokens` (a token-id prompt's echo),
    where re-encoding the text gives other ids: the length of each prefix's decoding. A
    tokenizer's decode is not the concatenation of its tokens' pieces (SentencePiece drops
    the first piece's space, byte-fallback pieces form one character together), so the
    running sum of the pieces' lengths drifts; prefixes do not. Kept within the text and
    never decreasing (a prefix ending inside a character decodes to a replacement)."""
    starts: list[int] = []
    last = 0
    for i in range(len(tokens)):
        last = min(max(last, len(tokenizer.decode(list(tokens[:i])))), len(text))
        starts.append(last)
    return starts


def _fim(state: ServerState, body: CompletionRequest) -> FimTokens | None:
    """The model's fill-in-the-middle tokens when the request sends a `suffix`; a 400
    naming `suffix` when its tokenizer has none (the model was not trained to infill)."""
    if body.suffix is None:
        return None
    fim = fim_tokens(state.tokenizer)
    if fim is None:
        raise BadRequest(
            f"'suffix' asks for fill-in-the-middle, and the model {body.model!r} has no "
            "fill-in-the-middle tokens: its tokenizer has no prefix/suffix/middle markers "
            "(such as <|fim_prefix|>, <fim_prefix>, <PRE> or <｜fim▁begin｜>). Send the "
            "request without 'suffix', or to a code model trained for infilling",
            code="fim_not_supported", param="suffix",
        )
    return fim


async def _tokenize_prompts(state: ServerState, body: CompletionRequest,
                            fim: FimTokens | None = None, suffix: list[int] | None = None) -> list[list[int]]:
    """Each prompt's token ids; with `fim`, the infilling prompt of it and `suffix`, its
    text encoded as plain text (the markers go in as ids only)."""
    prompts = body.prompts
    vocab = state.vocab_size
    texts = [p for p in prompts if isinstance(p, str)]
    state.check_prompt_size(len(prompts), sum(len(t) for t in texts) + len(body.suffix or ""))
    suffix = suffix or []
    out: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if fim is not None:
                prefix = await asyncio.to_thread(encode_text, state.tokenizer, prompt)
                out.append(fim.prompt(prefix, suffix))
                continue
            out.append(list(await asyncio.to_thread(state.tokenizer.encode, prompt)))
            continue
        bad = next((t for t in prompt if t >= vocab), None)
        if bad is not None:
            where = f" (prompt {i})" if len(prompts) > 1 else ""
            raise BadRequest(f"token id {bad} is outside the vocabulary (size {vocab}){where}",
                             param="prompt")
        out.append(fim.prompt(prompt, suffix) if fim is not None else list(prompt))
    return out


def _start(state: ServerState, body: Any, tokens: list[int] | list[list[int]], logprobs: bool, top: int,
           new_processor: ProcessorFactory | None = None, *,
           prompt_logprobs: int | None = None,
           stop_token_ids: frozenset[int] = frozenset()) -> Generation:
    """Prepare (each prompt checked against the context) and submit the generation."""
    batch: list[list[int]] = tokens if tokens and isinstance(tokens[0], list) else [tokens]  # type: ignore[list-item]
    each = [
        prepare(
            prompt_tokens=prompt,
            body=body,
            context_length=state.context_length,
            default_max_tokens=state.settings.default_max_tokens,
            max_tokens_cap=state.settings.max_tokens_cap,
            logprobs=logprobs,
            top_logprobs=top,
            **({"new_processor": new_processor} if new_processor is not None else {}),
        )
        for prompt in batch
    ]
    prepared = dataclasses.replace(
        each[0], max_tokens=min(p.max_tokens for p in each),
        more_prompts=tuple(tuple(p.prompt_tokens) for p in each[1:]),
        prompt_logprobs=prompt_logprobs, stop_token_ids=stop_token_ids,
    )
    return Generation(state.engine, state.tokenizer, prepared,
                      timeout_s=state.settings.request_timeout_s)


def _check_supported(body: Any) -> None:
    name = body.unsupported()
    if name is not None:
        raise BadRequest(f"'{name}' is not supported by this server", code="unsupported_parameter",
                         param=name)


async def _plan_chat(state: ServerState, body: ChatCompletionRequest) -> ChatPlan:
    tools = [FunctionTool(t.function.name, t.function.description, t.function.parameters,
                          bool(t.function.strict)) for t in body.tools or []]
    choice = body.tool_choice
    if choice is None:
        mode = ToolChoice("auto" if tools else "none")
    elif isinstance(choice, str):
        mode = ToolChoice(choice)
    else:
        mode = ToolChoice("named", choice.function.name)
    fmt = body.response_format
    grammar = None
    if fmt is not None:
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
        grammar = response_format_grammar(fmt.type, schema, param="response_format")
    check_logit_bias(state, body.logit_bias_pairs())
    return await plan_chat(
        state, [m.template_dict() for m in body.messages], tools=tools, choice=mode,
        parallel_tool_calls=body.parallel_tool_calls, response_format=grammar,
        frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
    )


def _tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}}
    if index is not None:
        out["index"] = index
    return out


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request
) -> JSONResponse | StreamingResponse:
    state = await serving_state(request, body.model, check_served_model)
    _check_supported(body)
    plan = await _plan_chat(state, body)
    generation = _start(state, body, plan.tokens, body.logprobs, body.top_logprobs or 0,
                        plan.new_processor)
    request.state.generation = generation
    tokenizer = state.tokenizer
    parsers = [plan.parser() for _ in generation.choices]

    def usage() -> dict[str, Any]:
        out = generation.usage()
        if plan.markers is not None:
            reasoning = sum(p.reasoning_tokens(tokenizer) for p in parsers)
            out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return out

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
        calls_sent = [0] * len(generation.choices)

        def event(choice: ChoiceResult, delta: TextDelta, finish: str | None) -> bytes:
            parser = parsers[choice.index]
            piece = parser.feed(delta.text)
            if finish is not None:
                piece.extend(parser.finish())
            logprobs = _chat_logprobs(tokenizer, delta.logprobs) if body.logprobs and delta.logprobs else None
            out = b""

            def send(d: dict[str, Any], lp: dict[str, Any] | None = None) -> bytes:
                return chunk([{"index": choice.index, "delta": d, "logprobs": lp, "finish_reason": None}])

            for item in piece.events:
                # OpenAI's order for a call: id, type and name first, then argument fragments.
                if isinstance(item, ContentText):
                    out += send({"content": item.text}, logprobs)
                    logprobs = None
                elif isinstance(item, ReasoningText):
                    out += send({"reasoning_content": item.text}, logprobs)
                    logprobs = None
                elif isinstance(item, CallStarted):
                    calls_sent[choice.index] += 1
                    out += send({"tool_calls": [{"index": item.index, "id": item.call_id, "type": "function",
                                                 "function": {"name": item.name, "arguments": ""}}]})
                elif isinstance(item, ArgumentsDelta):
                    out += send({"tool_calls": [{"index": item.index,
                                                 "function": {"arguments": item.delta}}]})
            if logprobs is not None:
                out += send({"content": ""}, logprobs)
            if finish is not None:
                reason = "tool_calls" if calls_sent[choice.index] and finish == "stop" else finish
                out += chunk([{"index": choice.index, "delta": {}, "logprobs": None,
                               "finish_reason": reason}])
            return out

        role = chunk([
            {"index": c.index, "delta": {"role": "assistant", "content": "", "refusal": None},
             "logprobs": None, "finish_reason": None}
            for c in generation.choices
        ])
        wants_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _event_stream(generation, first, event, prelude=role,
                             usage=(lambda: chunk([], usage())) if wants_usage else None)

    try:
        await gather(generation, request)
    finally:
        generation.close()

    def message(c: ChoiceResult) -> dict[str, Any]:
        parser = parsers[c.index]
        piece = parser.feed(c.text.text)
        piece.extend(parser.finish())
        calls = piece.calls
        msg: dict[str, Any] = {"role": "assistant",
                               "content": piece.text if piece.text or not calls else None,
                               "refusal": None}
        if piece.reasoning:
            msg["reasoning_content"] = piece.reasoning
        finish = c.finish_reason
        if calls:
            msg["tool_calls"] = [_tool_call_json(call) for call in calls]
            if finish == "stop":
                finish = "tool_calls"
        return {
            "index": c.index,
            "message": msg,
            "logprobs": _chat_logprobs(tokenizer, c.logprobs) if body.logprobs else None,
            "finish_reason": finish,
        }

    return JSONResponse({
        "id": f"chatcmpl-{generation.id}",
        "object": "chat.completion",
        "created": generation.created,
        "model": body.model,
        "choices": [message(c) for c in generation.choices],
        "usage": usage(),
    }, headers=generation.prepared.headers())


@router.get("/v1/chat/completions")
async def list_stored_chat_completions() -> None:
    """OpenAI lists stored chat completions here (`store: true`); this server keeps none."""
    raise NotFound("This server does not store chat completions, so there are none to list; "
                   "nothing is kept after a response is sent", code="stored_completions_not_kept")


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    state = await serving_state(request, body.model, check_served_model)
    _check_supported(body)
    check_logit_bias(state, body.logit_bias_pairs())
    fim = _fim(state, body)
    suffix_ids = await asyncio.to_thread(encode_text, state.tokenizer, body.suffix or "") if fim else []
    prompts = await _tokenize_prompts(state, body, fim, suffix_ids)
    want_logprobs = body.logprobs is not None
    scored = body.logprobs if body.echo and want_logprobs else None
    shaping = Shaping(None, body.frequency_penalty, body.presence_penalty)
    generation = _start(state, body, prompts, want_logprobs, body.logprobs or 0, shaping.factory(),
                        prompt_logprobs=scored,
                        stop_token_ids=fim.end_ids if fim is not None else frozenset())
    request.state.generation = generation
    tokenizer = state.tokenizer
    offsets = [0] * len(generation.choices)

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

    echoes = [p if isinstance(p, str) else tokenizer.decode(p) for p in body.prompts] if body.echo else []

    def prefix(index: int) -> str:
        return echoes[index // body.n] if echoes else ""

    def prompt_logprobs_for(choice: ChoiceResult) -> dict[str, Any] | None:
        """The echoed prompt's entries (scored when logprobs were asked), before the
        generated tokens', whose offsets then continue after the echoed text. With a
        suffix the echo is the prompt alone: its tokens' scores as they stand in the
        infilling prompt, the markers and the suffix left out."""
        if not want_logprobs or not body.echo:
            return None
        prompt = prompts[choice.index // body.n]
        scores = list(choice.prompt_logprobs or [None] * len(prompt))
        if fim is not None:
            start, end = fim.prefix_span(len(prompt), len(suffix_ids))
            prompt, scores = prompt[start:end], scores[start:end]
        given = body.prompts[choice.index // body.n]
        echo = given if isinstance(given, str) else prefix(choice.index)
        starts = _text_starts(tokenizer, echo, prompt)
        if starts is None and not isinstance(given, str):
            starts = _decoded_starts(tokenizer, prompt, echo)
        result = _completion_logprobs(tokenizer, scores, 0, prompt, starts)
        offsets[choice.index] = len(prefix(choice.index))
        return result

    if body.stream:
        first = await _first_or_error(generation)
        echoed: set[int] = set()

        def event(choice: ChoiceResult, delta: TextDelta, finish: str | None) -> bytes:
            head = b""
            if body.echo and choice.index not in echoed:  # the prompt goes first
                echoed.add(choice.index)
                head = _sse(payload([{
                    "index": choice.index, "text": prefix(choice.index),
                    "logprobs": prompt_logprobs_for(choice), "finish_reason": None,
                }], None))
            return head + _sse(payload([{
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

    def choice_body(c: ChoiceResult) -> dict[str, Any]:
        echoed = prompt_logprobs_for(c)
        own = logprobs_for(c.index, c.logprobs)
        if echoed is not None and own is not None:
            own = {k: echoed[k] + own[k] for k in own}
        return {"index": c.index, "text": prefix(c.index) + c.text.text, "logprobs": own,
                "finish_reason": c.finish_reason}

    return JSONResponse(payload([choice_body(c) for c in generation.choices], generation.usage()),
                        headers=generation.prepared.headers())


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

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={**SSE_HEADERS, **generation.prepared.headers()})


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
