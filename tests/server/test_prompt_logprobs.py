"""`/v1/completions` with `echo` and `logprobs`, as evaluation harnesses call it
(lm-evaluation-harness's `local-completions`): every prompt token scored, the first
null, offsets into the echoed text, `max_tokens: 0` scoring without generating, and the
numbers equal mlx-lm's own forward pass on the same weights."""

from __future__ import annotations

import json
from itertools import pairwise

import httpx
import mlx.core as mx
import numpy as np
import pytest

from tests.conftest import MODEL

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    from mlx_lm import load

    model, tokenizer = load(str(tiny_model_path))

    def score(tokens: list[int]) -> np.ndarray:
        logits = model(mx.array(tokens)[None])[0].astype(mx.float32)
        return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    return tokenizer, score


def _complete(server, **body) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_with_logprobs_scores_every_prompt_token_like_mlx_lm(server, reference):
    tokenizer, score = reference
    tokens = tokenizer.encode(PROMPT)
    out = _complete(server, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"] == PROMPT
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(tokens) == out["usage"]["prompt_tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = score(tokens)
    expected = [float(ref[j - 1, tokens[j]]) for j in range(1, len(tokens))]
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    offsets = [*lp["text_offset"], len(PROMPT)]
    assert offsets[0] == 0
    assert [PROMPT[a:b] for a, b in pairwise(offsets)] == lp["tokens"]  # spans of the echo
    for j in range(1, len(tokens)):  # up to 2 alternatives, the prompt's own token always there
        assert lp["tokens"][j] in lp["top_logprobs"][j] and len(lp["top_logprobs"][j]) <= 3
    assert out["usage"]["completion_tokens"] == 0


def test_echo_then_generated_tokens_continue_the_offsets(server):
    out = _complete(server, prompt=PROMPT, echo=True, logprobs=0, max_tokens=3, temperature=0)
    lp = out["choices"][0]["logprobs"]
    prompt_tokens = out["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == prompt_tokens + 3
    assert lp["text_offset"][prompt_tokens] == len(PROMPT)
    assert all(len(t) == 1 for t in lp["top_logprobs"][1:])  # logprobs 0: the sampled token alone


def test_sampled_tokens_are_among_their_top_logprobs(server):
    """OpenAI's `top_logprobs`: up to `logprobs` alternatives plus the sampled token, which a
    hot temperature often picks from outside the top one."""
    out = _complete(server, prompt="hello", max_tokens=24, logprobs=1, temperature=2.0, seed=3)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 24
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert top[token] == pytest.approx(value, abs=1e-6) and 1 <= len(top) <= 2
    assert any(len(top) == 2 for top in lp["top_logprobs"])  # some sampled token was not the best


def test_token_id_prompts_in_a_list_are_scored_each(server, reference):
    tokenizer, score = reference
    batch = [tokenizer.encode("hello world"), tokenizer.encode(PROMPT)]
    out = _complete(server, prompt=batch, echo=True, logprobs=1, max_tokens=0)
    for choice in out["choices"]:
        tokens = batch[choice["index"]]
        ref = score(tokens)
        got = choice["logprobs"]["token_logprobs"]
        assert got[0] is None
        assert got[1:] == pytest.approx([float(ref[j - 1, tokens[j]]) for j in range(1, len(tokens))],
                                        abs=1e-4)


def test_a_token_id_prompts_offsets_are_where_its_tokens_start_in_the_echo(server, reference):
    """A token-id prompt's echo is the decoding of all its ids, which is not the pieces'
    decodings laid end to end: two byte tokens make one "é". Each offset is where the text
    of the tokens before it ends in the echo, and none points past it."""
    tokenizer, _ = reference
    ids = tokenizer.encode("café ok")
    assert len(ids) > len("café ok")  # "é" is more than one token
    out = _complete(server, prompt=ids, echo=True, logprobs=0, max_tokens=0)
    choice = out["choices"][0]
    echo, offsets = choice["text"], choice["logprobs"]["text_offset"]
    assert echo == "café ok" and len(offsets) == len(ids)
    assert offsets == sorted(offsets) and max(offsets) < len(echo)
    for i, start in enumerate(offsets):
        before = tokenizer.decode(ids[:i])
        if "\ufffd" not in before:
            assert echo[:start] == before, (i, start)


def _stream(server, **body) -> list[dict]:
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("max_tokens", [2, 0])
def test_streaming_echo_sends_the_prompt_and_its_scores_first(server, reference, max_tokens):
    tokenizer, score = reference
    tokens = tokenizer.encode(PROMPT)
    chunks = _stream(server, prompt=PROMPT, echo=True, logprobs=1, max_tokens=max_tokens,
                     temperature=0)
    first = chunks[0]["choices"][0]
    assert first["text"] == PROMPT
    got = first["logprobs"]["token_logprobs"]
    assert got[0] is None and len(got) == len(tokens)
    ref = score(tokens)
    assert got[1:] == pytest.approx([float(ref[j - 1, tokens[j]]) for j in range(1, len(tokens))],
                                    abs=1e-4)
    generated = "".join(c["choices"][0]["text"] for c in chunks[1:] if c["choices"])
    assert (len(generated) > 0) == (max_tokens > 0)
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == "length"


def test_n_copies_each_carry_the_prompts_scores(server, reference):
    tokenizer, score = reference
    tokens = tokenizer.encode(PROMPT)
    out = _complete(server, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, n=3)
    assert sorted(c["index"] for c in out["choices"]) == [0, 1, 2]
    ref = score(tokens)
    expected = [float(ref[j - 1, tokens[j]]) for j in range(1, len(tokens))]
    for choice in out["choices"]:
        assert choice["text"] == PROMPT
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_with_max_tokens_0_is_an_empty_answer(server, field):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and not choice["message"]["content"]
    assert r.json()["usage"]["completion_tokens"] == 0


def test_lm_eval_local_completions_loglikelihoods_equal_mlx_lms(server, reference):
    """The requests lm-evaluation-harness's `local-completions` sends for a multiple-choice
    task (token-id prompts of context + continuation, batched, `max_tokens: 1`, `echo`,
    `logprobs: 1`) and its own parsing (`sum(token_logprobs[ctxlen:-1])`, greedy when each
    token is its position's best): real numbers, equal to mlx-lm's forward pass."""
    tokenizer, score = reference
    questions = [
        ("The capital of France is", [" Paris", " a banana", " seventeen"]),
        ("Two plus two equals", [" four", " the moon"]),
    ]
    requests = [(tokenizer.encode(ctx), tokenizer.encode(ctx + choice)) for ctx, choices in questions
                for choice in choices]
    body = {"prompt": [full for _, full in requests], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}
    out = _complete(server, **body)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert len(choices) == len(requests)
    for (ctx, full), choice in zip(requests, choices, strict=True):
        ctxlen = len(ctx)
        token_logprobs = choice["logprobs"]["token_logprobs"]
        assert len(token_logprobs) == len(full) + 1  # the prompt, then the one generated token
        loglikelihood = sum(token_logprobs[ctxlen:-1])
        ref = score(full)
        expected = sum(float(ref[j - 1, full[j]]) for j in range(ctxlen, len(full)))
        assert loglikelihood == pytest.approx(expected, abs=1e-3)
        assert loglikelihood < 0
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(lp == max(top.values()) for lp, top in zip(token_logprobs[ctxlen:-1], tops,
                                                                strict=True))
        ref_greedy = all(int(np.argmax(ref[j - 1])) == full[j] for j in range(ctxlen, len(full)))
        assert greedy == ref_greedy


def test_offsets_from_prefix_decodings_where_the_echo_does_not_re_encode_to_the_ids() -> None:
    """SentencePiece's decode drops the first piece's space: the pieces' lengths run one
    ahead of the echo; the prefixes' decodings do not."""
    from server.openai_routes import _decoded_starts

    pieces = {1: " The", 2: " cat", 3: " sat"}

    class Spm:
        def decode(self, ids: list[int]) -> str:
            return "".join(pieces[i] for i in ids).removeprefix(" ")

    assert _decoded_starts(Spm(), [1, 2, 3], "The cat sat") == [0, 3, 7]
