"""Prompt logprobs come from the prefill's own logits and equal mlx-lm's forward pass over
the same tokens: alone, beside other requests, after a prefix-cache hit, and without
generating (max_tokens 0)."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from engine import EngineRequest, SamplingParams
from engine.prompt_scoring import score_chunk, scoring_bytes


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(0, 256) for _ in range(n))


def _reference(model, prompt: tuple[int, ...]) -> np.ndarray:
    """log-softmax of mlx-lm's own forward pass: row j scores token j + 1."""
    logits = model(mx.array(prompt)[None])[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def _check(scores, prompt, reference, top: int) -> None:
    assert len(scores) == len(prompt)
    assert scores[0] is None
    for j in range(1, len(prompt)):
        entry = scores[j]
        assert entry.token == prompt[j]
        assert entry.logprob == pytest.approx(float(reference[j - 1, prompt[j]]), abs=1e-4)
        best = np.argsort(-reference[j - 1])[:top]
        assert [t for t, _ in entry.top] == [int(b) for b in best]


def _scores(h, request_id: str):
    return next(o.prompt_logprobs for o in h.outputs if o.request_id == request_id and o.prompt_logprobs)


@pytest.fixture
def scoring_engine(make_engine):
    def make(**config):
        h = make_engine(**config)
        h.outputs = []
        publish = h.core.publish

        def keep(outputs):
            h.outputs.extend(outputs)
            publish(outputs)

        h.core.publish = keep
        return h

    return make


def test_scores_alone_across_chunks_without_generating(scoring_engine, tiny_loaded):
    prompt = _prompt(1, 150)
    h = scoring_engine(prefill_step_size=64)
    h.submit(EngineRequest("s", prompt, 0, SamplingParams(temperature=0.0), prompt_logprobs=3))
    h.run_until(lambda: "s" in h.out.finished)
    assert h.out.finished["s"] == "length" and h.out.tokens["s"] == []
    _check(_scores(h, "s"), prompt, _reference(tiny_loaded.model, prompt), top=3)
    assert h.core.stats.kv_bytes == 0


def test_scores_in_a_batch_then_generates_as_an_unscored_request_would(scoring_engine, tiny_loaded):
    prompts = {f"r{i}": _prompt(10 + i, n) for i, n in enumerate((40, 130, 9))}
    alone = scoring_engine(prefill_step_size=64, prefix_cache_bytes=0)
    alone.submit(EngineRequest("r1", prompts["r1"], 6, SamplingParams(temperature=0.0)))
    alone.run_until(lambda: "r1" in alone.out.finished)

    h = scoring_engine(prefill_step_size=64, max_step_tokens=200, prefix_cache_bytes=0)
    for rid, prompt in prompts.items():
        scored = 2 if rid != "r2" else None
        h.submit(EngineRequest(rid, prompt, 6, SamplingParams(temperature=0.0), prompt_logprobs=scored))
    h.run_until(lambda: len(h.out.finished) == 3)
    assert h.core.stats.max_batch == 3
    for rid in ("r0", "r1"):
        _check(_scores(h, rid), prompts[rid], _reference(tiny_loaded.model, prompts[rid]), top=2)
    assert not any(o.prompt_logprobs for o in h.outputs if o.request_id == "r2")
    assert h.out.tokens["r1"] == alone.out.tokens["r1"]


def test_a_prompt_in_the_prefix_cache_is_still_scored_whole(scoring_engine, tiny_loaded):
    prompt = _prompt(7, 120)
    h = scoring_engine(prefill_step_size=64)
    h.submit(EngineRequest("warm", prompt, 2, SamplingParams(temperature=0.0)))
    h.run_until(lambda: "warm" in h.out.finished)
    h.submit(EngineRequest("hit", prompt, 2, SamplingParams(temperature=0.0)))
    h.run_until(lambda: "hit" in h.out.finished)
    assert h.out.cached["hit"] > 0  # the cache does hold the prompt
    h.submit(EngineRequest("scored", prompt, 0, SamplingParams(temperature=0.0), prompt_logprobs=1))
    h.run_until(lambda: "scored" in h.out.finished)
    assert h.out.cached["scored"] == 0  # as documented: the cached part is recomputed
    _check(_scores(h, "scored"), prompt, _reference(tiny_loaded.model, prompt), top=1)


def test_a_prefixs_scores_are_the_same_inside_a_longer_prompt(scoring_engine):
    longer = _prompt(3, 90)
    h = scoring_engine(prefill_step_size=32)
    for rid, prompt in (("short", longer[:40]), ("long", longer)):
        h.submit(EngineRequest(rid, prompt, 0, SamplingParams(temperature=0.0), prompt_logprobs=0))
        h.run_until(lambda rid=rid: rid in h.out.finished)
    short, long = _scores(h, "short"), _scores(h, "long")
    assert [e.logprob for e in short[1:]] == pytest.approx([e.logprob for e in long[1:40]], abs=1e-4)


def test_scoring_costs_no_second_forward_pass(scoring_engine, tiny_loaded, monkeypatch):
    """Each prompt position goes through the model once, as an unscored prefill's would:
    the scores are read from the prefill's own logits."""
    h = scoring_engine(prefill_step_size=64)
    fed: list[int] = []
    forward = type(tiny_loaded.model).__call__

    def counted(self, inputs, *args, **kwargs):
        fed.append(inputs.shape[-1])
        return forward(self, inputs, *args, **kwargs)

    monkeypatch.setattr(type(tiny_loaded.model), "__call__", counted)
    prompt = _prompt(5, 150)
    h.submit(EngineRequest("s", prompt, 0, SamplingParams(temperature=0.0), prompt_logprobs=2))
    h.run_until(lambda: "s" in h.out.finished)
    assert len(_scores(h, "s")) == len(prompt)
    assert fed == [64, 64, 21]  # the prompt but its last token, whose logits score nothing


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("top", [0, 5])
def test_scoring_holds_no_more_than_admission_counts(dtype, top):
    """The chunk's logits and everything scoring them allocates, at its peak, fit in what
    admission adds for a scored chunk (the log-softmax and a negated copy for the top-k
    once took 4.0 [T, vocab] float32 buffers where admission counted 3)."""
    tokens, vocab = 128, 65536
    rng = np.random.default_rng(top)
    hidden = mx.array(rng.standard_normal((tokens, 32)).astype(np.float32)).astype(dtype)
    head = mx.array(rng.standard_normal((vocab, 32)).astype(np.float32)).astype(dtype)
    mx.eval(hidden, head)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    scores = score_chunk(hidden @ head.T, list(range(tokens)), top)
    peak = mx.get_peak_memory() - before
    assert len(scores) == tokens and all(len(s.top) == top for s in scores)
    assert peak <= scoring_bytes(tokens, vocab, dtype.size, top) + (1 << 20), peak
