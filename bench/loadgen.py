"""A load generator for OpenAI-compatible chat completion servers (ours and mlx_lm.server).

`run_load(url, workload)` sends `workload.requests` streaming chat completions from
`workload.concurrency` workers and returns a `LoadReport`: aggregate output tokens per
second, time to first token (TTFT) and time per output token (TPOT) percentiles, and the
requests that failed (an HTTP error or an error event, by status) or were dropped (a
connection error, a timeout, a stream that ended before its finish reason).

Prompts are sized in tokens of the embedded byte-level tokenizer (one ASCII character is one
token) under its ChatML template, so `prompt_tokens=P` gives prompts of exactly P tokens. Each
prompt starts with its request number, so no two share a prefix unless a `system_prompt` is
given (the prefix cache scenario). Completion tokens are counted from the final usage chunk
(`stream_options.include_usage`, which both servers honour), else from content chunks.

    python -m bench.loadgen --url http://127.0.0.1:8000 -c 8 -p 256 -t 64
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

# ChatML as engine.tiny_model.CHAT_TEMPLATE renders it: each message costs <|im_start|>,
# "role\n", its content, <|im_end|>, "\n"; the generation prompt <|im_start|>, "assistant\n".
_GENERATION_PROMPT_TOKENS = 1 + len("assistant\n")
_WORDS = ("memory", "admission", "bandwidth", "token", "cache", "prefix", "decode", "prefill",
          "batch", "kernel", "tensor", "layer", "head", "query", "value", "stream", "queue",
          "ceiling", "budget", "guard", "server", "latency", "throughput", "model")


def message_overhead(role: str) -> int:
    return 1 + len(role) + 1 + 1 + 1


def chat_overhead(roles: tuple[str, ...] = ("user",)) -> int:
    """Template tokens around the contents of messages with these roles."""
    return sum(message_overhead(r) for r in roles) + _GENERATION_PROMPT_TOKENS


def filler(n_chars: int, seed: int) -> str:
    """Deterministic ASCII text of exactly n_chars characters (one byte token each)."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_chars:
        word = rng.choice(_WORDS)
        parts.append(word)
        size += len(word) + 1
    return " ".join(parts)[:n_chars].ljust(n_chars, ".")


def user_content(index: int, n_chars: int, seed: int = 0) -> str:
    """Content that differs from every other index from its first character."""
    tag = f"{index:07d} "
    if n_chars <= len(tag):
        return tag[:max(n_chars, 1)]
    return tag + filler(n_chars - len(tag), seed * 1_000_003 + index)


@dataclass(frozen=True)
class Workload:
    concurrency: int
    prompt_tokens: int
    max_tokens: int
    requests: int | None = None  # default: one per worker
    system_prompt: str | None = None  # shared by every request (prefix cache)
    model: str = "default"
    timeout_s: float = 600.0
    seed: int = 0
    first_index: int = 0  # offsets request numbers, so that repeated runs stay distinct
    stream: bool = True  # False: one JSON answer per request (no TTFT/TPOT, latency only)

    @property
    def total_requests(self) -> int:
        return self.requests if self.requests is not None else self.concurrency

    def messages(self, index: int) -> list[dict[str, str]]:
        roles: tuple[str, ...] = ("user",)
        messages: list[dict[str, str]] = []
        budget = self.prompt_tokens
        if self.system_prompt is not None:
            roles = ("system", "user")
            messages.append({"role": "system", "content": self.system_prompt})
            budget -= len(self.system_prompt.encode())
        n_chars = max(budget - chat_overhead(roles), 1)
        content = user_content(self.first_index + index, n_chars, self.seed)
        messages.append({"role": "user", "content": content})
        return messages

    def body(self, index: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": self.messages(index),
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": self.stream,
            **({"stream_options": {"include_usage": True}} if self.stream else {}),
        }


@dataclass
class RequestResult:
    index: int
    outcome: str = "dropped"  # ok | failed | dropped
    status: int | None = None
    error: str | None = None  # error code or exception name
    started: float = 0.0
    ttft_s: float | None = None
    latency_s: float | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    chunk_times: list[float] = field(default_factory=list, repr=False)  # each content chunk's arrival

    @property
    def content_chunks(self) -> int:
        return len(self.chunk_times)

    @property
    def last_token_at(self) -> float | None:
        return self.chunk_times[-1] if self.chunk_times else None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.last_token_at is None or self.completion_tokens < 2:
            return None
        return (self.last_token_at - self.started - self.ttft_s) / (self.completion_tokens - 1)


def steady_gaps(results: list[RequestResult], concurrency: int) -> tuple[list[float], float]:
    """Gaps between a stream's content chunks during steady decode (the issue's "TPOT during
    steady decode"): a gap counts while at least `concurrency` requests decode through it
    and no request is waiting for its first token, so no step of it prefilled a prompt and
    the batch was full. Returns the gaps and the seconds they cover. A chunk is one token
    unless the detokenizer held back a partial character."""
    ok = [r for r in results if r.outcome == "ok" and len(r.chunk_times) >= 2]
    decoding = [(r.chunk_times[0], r.chunk_times[-1]) for r in ok]
    prefilling = [(r.started, r.chunk_times[0]) for r in ok]
    gaps = []
    for r in ok:
        for a, b in itertools.pairwise(r.chunk_times):
            full = sum(1 for first, last in decoding if first <= a and last >= b) >= concurrency
            if full and not any(start < b and first > a for start, first in prefilling):
                gaps.append(b - a)
    return gaps, sum(gaps) / max(concurrency, 1)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (inclusive method), or None for no values."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


@dataclass
class LoadReport:
    workload: dict[str, Any]
    wall_s: float
    results: list[RequestResult] = field(repr=False, default_factory=list)

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.results if r.outcome == "ok"]
        failed = Counter(
            str(r.status) if r.status != 200 else f"stream_error:{r.error}"
            for r in self.results
            if r.outcome == "failed"
        )
        codes = Counter(str(r.error) for r in self.results if r.outcome == "failed")
        dropped = Counter(str(r.error) for r in self.results if r.outcome == "dropped")
        tokens = sum(r.completion_tokens for r in self.results)
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        latency = [r.latency_s for r in ok if r.latency_s is not None]
        tpot = [t for r in ok if (t := r.tpot_s) is not None]
        steady, steady_window_s = steady_gaps(self.results, self.workload["concurrency"])
        itl = [b - a for r in ok for a, b in itertools.pairwise(r.chunk_times)]  # inter-token latency
        ms = 1000.0

        def pct(values: list[float], q: float) -> float | None:
            p = percentile(values, q)
            return None if p is None else round(p * ms, 2)

        return {
            "requests": len(self.results),
            "ok": len(ok),
            "failed": sum(failed.values()),
            "failed_by_status": dict(failed),
            "failed_by_code": dict(codes),
            "dropped": sum(dropped.values()),
            "dropped_by_reason": dict(dropped),
            "wall_s": round(self.wall_s, 3),
            "completion_tokens": tokens,
            "expected_tokens": self.workload["max_tokens"] * len(self.results),
            "output_tok_s": round(tokens / self.wall_s, 2) if self.wall_s > 0 else None,
            "ttft_ms_p50": pct(ttft, 50),
            "ttft_ms_p95": pct(ttft, 95),
            "tpot_ms_p50": pct(tpot, 50),
            "tpot_ms_p95": pct(tpot, 95),
            "steady_tpot_ms_p50": pct(steady, 50),
            "steady_tpot_ms_p95": pct(steady, 95),
            "steady_window_s": round(steady_window_s, 3),
            "itl_ms_p50": pct(itl, 50),
            "itl_ms_p99": pct(itl, 99),
            "itl_ms_max": round(max(itl) * ms, 2) if itl else None,
            "latency_ms_p50": pct(latency, 50),
            "latency_ms_p95": pct(latency, 95),
        }


def _error_code(body: bytes) -> str | None:
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


async def _one(
    client: httpx.AsyncClient, url: str, workload: Workload, index: int, headers: dict[str, str]
) -> RequestResult:
    result = RequestResult(index=index, started=time.perf_counter())
    if not workload.stream:
        return await _one_whole(client, url, workload, index, headers, result)
    try:
        async with client.stream(
            "POST", url + "/v1/chat/completions", json=workload.body(index), headers=headers,
            timeout=httpx.Timeout(workload.timeout_s, connect=30.0),
        ) as response:
            result.status = response.status_code
            if response.status_code != 200:
                body = await response.aread()
                result.outcome, result.error = "failed", _error_code(body)
                return result
            usage_tokens: int | None = None
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.outcome = "failed"
                    result.error = (chunk["error"] or {}).get("code") or "stream_error"
                    return result
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    if delta.get("content"):
                        now = time.perf_counter()
                        if result.ttft_s is None:
                            result.ttft_s = now - result.started
                        result.chunk_times.append(now)
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
            result.completion_tokens = usage_tokens if usage_tokens is not None else result.content_chunks
            if done and result.finish_reason is not None:
                result.outcome = "ok"
            else:
                result.error = "incomplete_stream"
    except (httpx.TransportError, httpx.StreamError) as exc:
        result.outcome, result.error = "dropped", type(exc).__name__
        result.completion_tokens = result.content_chunks
    finally:
        result.latency_s = time.perf_counter() - result.started
    return result


async def _one_whole(
    client: httpx.AsyncClient, url: str, workload: Workload, index: int, headers: dict[str, str],
    result: RequestResult,
) -> RequestResult:
    try:
        response = await client.post(
            url + "/v1/chat/completions", json=workload.body(index), headers=headers,
            timeout=httpx.Timeout(workload.timeout_s, connect=30.0),
        )
        result.status = response.status_code
        if response.status_code != 200:
            result.outcome, result.error = "failed", _error_code(response.content)
            return result
        body = response.json()
        result.completion_tokens = int((body.get("usage") or {}).get("completion_tokens") or 0)
        choices = body.get("choices") or [{}]
        result.finish_reason = choices[0].get("finish_reason")
        result.outcome = "ok" if result.finish_reason is not None else "failed"
        if result.outcome == "failed":
            result.error = "no_finish_reason"
    except (httpx.TransportError, httpx.StreamError) as exc:
        result.outcome, result.error = "dropped", type(exc).__name__
    finally:
        result.latency_s = time.perf_counter() - result.started
    return result


async def run_load(
    url: str,
    workload: Workload,
    *,
    api_key: str | None = None,
    deadline_s: float | None = None,
    client: httpx.AsyncClient | None = None,
) -> LoadReport:
    """Send the workload's requests from `concurrency` workers; return when all have ended, or
    at `deadline_s`, when those in flight are cancelled and counted as dropped ("deadline") and
    those never sent as dropped ("not_sent"): a server whose generation died may never answer."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(workload.total_requests):
        queue.put_nowait(i)
    results: list[RequestResult] = []
    in_flight: dict[int, RequestResult] = {}
    limits = httpx.Limits(max_connections=workload.concurrency + 4, max_keepalive_connections=0)
    own = client is None
    client = client or httpx.AsyncClient(limits=limits)

    async def worker() -> None:
        while True:
            try:
                index = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            in_flight[index] = RequestResult(index=index, started=time.perf_counter())
            results.append(await _one(client, url.rstrip("/"), workload, index, headers))
            del in_flight[index]

    started = time.perf_counter()
    try:
        await asyncio.wait_for(
            asyncio.gather(*(worker() for _ in range(workload.concurrency))), deadline_s
        )
    except asyncio.TimeoutError:
        now = time.perf_counter()
        for r in in_flight.values():
            r.error, r.latency_s = "deadline", now - r.started
            results.append(r)
        while not queue.empty():
            results.append(RequestResult(index=queue.get_nowait(), error="not_sent"))
    finally:
        if own:
            await client.aclose()
    wall = time.perf_counter() - started
    results.sort(key=lambda r: r.index)
    return LoadReport(workload=asdict(workload) | {"system_prompt": bool(workload.system_prompt)},
                      wall_s=wall, results=results)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="default")
    parser.add_argument("-c", "--concurrency", type=int, default=1)
    parser.add_argument("-p", "--prompt-tokens", type=int, default=128)
    parser.add_argument("-t", "--max-tokens", type=int, default=64)
    parser.add_argument("-n", "--requests", type=int)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--api-key")
    parser.add_argument("--no-stream", dest="stream", action="store_false")
    args = parser.parse_args(argv)
    workload = Workload(args.concurrency, args.prompt_tokens, args.max_tokens, args.requests,
                        model=args.model, timeout_s=args.timeout, stream=args.stream)
    report = asyncio.run(run_load(args.url, workload, api_key=args.api_key))
    print(json.dumps(report.summary(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
