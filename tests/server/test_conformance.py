"""Conformance details a new OpenAI client runs into, through a real server."""

from __future__ import annotations

import httpx
import openai
import pytest

MODEL = "mlx-headroom/tiny-chat"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_message_has_a_null_refusal_and_null_fields_count_as_absent(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "stream": None, "temperature": None, "stop": None, "n": None, "tools": None,
        "response_format": None, "logit_bias": None, "seed": None})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert "refusal" in message and message["refusal"] is None


def test_completions_serve_a_batch_of_prompts_one_choice_each(client):
    texts = client.completions.create(model=MODEL, prompt=["one", "two", "three"], max_tokens=3,
                                      temperature=0, n=2)
    assert sorted(c.index for c in texts.choices) == list(range(6))
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=3, temperature=0)
               for p in ("one", "two", "three")]
    by_index = {c.index: c.text for c in texts.choices}
    for i, single in enumerate(singles):
        assert by_index[2 * i] == by_index[2 * i + 1] == single.choices[0].text
    assert texts.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    tokens = client.completions.create(model=MODEL, prompt=[[104, 105], [111, 107, 33]], max_tokens=2,
                                       temperature=0, echo=True)
    assert [c.text[:2] for c in sorted(tokens.choices, key=lambda c: c.index)] == ["hi", "ok"]


def test_models_retrieve(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


@pytest.mark.parametrize("field, value", [("audio", {"voice": "alloy", "format": "mp3"}),
                                          ("modalities", ["text", "audio"]),
                                          ("web_search_options", {}),
                                          ("prediction", {"type": "content", "content": "x"})])
def test_unsupported_fields_are_a_400_naming_them(server, field, value):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_top_logprobs_without_logprobs_is_a_400_naming_it(server):
    # Found by schemathesis against OpenAI's spec: the refusal named no param.
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "top_logprobs"


def test_ignored_fields_are_served(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "store": True, "metadata": {"a": "b"}, "service_tier": "auto", "modalities": ["text"],
        "reasoning_effort": "low", "prompt_cache_key": "k", "user": "u"})
    assert r.status_code == 200, r.text


def test_frequency_penalty_changes_greedy_output(client):
    def text(**kw):
        return client.completions.create(model=MODEL, prompt="aaaa", max_tokens=24, temperature=0,
                                         **kw).choices[0].text

    plain = text()
    assert text(frequency_penalty=2.0) != plain
    assert text(presence_penalty=0.0) == plain


def test_openapi_lists_the_errors_we_send_and_not_422(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    responses = spec["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in responses
    assert {"400", "401", "404", "413", "429", "503", "504", "507"} <= set(responses)
