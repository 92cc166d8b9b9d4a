"""The OpenAI-compatible API through a real server, with httpx and the official SDK."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

MODEL = "mlx-headroom/tiny-chat"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something."},
]


def sse_events(text: str) -> list[dict | str]:
    out: list[dict | str] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def chat(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=60)


def test_chat_non_streaming_greedy_is_deterministic(server):
    body = dict(messages=MESSAGES, max_tokens=12, temperature=0)
    a, b = chat(server.url, **body), chat(server.url, **body)
    assert a.status_code == 200, a.text
    data = a.json()
    assert data["object"] == "chat.completion"
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 12
    assert data["usage"]["total_tokens"] == data["usage"]["prompt_tokens"] + 12
    assert "cached_tokens" in data["usage"]["prompt_tokens_details"]
    assert choice["message"]["content"] == b.json()["choices"][0]["message"]["content"]


def test_text_parts_equal_string_content(server):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say "},
                                          {"type": "text", "text": "something."}]}]
    plain = [{"role": "user", "content": "Say something."}]
    a = chat(server.url, messages=parts, max_tokens=8, temperature=0).json()
    b = chat(server.url, messages=plain, max_tokens=8, temperature=0).json()
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


def test_max_completion_tokens_wins(server):
    r = chat(server.url, messages=MESSAGES, max_completion_tokens=3, temperature=0)
    assert r.json()["usage"]["completion_tokens"] == 3


def test_streaming_matches_non_streaming_and_reports_usage(server):
    body = dict(messages=MESSAGES, max_tokens=10, temperature=0)
    full = chat(server.url, **body).json()["choices"][0]["message"]["content"]
    r = chat(server.url, stream=True, stream_options={"include_usage": True}, **body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == full
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finals[-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10


def test_stop_string_is_cut_and_finishes_with_stop(server):
    body = dict(messages=MESSAGES, max_tokens=40, temperature=0)
    full = chat(server.url, **body).json()["choices"][0]["message"]["content"]
    stop = full[10:13]
    expected = full[: full.index(stop)]
    for stream in (False, True):
        r = chat(server.url, stop=[stop, "NEVER-APPEARS"], stream=stream, **body)
        if stream:
            chunks = [e for e in sse_events(r.text) if isinstance(e, dict)]
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            text = r.json()["choices"][0]["message"]["content"]
            finish = r.json()["choices"][0]["finish_reason"]
        assert text == expected
        assert stop not in text
        assert finish == "stop"


def test_seed_reproducible_while_batched_with_others(server):
    body = dict(messages=MESSAGES, max_tokens=16, temperature=1.0, seed=1234)

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            others = [
                client.post("/v1/chat/completions",
                            json={"model": MODEL, "messages": MESSAGES, "max_tokens": 30,
                                  "temperature": 1.0})
                for _ in range(3)
            ]
            seeded = client.post("/v1/chat/completions", json={"model": MODEL, **body})
            results = await asyncio.gather(seeded, *others)
        return [r.json()["choices"][0]["message"]["content"] for r in results]

    alone = chat(server.url, **body).json()["choices"][0]["message"]["content"]
    batched = asyncio.run(run())[0]
    assert batched == alone
    other_seed = chat(server.url, **{**body, "seed": 99}).json()["choices"][0]["message"]["content"]
    assert other_seed != alone


def test_sampling_parameters_accepted(server):
    r = chat(server.url, messages=MESSAGES, max_tokens=8, temperature=0.7, top_p=0.9, top_k=20,
             min_p=0.05, seed=7)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8


def test_top_k_one_is_greedy(server):
    greedy = chat(server.url, messages=MESSAGES, max_tokens=10, temperature=0).json()
    topk = chat(server.url, messages=MESSAGES, max_tokens=10, temperature=1.5, top_k=1).json()
    assert topk["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]


def test_logprobs(server):
    r = chat(server.url, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
             top_logprobs=3).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for item in content:
        assert item["logprob"] <= 0
        assert len(item["top_logprobs"]) == 3
        # greedy: the chosen token is the most likely one
        assert item["logprob"] == pytest.approx(item["top_logprobs"][0]["logprob"], abs=1e-5)


def test_n_choices(server):
    r = chat(server.url, messages=MESSAGES, max_tokens=6, temperature=1.0, n=3, seed=5).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert r["usage"]["completion_tokens"] == 18
    texts = {c["message"]["content"] for c in r["choices"]}
    assert len(texts) > 1


def test_completions_string_and_token_ids(server):
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"model": MODEL, "prompt": "Once upon", "max_tokens": 7, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "text_completion"
    assert data["usage"]["completion_tokens"] == 7
    ids = [ord(c) for c in "Once upon"]  # the tiny tokenizer is byte-level
    r2 = httpx.post(f"{server.url}/v1/completions",
                    json={"model": MODEL, "prompt": ids, "max_tokens": 7, "temperature": 0},
                    timeout=60)
    assert r2.json()["choices"][0]["text"] == data["choices"][0]["text"]


def test_completions_streaming(server):
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"model": MODEL, "prompt": "abc", "max_tokens": 5, "stream": True,
                         "temperature": 0, "logprobs": 2}, timeout=60)
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == 5


def test_models_health_version(server, monkeypatch):
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    assert httpx.get(f"{server.url}/health").status_code == 200
    version = httpx.get(f"{server.url}/v1/version").json()
    assert set(version) == {"version", "mlx", "mlx_lm", "backend", "malloc", "mlx_env"}
    assert version["backend"] in {"cpu", "cuda", "metal"}
    assert version["version"] == "0.1.0"


def test_version_override(start_server):
    proc = start_server(env={"MLX_HEADROOM_VERSION": "9.9.9-test"})
    assert httpx.get(f"{proc.url}/v1/version").json()["version"] == "9.9.9-test"


def test_openai_sdk_chat_stream_and_completions(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                          temperature=0)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 6
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == resp.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 6
    comp = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0)
    assert comp.usage.completion_tokens == 4
    assert [m.id for m in client.models.list()] == [MODEL]


def test_concurrent_requests_are_batched(server):
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*[
                client.post("/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 48, "temperature": 0,
                    "messages": [{"role": "user", "content": f"request number {i}"}]})
                for i in range(8)
            ])

    before = httpx.get(f"{server.url}/v1/memory").json()["engine"]["batched_steps"]
    responses = asyncio.run(run())
    assert all(r.status_code == 200 for r in responses)
    assert all(r.json()["usage"]["completion_tokens"] == 48 for r in responses)
    engine = httpx.get(f"{server.url}/v1/memory").json()["engine"]
    assert engine["max_batch"] > 1
    assert engine["batched_steps"] > before


def test_prefix_cache_hit_reports_cached_tokens(server):
    system = {"role": "system", "content": "A long shared system prompt. " * 20}
    first = chat(server.url, messages=[system, {"role": "user", "content": "one"}], max_tokens=2)
    second = chat(server.url, messages=[system, {"role": "user", "content": "two"}], max_tokens=2)
    assert first.status_code == second.status_code == 200
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= len(system["content"])


def test_prefix_cache_entries_are_not_corrupted_by_requests_that_hit_them(server):
    def complete(prompt: str) -> dict:
        return httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "logprobs": 1}).json()

    base = "The shared beginning of two prompts. " * 8
    first = complete(base + "first ending")
    diverging = complete(base[:200] + "a different continuation that overwrites nothing")
    assert diverging["usage"]["prompt_tokens_details"]["cached_tokens"] == 200
    again = complete(base + "first ending")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 200
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    # logprobs are sensitive to every cached key and value, not only to the argmax
    assert again["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        first["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
