"""`suffix` on /v1/completions: fill-in-the-middle for models whose tokenizer has the
markers, a 400 naming `suffix` for the others.

The FIM model is the tiny model with Qwen2.5-Coder's infilling tokens added (special, as
in Qwen's tokenizer): `<|fim_prefix|>`, `<|fim_middle|>`, `<|fim_suffix|>`, `<|fim_pad|>`,
`<|repo_name|>`, `<|file_sep|>`. The reference is mlx-lm's own greedy `generate_step`
on the prompt Qwen's documentation spells, `<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}
<|fim_middle|>`, built here by hand from the byte tokenizer's ids.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from openai import OpenAI
from safetensors.numpy import load_file, save_file

from engine.tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS
from tests.conftest import MODEL, ServerProcess
from tests.server.scripted import build_marked_model

FIM = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
       "<|file_sep|>")
PRE, MID, SUF = (256 + len(SPECIAL_TOKENS) + FIM.index(t) for t in FIM[:3])
ENDOFTEXT = 256 + SPECIAL_TOKENS.index("<|endoftext|>")  # Qwen's end of a middle
EOS = 256 + SPECIAL_TOKENS.index("<|im_end|>")
# What ends a middle for Qwen's family: its EOS, `<|endoftext|>`, and the markers that
# would start another file (`<|fim_pad|>`, `<|repo_name|>`, `<|file_sep|>`).
ENDS = {EOS, ENDOFTEXT, *(256 + len(SPECIAL_TOKENS) + FIM.index(t) for t in FIM[3:])}
PREFIX = "def add(a, b):\n    return "
SUFFIX = "\n\nprint(add(1, 2))\n"


def _bytes(text: str) -> list[int]:
    return list(text.encode())


def _fim_prompt(prefix: str | list[int], suffix: str) -> list[int]:
    head = _bytes(prefix) if isinstance(prefix, str) else prefix
    return [PRE, *head, SUF, *_bytes(suffix), MID]


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build_marked_model(tmp_path_factory.mktemp("fim") / "tiny-fim", FIM, CHAT_TEMPLATE)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    for token in tokenizer["added_tokens"]:
        token["special"] = True
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    # The tiny model never writes its special tokens (their logits sit near -160); let
    # `<|endoftext|>` score 0, so that a logit_bias can make a model end its middle.
    weights = load_file(str(path / "model.safetensors"))
    weights["lm_head.weight"][ENDOFTEXT] = 0.0
    save_file(weights, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def fim_server(fim_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(fim_model).start(tmp_path_factory.mktemp("fim-logs"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def reference(fim_model: Path):
    from mlx_lm import load

    model, tokenizer = load(str(fim_model))

    def greedy(prompt: list[int], max_tokens: int) -> list[int]:
        """mlx-lm's greedy tokens, up to the first that ends a middle (left out)."""
        out: list[int] = []
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
            if int(token) in ENDS:
                break
            out.append(int(token))
        return out

    def scores(prompt: list[int]) -> np.ndarray:
        logits = model(mx.array(prompt)[None])[0].astype(mx.float32)
        return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    return tokenizer, greedy, scores


def _complete(server: ServerProcess, **body: object) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_suffix_gives_the_middle_mlx_lm_writes_for_the_fim_prompt(fim_server, reference):
    tokenizer, greedy, _ = reference
    expected = greedy(_fim_prompt(PREFIX, SUFFIX), 16)
    out = OpenAI(base_url=fim_server.url + "/v1", api_key="x").completions.create(
        model=MODEL, prompt=PREFIX, suffix=SUFFIX, max_tokens=16, temperature=0)
    choice = out.choices[0]
    assert choice.text == tokenizer.decode(expected)  # the middle only
    assert out.usage.prompt_tokens == len(_fim_prompt(PREFIX, SUFFIX))
    assert out.usage.completion_tokens == len(expected) == 16
    assert choice.finish_reason == "length"


def test_a_batch_and_concurrent_requests_each_get_mlx_lm_s_middle(fim_server, reference):
    tokenizer, greedy, _ = reference
    prefixes = ["x = ", "for i in range(", "class A:\n    def __init__(self"]
    expected = [tokenizer.decode(greedy(_fim_prompt(p, SUFFIX), 12)) for p in prefixes]
    out = _complete(fim_server, prompt=prefixes, suffix=SUFFIX, max_tokens=12, temperature=0)
    assert [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])] == expected

    # The same prompts as separate requests at once: batched by the engine.
    texts: dict[int, str] = {}

    def one(i: int) -> None:
        texts[i] = _complete(fim_server, prompt=prefixes[i], suffix=SUFFIX, max_tokens=12,
                             temperature=0)["choices"][0]["text"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prefixes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [texts[i] for i in range(len(prefixes))] == expected


def test_token_id_prompt_and_empty_suffix(fim_server, reference):
    tokenizer, greedy, _ = reference
    ids = _bytes(PREFIX)
    expected = greedy(_fim_prompt(ids, ""), 10)
    out = _complete(fim_server, prompt=ids, suffix="", max_tokens=10, temperature=0)
    assert out["choices"][0]["text"] == tokenizer.decode(expected)
    assert out["usage"]["prompt_tokens"] == len(ids) + 3


def test_marker_text_in_the_code_is_code_not_a_marker(fim_server, reference):
    tokenizer, greedy, _ = reference
    prefix = "s = '<|fim_middle|>' + "
    suffix = "  # <|fim_prefix|>\n"
    out = _complete(fim_server, prompt=prefix, suffix=suffix, max_tokens=8, temperature=0)
    prompt = _fim_prompt(prefix, suffix)  # the markers' text as bytes, not as tokens
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert out["choices"][0]["text"] == tokenizer.decode(greedy(prompt, 8))


def test_the_family_end_token_stops_the_middle(fim_server):
    # `<|endoftext|>` is not this model's EOS: a plain completion runs on through it,
    # an infilling one ends there, as Qwen2.5-Coder's middles do.
    bias = {str(ENDOFTEXT): 100}
    plain = _complete(fim_server, prompt=PREFIX, max_tokens=4, temperature=0, logit_bias=bias)
    assert plain["choices"][0]["finish_reason"] == "length"
    assert plain["usage"]["completion_tokens"] == 4
    fim = _complete(fim_server, prompt=PREFIX, suffix=SUFFIX, max_tokens=4, temperature=0,
                    logit_bias=bias)
    assert fim["choices"][0]["finish_reason"] == "stop"
    assert fim["choices"][0]["text"] == ""
    assert fim["usage"]["completion_tokens"] == 0  # an end token is not output, as EOS is not


def test_echo_returns_the_prompt_then_the_middle(fim_server, reference):
    tokenizer, greedy, scores = reference
    middle = tokenizer.decode(greedy(_fim_prompt(PREFIX, SUFFIX), 6))
    out = _complete(fim_server, prompt=PREFIX, suffix=SUFFIX, echo=True, max_tokens=6, temperature=0)
    assert out["choices"][0]["text"] == PREFIX + middle

    # Scored: the prompt's tokens as they stand in the infilling prompt, nothing else.
    prompt = _fim_prompt(PREFIX, SUFFIX)
    out = _complete(fim_server, prompt=PREFIX, suffix=SUFFIX, echo=True, logprobs=1, max_tokens=0)
    lp = out["choices"][0]["logprobs"]
    assert out["choices"][0]["text"] == PREFIX
    assert "".join(lp["tokens"]) == PREFIX
    ref = scores(prompt)
    expected = [float(ref[j - 1, prompt[j]]) for j in range(1, 1 + len(_bytes(PREFIX)))]
    assert lp["token_logprobs"] == pytest.approx(expected, abs=1e-4)


def test_streaming_sends_the_middle_and_with_echo_the_prompt_first(fim_server, reference):
    tokenizer, greedy, _ = reference
    middle = tokenizer.decode(greedy(_fim_prompt(PREFIX, SUFFIX), 10))
    for echo in (False, True):
        chunks = []
        with httpx.stream("POST", f"{fim_server.url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 10,
            "temperature": 0, "stream": True, "echo": echo,
        }) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
        assert "".join(texts) == (PREFIX + middle if echo else middle)
        if echo:
            assert texts[0] == PREFIX
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_model_without_fim_tokens_refuses_suffix_and_keeps_serving(server):
    """The default tiny model's tokenizer has no infilling markers: 400 naming `suffix`,
    while a stream in flight on the same server runs to the end untouched."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 24, "temperature": 0}
    alone = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
    text: list[str] = []
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                      json={**body, "stream": True}) as stream:
        lines = stream.iter_lines()
        for line in lines:  # the first token is out: the request is in flight
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
                break
        for prompt in ("def f(", [1, 2, 3], ["a", "b"]):
            r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": prompt, "suffix": "x"})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "suffix"
            assert error["type"] == "invalid_request_error"
            assert error["code"] == "fim_not_supported"
            assert "no fill-in-the-middle tokens" in error["message"]
        for line in lines:
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(text) == alone["choices"][0]["text"]


# openai-python's own "all params" completion request (tests/api_resources/test_completions.py),
# which its suite sends to a mock server; `logit_bias` there is `{"foo": 0}`, which OpenAI's
# API refuses ("Invalid key in 'logit_bias'"), as this server does: a token id here.
SDK_ALL_PARAMS = {
    "model": "gpt-3.5-turbo-instruct", "prompt": "This is a test.", "best_of": 0, "echo": True,
    "frequency_penalty": -2, "logprobs": 0, "max_tokens": 16, "n": 1,
    "presence_penalty": -2, "seed": 0, "stop": "\n",
    "stream_options": {"include_obfuscation": True, "include_usage": True}, "suffix": "test.",
    "temperature": 1, "top_p": 1, "user": "user-1234",
}


@pytest.mark.parametrize("stream", [False, True])
def test_openai_python_all_params_completion_is_served(fim_server, stream):
    # Strict response validation where the SDK's type fits the wire: its `Completion` type
    # for a stream's chunks wants a `finish_reason` that mid-stream chunks have as null,
    # at OpenAI too.
    client = OpenAI(base_url=fim_server.url + "/v1", api_key="x", _strict_response_validation=not stream)
    body = {**SDK_ALL_PARAMS, "model": MODEL, "stream": stream}
    refused = client.completions.with_raw_response.create
    with pytest.raises(Exception) as bad:
        refused(**{**body, "logit_bias": {"foo": 0}})
    assert bad.value.status_code == 400 and bad.value.body["param"] == "logit_bias"
    assert "'foo'" in bad.value.body["message"]  # the message names the key
    out = client.completions.create(**body, logit_bias={"0": 0})
    if not stream:
        text = out.choices[0].text
        assert out.choices[0].logprobs is not None
    else:
        text = "".join(c.choices[0].text for c in out if c.choices)
    assert text.startswith("This is a test.")  # echo: the prompt, then the middle
    assert "test.test." not in text  # never the suffix
