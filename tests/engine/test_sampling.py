"""BatchSampler: per-row parameters in one batched call."""

from __future__ import annotations

import mlx.core as mx

from engine.request import SamplingParams
from engine.sampling import BatchSampler

VOCAB = 50


def logits(rows: int, seed: int = 0) -> mx.array:
    return mx.random.normal((rows, VOCAB), key=mx.random.key(seed)) * 3


def test_greedy_rows_take_the_argmax_even_beside_sampled_rows():
    x = logits(3)
    step = BatchSampler([SamplingParams(temperature=0), SamplingParams(temperature=1.0),
                         SamplingParams(temperature=0)]).sample(x, [0, 0, 0])
    tokens = step.tokens.tolist()
    best = mx.argmax(x, axis=-1).tolist()
    assert tokens[0] == best[0] and tokens[2] == best[2]


def test_seeded_rows_are_reproducible_whatever_the_batch():
    x = logits(4)
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = BatchSampler([seeded]).sample(x[1:2], [7]).tokens.tolist()[0]
    mixed = BatchSampler([SamplingParams(temperature=1.0), seeded, SamplingParams(),
                          SamplingParams(temperature=0)]).sample(x, [3, 7, 1, 0])
    assert mixed.tokens.tolist()[1] == alone
    draws = {BatchSampler([seeded]).sample(x[1:2], [n]).tokens.tolist()[0] for n in range(30)}
    assert len(draws) > 1  # the token index moves the key along


def test_top_k_one_and_tiny_top_p_and_large_min_p_are_greedy():
    x = logits(3, seed=1)
    best = mx.argmax(x, axis=-1).tolist()
    params = [SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=2.0, top_p=1e-6),
              SamplingParams(temperature=2.0, min_p=0.999)]
    for _ in range(5):
        assert BatchSampler(params).sample(x, [0, 0, 0]).tokens.tolist() == best


def test_top_k_limits_the_support():
    x = logits(1, seed=2)
    allowed = set(mx.argsort(-x[0])[:3].tolist())
    sampler = BatchSampler([SamplingParams(temperature=5.0, top_k=3)])
    seen = {sampler.sample(x, [0]).tokens.tolist()[0] for _ in range(60)}
    assert seen <= allowed and len(seen) > 1


def test_logprobs_of_the_chosen_token_and_top_alternatives():
    x = logits(2, seed=3)
    step = BatchSampler([SamplingParams(temperature=0, logprobs=True, top_logprobs=4),
                         SamplingParams(temperature=0)]).sample(x, [0, 0])
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    assert step.logprobs is not None and step.top_ids is not None and step.top_logprobs is not None
    assert abs(step.logprobs.tolist()[0] - mx.max(lp[0]).item()) < 1e-5
    assert step.top_ids.tolist()[0][0] == step.tokens.tolist()[0]
    values = step.top_logprobs.tolist()[0]
    assert values == sorted(values, reverse=True)
