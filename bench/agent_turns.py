"""Agent-shaped prefix reuse: a conversation that grows every turn, and a long prefix served
from the disk tier after a restart.

A coding agent resends its whole conversation each turn: the previous prompt, the answer,
and a few hundred new tokens. `conversation` plays such turns one at a time and records,
per turn, the prompt's tokens, the tokens the server says it reused
(`usage.prompt_tokens_details.cached_tokens`) and the TTFT; the goal is that every turn
after the first prefills only what is new. `disk_restart` sends a long prompt cold, stops
the server gracefully (the prefix cache writes its blocks to `--prefix-cache-dir`), starts it
again with the same directory and sends the prompt once more: the TTFT read back from disk
beside the cold one.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.loadgen import filler
from bench.servers import Server


@dataclass(frozen=True)
class Turn:
    prompt_tokens: int
    cached_tokens: int | None
    ttft_ms: float
    answer: str


async def _chat(client: httpx.AsyncClient, server: Server, model: str, messages: list[dict[str, str]],
                max_tokens: int, timeout_s: float) -> Turn:
    """One streamed chat completion: its TTFT, the answer and the usage's token counts."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    began = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", server.url + "/v1/chat/completions", json=body,
                             headers=server.headers, timeout=timeout_s) as response:
        if response.status_code != 200:
            raise RuntimeError(f"turn failed: {response.status_code} {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            data = line.removeprefix("data:").strip()
            if not line.startswith("data:") or data == "[DONE]":
                continue
            chunk = json.loads(data)
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                if text:
                    ttft = ttft if ttft is not None else time.perf_counter() - began
                    parts.append(text)
    details = usage.get("prompt_tokens_details") or {}
    return Turn(int(usage.get("prompt_tokens", 0)), details.get("cached_tokens"),
                round(1000 * (ttft if ttft is not None else time.perf_counter() - began), 2), "".join(parts))


async def conversation(server: Server, model: str, sizes: Any) -> dict[str, Any]:
    """`agent_turns` turns, each adding `agent_turn_tokens` of user text to the last prompt and
    its answer. A turn after the first should prefill only its new tokens: the prompt less
    what the previous turn's prompt and answer left cached (one partial block may be
    recomputed)."""
    system = "agent system prompt. " + filler(sizes.prefix_tokens, 4242)
    messages = [{"role": "system", "content": system}]
    turns: list[Turn] = []
    async with httpx.AsyncClient() as client:
        for n in range(sizes.agent_turns):
            text = f"turn {n}: " + filler(sizes.agent_turn_tokens, 900 + n)
            messages.append({"role": "user", "content": text})
            turn = await _chat(client, server, model, messages, sizes.agent_answer_tokens,
                               sizes.request_timeout_s)
            turns.append(turn)
            messages.append({"role": "assistant", "content": turn.answer})
    prefilled = [t.prompt_tokens - (t.cached_tokens or 0) for t in turns]
    later = prefilled[1:]
    return {
        "turns": len(turns), "system_prompt_tokens": sizes.prefix_tokens,
        "turn_tokens": sizes.agent_turn_tokens, "answer_tokens": sizes.agent_answer_tokens,
        "prompt_tokens": [t.prompt_tokens for t in turns],
        "cached_tokens": [t.cached_tokens for t in turns],
        "prefilled_tokens": prefilled,
        "ttft_ms": [t.ttft_ms for t in turns],
        "later_turns_prefilled_max": max(later) if later else None,
        "later_turns_ttft_ms_max": max(t.ttft_ms for t in turns[1:]) if len(turns) > 1 else None,
    }


async def disk_restart(server: Server, model: str, sizes: Any) -> dict[str, Any]:
    """Cold TTFT of a `prefix_tokens` prompt, its TTFT from memory, then after a restart from
    the disk tier; the server must run with `--prefix-cache-dir`."""
    messages = [{"role": "system", "content": "disk system prompt. " + filler(sizes.prefix_tokens, 5151)},
                {"role": "user", "content": "first question"}]
    again = [messages[0], {"role": "user", "content": "second question"}]
    async with httpx.AsyncClient() as client:
        cold = await _chat(client, server, model, messages, 2, sizes.request_timeout_s)
        memory = await _chat(client, server, model, again, 2, sizes.request_timeout_s)
    began = time.perf_counter()
    await asyncio.to_thread(server.stop, 300)  # a graceful stop writes the cached blocks to disk
    stopped_s = time.perf_counter() - began
    await asyncio.to_thread(server.start)
    async with httpx.AsyncClient() as client:
        warm = [{"role": "user", "content": "warm up"}]
        await _chat(client, server, model, warm, 2, sizes.request_timeout_s)
        disk = await _chat(client, server, model, again, 2, sizes.request_timeout_s)
        view = (await client.get(server.url + "/v1/memory", headers=server.headers)).json()
    return {
        "prompt_tokens": cold.prompt_tokens,
        "cold_ttft_ms": cold.ttft_ms, "memory_hit_ttft_ms": memory.ttft_ms, "disk_hit_ttft_ms": disk.ttft_ms,
        "memory_cached_tokens": memory.cached_tokens, "disk_cached_tokens": disk.cached_tokens,
        "disk_over_cold": round(disk.ttft_ms / cold.ttft_ms, 4) if cold.ttft_ms else None,
        "stop_s": round(stopped_s, 2), "restart_s": server.started_s,
        "prefix_cache_after_restart": view.get("prefix_cache"),
    }
