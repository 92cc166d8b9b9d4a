"""The prefix cache through a real server: a growing conversation finds the whole previous
turn on all three APIs, `/v1/memory` shows what the cache holds and why it evicted, and
with --prefix-cache-dir a restarted server reads a prefix back from disk."""

from __future__ import annotations

import httpx
import pytest

MODEL = "mlx-headroom/tiny-chat"
BLOCK = 16


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def chat_turn(url: str, messages: list[dict]) -> tuple[str, int, int, int]:
    data = post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 24, "temperature": 0})
    u = data["usage"]
    return (data["choices"][0]["message"]["content"], u["prompt_tokens"], u["completion_tokens"],
            u["prompt_tokens_details"]["cached_tokens"])


def responses_turn(url: str, messages: list[dict]) -> tuple[str, int, int, int]:
    data = post(url, "/v1/responses", {"input": messages, "max_output_tokens": 24, "temperature": 0})
    u = data["usage"]
    text = "".join(c["text"] for item in data["output"] if item["type"] == "message"
                   for c in item["content"] if c["type"] == "output_text")
    return text, u["input_tokens"], u["output_tokens"], u["input_tokens_details"]["cached_tokens"]


def anthropic_turn(url: str, messages: list[dict]) -> tuple[str, int, int, int]:
    data = post(url, "/v1/messages", {"messages": messages, "max_tokens": 24, "temperature": 0})
    u = data["usage"]
    text = "".join(b["text"] for b in data["content"] if b["type"] == "text")
    prompt = u["input_tokens"] + u["cache_read_input_tokens"]
    return text, prompt, u["output_tokens"], u["cache_read_input_tokens"]


@pytest.mark.parametrize("turn", [chat_turn, responses_turn, anthropic_turn],
                         ids=["chat", "responses", "anthropic"])
def test_a_growing_conversation_hits_the_previous_prompt_and_answer(server, turn):
    messages = [{"role": "user", "content": f"{turn.__name__}: " + "tell me about the sea. " * 20}]
    previous = 0
    for n in range(4):
        answer, prompt, completion, cached = turn(server.url, messages)
        assert cached >= previous - BLOCK, (n, cached, previous)
        previous = prompt + completion
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": f"and turn {n}? " * 5}]


def test_memory_shows_the_prefix_cache(server):
    post(server.url, "/v1/completions", {"prompt": "m" * 300, "max_tokens": 1})
    prefix = httpx.get(f"{server.url}/v1/memory").json()["prefix_cache"]
    assert prefix["bytes"] > 0 and prefix["entries"] > 0
    assert set(prefix["evictions_by_cause"]) == {"admission", "ceiling", "cap"}
    assert prefix["max_bytes"] is None  # no cap: the guard governs
    assert prefix["budget_bytes"] >= prefix["bytes"]


def test_cached_tokens_sum_over_a_completions_prompts_as_prompt_tokens_do(server):
    texts = [f"usage {i}: " + "a list of prompts, each cached. " * 10 for i in range(2)]
    for text in texts:  # each prompt alone first: both cached
        post(server.url, "/v1/completions", {"prompt": text, "max_tokens": 1, "temperature": 0})
    both = post(server.url, "/v1/completions", {"prompt": texts, "max_tokens": 1, "temperature": 0})["usage"]
    assert both["prompt_tokens"] == sum(len(t) for t in texts)  # one token a character here
    cached = both["prompt_tokens_details"]["cached_tokens"]
    assert sum(len(t) - 2 * BLOCK for t in texts) <= cached <= both["prompt_tokens"]
    # n choices of one prompt share it: its tokens count once, cached ones too.
    one = post(server.url, "/v1/completions", {"prompt": texts[0], "n": 2, "max_tokens": 1})["usage"]
    assert len(texts[0]) - 2 * BLOCK <= one["prompt_tokens_details"]["cached_tokens"] <= one["prompt_tokens"]


def test_a_restarted_server_reads_the_prefix_back_from_disk(start_server, tmp_path):
    args = ["--prefix-cache-dir", str(tmp_path / "prefixes")]
    first = start_server(args=args)
    text = "The quick brown fox jumps over the lazy dog. " * 12
    cold = post(first.url, "/v1/completions", {"prompt": text, "max_tokens": 8, "temperature": 0})
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert first.stop() == 0
    assert list((tmp_path / "prefixes").glob("*/*.safetensors"))
    again = start_server(args=args)
    hit = post(again.url, "/v1/completions", {"prompt": text, "max_tokens": 8, "temperature": 0})
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(text) - 2 * BLOCK
    assert hit["choices"][0]["text"] == cold["choices"][0]["text"]
    disk = httpx.get(f"{again.url}/v1/memory").json()["prefix_cache"]["disk"]
    assert disk["hits"] > 0 and disk["rejected"] == 0
