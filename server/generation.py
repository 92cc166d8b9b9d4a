"""From an API request to engine requests and back: tokenise, submit, gather or stream.

One `Generation` is one HTTP request with `n` choices; each choice is an engine request.
Streaming responses hold their HTTP status until the first token (or a refusal) arrives,
so a memory refusal is a real 507, never a 200 followed by an error event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from engine import EngineClient, EngineRequest, RequestOutput, RequestStream, SamplingParams, Speculation
from engine.logits_processor import LogitsProcessor
from server.errors import APIError, BadRequest, RequestTimeout, from_engine_error
from server.text_stream import ChoiceText, TextDelta

_DONE = object()
CLAMPED_HEADER = "x-max-tokens-clamped"
log = logging.getLogger("mlx_headroom.server.generation")


@dataclass
class ChoiceResult:
    index: int
    text: ChoiceText
    finish_reason: str | None = None
    cached_tokens: int = 0
    speculation: Speculation | None = None  # where speculative decoding drafted for it
    logprobs: list[Any] = field(default_factory=list)
    prompt_logprobs: tuple[Any, ...] = ()  # the prompt's scores, when the request asked


def _no_processor() -> LogitsProcessor | None:
    return None


@dataclass(frozen=True)
class Prepared:
    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingParams
    stops: list[str]
    n: int
    # Makes each choice's own LogitsProcessor (grammar state, penalty counts), or None.
    new_processor: Callable[[], LogitsProcessor | None] = _no_processor
    # Further prompts served as one batch (/v1/completions with a list of prompts):
    # choice i*n + j answers prompt i.
    more_prompts: tuple[tuple[int, ...], ...] = ()
    prompt_logprobs: int | None = None  # score the prompts (echo with logprobs), N alternatives
    requested_max_tokens: int | None = None  # what the request asked for, before clamping
    # Tokens that end a choice besides the tokenizer's EOS (a fill-in-the-middle prompt's
    # family-specific end of the middle).
    stop_token_ids: frozenset[int] = frozenset()

    @property
    def prompts(self) -> list[tuple[int, ...]]:
        return [tuple(self.prompt_tokens), *self.more_prompts]

    def clamped_to(self) -> int | None:
        """N when the request's max_tokens was lowered to N (the context's room or the cap)."""
        requested = self.requested_max_tokens
        return self.max_tokens if requested is not None and self.max_tokens < requested else None

    def headers(self) -> dict[str, str]:
        """`x-max-tokens-clamped: N` when the request's max_tokens was lowered to N."""
        clamped = self.clamped_to()
        return {} if clamped is None else {CLAMPED_HEADER: str(clamped)}

    def usage_note(self) -> dict[str, int]:
        """What the usage adds when max_tokens was lowered, on every API: the value used, so
        a client that reads only the body (a streamed Responses event, an SDK) sees it too."""
        clamped = self.clamped_to()
        return {} if clamped is None else {"max_tokens_clamped": clamped}


def prepare(
    *,
    prompt_tokens: list[int],
    body: Any,
    context_length: int,
    default_max_tokens: int,
    max_tokens_cap: int,
    logprobs: bool,
    top_logprobs: int,
    new_processor: Callable[[], LogitsProcessor | None] = _no_processor,
    prompt_param: str = "messages",
) -> Prepared:
    """Validate lengths against the context and build the sampling parameters.

    `max_tokens` is a ceiling: clamped to the room the prompt leaves in the context (agents
    ask for 32k output tokens whatever the model), and logged; `Prepared.headers` says so
    to the client; so is the operator's cap. Refused is only a prompt that leaves no room."""
    room = context_length - len(prompt_tokens)
    requested = body.requested_max_tokens
    if room < 1:
        raise BadRequest(
            f"This model's maximum context length is {context_length} tokens, and the prompt "
            f"is {len(prompt_tokens)} tokens: it leaves no room for output. Shorten the prompt.",
            code="context_length_exceeded", param=prompt_param,
        )
    max_tokens = min(requested if requested is not None else default_max_tokens, room, max_tokens_cap)
    if requested is not None and max_tokens < requested:
        log.info("max_tokens clamped from %d to %d: the prompt's %d tokens leave %d of the "
                 "model's %d (the server's cap is %d)", requested, max_tokens, len(prompt_tokens),
                 room, context_length, max_tokens_cap)
    sampling = SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(body.top_k, 0),
        min_p=body.min_p,
        seed=body.seed,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        logit_bias=body.logit_bias_pairs() if hasattr(body, "logit_bias_pairs") else (),
    )
    return Prepared(prompt_tokens, max_tokens, sampling, body.stop_list, body.n, new_processor,
                    requested_max_tokens=requested)


class Generation:
    """The engine requests behind one HTTP request, merged into one ordered feed."""

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Any,
        prepared: Prepared,
        *,
        timeout_s: float | None = None,
    ) -> None:
        self.id = uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.prepared = prepared
        self.tokenizer = tokenizer
        self.started = time.monotonic()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.error: APIError | None = None
        self._deadline: asyncio.TimerHandle | None = None
        prompts = prepared.prompts
        total = prepared.n * len(prompts)
        self.choices = [ChoiceResult(i, ChoiceText(tokenizer, prepared.stops)) for i in range(total)]
        self._streams: list[RequestStream] = []
        self._feed: asyncio.Queue[tuple[int, RequestOutput | BaseException] | object] = (
            asyncio.Queue()
        )
        self._pumps: list[asyncio.Task[None]] = []
        stop_ids = frozenset(tokenizer.eos_token_ids) | prepared.stop_token_ids
        for i in range(total):
            sampling = dataclasses.replace(prepared.sampling, processor=prepared.new_processor())
            if sampling.seed is not None and i > 0:
                sampling = dataclasses.replace(sampling, seed=sampling.seed + i)
            request = EngineRequest(
                request_id=f"{self.id}-{i}",
                prompt_tokens=prompts[i // prepared.n],
                max_tokens=prepared.max_tokens,
                sampling=sampling,
                stop_token_ids=stop_ids,
                arrival=self.started,
                prompt_logprobs=prepared.prompt_logprobs,
            )
            try:
                self._streams.append(engine.submit(request))
            except Exception as exc:
                self.close()
                raise from_engine_error(exc) from exc
        # One choice (the common case) is read straight from its engine stream: no pump
        # task and no second queue hop per token. Several choices are merged by pumps.
        self._direct = len(self._streams) == 1
        if not self._direct:
            self._pumps = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(self._streams)]
        if timeout_s is not None:
            self._deadline = asyncio.get_running_loop().call_later(timeout_s, self._expire, timeout_s)

    def _expire(self, timeout_s: float) -> None:
        """The deadline passed: the error goes first in the feed, then the engine lets go."""
        error = RequestTimeout(
            f"the request did not finish within this server's limit of {timeout_s:g} s",
            code="request_timeout",
        )
        if self._direct:
            self._streams[0]._put(error)
        else:
            self._feed.put_nowait((-1, error))
        self.close()

    async def _next(self) -> tuple[int, RequestOutput | BaseException] | object:
        if not self._direct:
            return await self._feed.get()
        try:
            return 0, await self._streams[0].next()
        except Exception as exc:  # handed to events() as the pumps hand it over
            return 0, exc

    async def _pump(self, index: int, stream: RequestStream) -> None:
        try:
            while not stream.finished:
                output = await stream.next()
                await self._feed.put((index, output))
        except BaseException as exc:
            await self._feed.put((index, exc))
        finally:
            await self._feed.put(_DONE)

    async def events(self) -> AsyncIterator[tuple[ChoiceResult, TextDelta, str | None]]:
        """(choice, new text, finish reason or None) until every choice has finished.

        Raises the first engine error as an APIError.
        """
        while any(c.finish_reason is None for c in self.choices):
            item = await self._next()
            if item is _DONE:
                continue
            index, output = item  # type: ignore[misc]
            if isinstance(output, BaseException):
                if not isinstance(output, Exception):
                    raise output
                self.error = from_engine_error(output)
                raise self.error
            choice = self.choices[index]
            if choice.finish_reason is not None:
                continue
            if output.prompt_logprobs:
                choice.prompt_logprobs = output.prompt_logprobs
            if self.first_token_at is None and output.new_tokens:
                self.first_token_at = time.monotonic()
            delta = choice.text.add(output.new_tokens, output.logprobs)
            finish = output.finish_reason
            if delta.stopped:
                finish = "stop"
                self._streams[index].abort()
            elif finish is not None:
                tail = choice.text.finish()
                delta = TextDelta(delta.text + tail.text, delta.logprobs, tail.stopped)
            if finish is not None:
                choice.finish_reason = finish
                choice.cached_tokens = output.cached_tokens
                choice.speculation = output.speculation
            choice.logprobs.extend(delta.logprobs)
            yield choice, delta, finish
        self.finished_at = time.monotonic()

    async def first_event(self) -> tuple[ChoiceResult, TextDelta, str | None] | None:
        """Wait for the first event; errors raise here, before any HTTP status is sent."""
        self._iter = self.events()
        try:
            return await self._iter.__anext__()
        except StopAsyncIteration:
            return None

    async def rest(self) -> AsyncIterator[tuple[ChoiceResult, TextDelta, str | None]]:
        async for event in self._iter:
            yield event

    def close(self) -> None:
        """Abort whatever is still running (a client went away, or we are done)."""
        if self._deadline is not None:
            self._deadline.cancel()
        for stream in self._streams:
            stream.abort()
        for task in self._pumps:
            task.cancel()

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(p) for p in self.prepared.prompts)
        completion = sum(c.text.completion_tokens for c in self.choices)
        # Summed over the prompts, as prompt_tokens is; a prompt's n choices share it, and
        # count once: what the one that found the most in the cache found.
        n = self.prepared.n
        cached = sum(max((c.cached_tokens for c in self.choices[i * n : (i + 1) * n]), default=0)
                     for i in range(len(self.prepared.prompts)))
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            **self.prepared.usage_note(),
            **self.speculation_usage(),
        }

    def speculation_usage(self) -> dict[str, Any]:
        """Where speculative decoding drafted: OpenAI's prediction counts (drafts that became
        output, and drafts the model did not take) and `speculative`, the request's acceptance
        rate and output tokens per decode step. Nothing where nothing was drafted."""
        spec = [c.speculation for c in self.choices if c.speculation is not None]
        drafted = sum(s.drafted_tokens for s in spec)
        if not drafted:
            return {}
        accepted = sum(s.accepted_tokens for s in spec)
        steps = sum(s.decode_steps for s in spec)
        tokens = sum(c.text.completion_tokens for c in self.choices if c.speculation is not None)
        return {
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": drafted - accepted},
            "speculative": {"drafted_tokens": drafted, "accepted_tokens": accepted,
                            "acceptance_rate": round(accepted / drafted, 4),
                            "tokens_per_step": round(tokens / steps, 4) if steps else None},
        }


async def gather(generation: Generation, request: Request) -> None:
    """Run a non-streaming generation to the end, aborting it if the client disconnects."""

    async def consume() -> None:
        async for _ in generation.events():
            pass

    consumer = asyncio.create_task(consume())
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if consumer in done:
            consumer.result()
            return
        generation.close()
        consumer.cancel()
        raise APIError("client disconnected", code="client_disconnected")
    finally:
        watcher.cancel()
        if not consumer.done():
            consumer.cancel()
            generation.close()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
