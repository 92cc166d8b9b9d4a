"""Speculative decoding by prompt lookup (engine.speculative): exact.

Greedy rows give the tokens and logprobs they give without speculation, alone and in a
batch whose rows accept different numbers of drafts (an echo-heavy prompt, random ones, a
penalised row that never drafts, a stop token, max_tokens smaller than the drafts); a
seeded sampling row gives the same tokens too (its noise is keyed by token index). The
acceptance itself is checked for the distribution it samples on a small vocabulary.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from engine import EngineRequest, SamplingParams
from engine.logits_processor import LogitsProcessor
from engine.sampling import BatchSampler
from engine.speculative import NgramIndex, SpeculativeConfig, accepted_length

LOOKUP = SpeculativeConfig("prompt-lookup", num_tokens=4, max_rows=8)


def _echo_prompt(seed: int, copies: int = 3) -> tuple[int, ...]:
    """A short text repeated: what an editor sends back with a small change."""
    rng = random.Random(seed)
    text = [rng.randrange(97, 123) for _ in range(60)]
    return tuple(text * copies)


def _random_prompt(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(0, 256) for _ in range(n))


def _run(make_engine, requests: list[EngineRequest], spec: SpeculativeConfig | None):
    h = make_engine(prefix_cache_bytes=0, **({"speculative": spec} if spec else {}))
    for r in requests:
        h.submit(r)
    h.run_until(lambda: h.out.finished.keys() >= {r.request_id for r in requests})
    return h


@pytest.mark.parametrize(("tokens", "last", "k", "draft"), [
    ((1, 2, 3, 4, 1, 2), None, 3, (3, 4, 1)),  # "1 2" seen before: what followed it
    ((1, 2, 3, 4, 1), 2, 3, (3, 4, 1)),  # the next input ends the tail
    ((1, 2, 3, 1, 2, 4, 1, 2), None, 2, (4, 1)),  # the latest occurrence wins
    ((5, 6, 7, 8), None, 3, ()),  # nothing repeats
    ((1, 2, 3, 1), 2, 5, (3, 1, 2, 3, 1)),  # into the next input, then around the repeat
    ((7, 7, 7), None, 3, (7, 7, 7)),
    ((1, 2, 3), None, 0, ()),
])
def test_ngram_index_proposes_what_followed_the_tail(tokens, last, k, draft):
    assert NgramIndex(tokens).propose(k, last) == draft


def test_ngram_index_prefers_the_longest_match_and_grows():
    idx = NgramIndex((1, 2, 3, 7, 9, 2, 3, 8), min_ngram=2, max_ngram=3)
    assert idx.propose(1) == ()
    idx.extend((1, 2, 3))
    assert idx.propose(1) == (7,)  # "1 2 3" matched, not the later "2 3" (followed by 8)
    assert accepted_length((4, 5, 6), (4, 5, 7, 1)) == 2
    assert accepted_length((), (3,)) == 0


def test_greedy_output_is_identical_alone_and_drafts_are_accepted(make_engine):
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    req = EngineRequest("echo", _echo_prompt(0), 64, params)
    base = _run(make_engine, [req], None)
    spec = _run(make_engine, [req], LOOKUP)
    assert spec.out.tokens["echo"] == base.out.tokens["echo"]
    assert len(spec.out.tokens["echo"]) == 64
    assert spec.out.logprobs["echo"] == pytest.approx(base.out.logprobs["echo"], abs=1e-4)
    report = spec.core.stats.speculative
    assert report is not None
    assert report["accepted_tokens"] > 0
    assert report["tokens_per_verified_row"] > 1
    assert report["tokens_per_row_step"] > 1
    assert spec.core.stats.decode_steps < base.core.stats.decode_steps


def _mixed() -> list[EngineRequest]:
    greedy = SamplingParams(temperature=0.0, logprobs=True)
    return [
        EngineRequest("echo", _echo_prompt(1), 48, greedy),
        EngineRequest("echo-stop", _echo_prompt(2, copies=4), 60, greedy, stop_token_ids=frozenset({111})),
        EngineRequest("short", _echo_prompt(3), 3, greedy),  # fewer tokens left than drafts
        EngineRequest("random", _random_prompt(4, 37), 40, greedy),
        EngineRequest("penalised", _echo_prompt(5), 30, SamplingParams(
            temperature=0.0, logprobs=True, processor=LogitsProcessor(frequency_penalty=0.8))),
        EngineRequest("seeded", _echo_prompt(6), 40, SamplingParams(temperature=0.8, top_p=0.9, seed=7)),
    ]


def test_batched_rows_accept_their_own_drafts_and_stay_exact(make_engine):
    base = _run(make_engine, _mixed(), None)
    h = make_engine(prefix_cache_bytes=0, speculative=LOOKUP, max_concurrency=8)
    reqs = _mixed()  # fresh processors
    for r in reqs[:3]:
        h.submit(r)
    h.run_until(lambda: len(h.core.batch.seqs) >= 2)
    for r in reqs[3:]:  # join while the first ones speculate
        h.step()
        h.submit(r)
    h.run_until(lambda: h.out.finished.keys() >= {r.request_id for r in reqs})
    for r in reqs:
        assert h.out.tokens[r.request_id] == base.out.tokens[r.request_id], r.request_id
        assert h.out.logprobs[r.request_id] == pytest.approx(base.out.logprobs[r.request_id], abs=1e-4)
        assert h.out.finished[r.request_id] == base.out.finished[r.request_id]
    assert h.out.finished["echo-stop"] == "stop"
    report = h.core.stats.speculative
    assert report is not None and report["accepted_tokens"] > 0 and report["steps"] > 0
    assert h.core.stats.max_batch >= 4
    assert not h.core.store.requests  # every reservation went back


def test_speculation_turns_itself_off_above_max_rows(make_engine):
    spec = SpeculativeConfig("prompt-lookup", max_rows=2)
    greedy = SamplingParams(temperature=0.0)
    reqs = [EngineRequest(f"r{i}", _echo_prompt(10 + i), 24, greedy) for i in range(3)]
    h = make_engine(prefix_cache_bytes=0, speculative=spec)
    for r in reqs:
        h.submit(r)
    h.run_until(lambda: len(h.core.batch.seqs) == 3)
    for _ in range(5):
        h.step()
    assert h.core.stats.speculative["steps"] == 0  # three rows: the ordinary step
    h.run_until(lambda: len(h.out.finished) == 3)
    base = _run(make_engine, reqs, None)
    assert h.out.tokens == base.out.tokens


def test_acceptance_samples_the_targets_distribution():
    """Many single-step draws through the acceptance on a vocabulary of 8: a draft is a
    point mass q, so it is accepted with probability p(draft), and on rejection the token
    follows p with the draft removed and renormalised; with and without the draft the
    first emitted token follows p (total variation under 0.02 over 20,000 seeded draws)."""
    vocab, draws, draft = 8, 20_000, 2
    logits = mx.array([[2.0, 1.0, 1.5, 0.2, -1.0, 0.7, 0.0, 1.2]])
    params = SamplingParams(temperature=0.9, top_p=0.95)
    scaled = np.array(logits[0].tolist()) / 0.9
    p = np.exp(scaled - scaled.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.cumsum(p[order]) - p[order] < 0.95
    p_trunc = np.zeros(vocab)
    p_trunc[order[keep]] = p[order[keep]]
    p_trunc /= p_trunc.sum()

    seeded = [SamplingParams(temperature=0.9, top_p=0.95, seed=s) for s in range(draws)]
    picked = BatchSampler(seeded).sample(mx.repeat(logits, draws, axis=0), [0] * draws).tokens.tolist()
    first = np.bincount(picked, minlength=vocab) / draws  # the target's token at the draft's position
    accepted = np.array([accepted_length((draft,), (t,)) for t in picked])
    assert abs(accepted.mean() - p_trunc[draft]) < 0.015  # accepted with probability p(draft)
    rejected = np.array(picked)[accepted == 0]
    residual = np.where(np.arange(vocab) == draft, 0.0, p_trunc)
    residual /= residual.sum()
    freq = np.bincount(rejected, minlength=vocab) / len(rejected)
    assert 0.5 * np.abs(freq - residual).sum() < 0.02
    assert 0.5 * np.abs(first - p_trunc).sum() < 0.02

    plain = BatchSampler([params] * draws).sample(mx.repeat(logits, draws, axis=0), [0] * draws)
    without = np.bincount(plain.tokens.tolist(), minlength=vocab) / draws
    assert 0.5 * np.abs(first - without).sum() < 0.02


def test_a_row_whose_drafts_fail_backs_off():
    from engine.sequence import Sequence
    from engine.speculative import Speculator

    spec = Speculator(SpeculativeConfig("prompt-lookup", num_tokens=3), "cpu")
    seq = Sequence(EngineRequest("r", (1, 2, 3, 1, 2), 50))
    drafted = []
    for accepted in (0, 0, 1, 0):
        while not (draft := spec.propose(seq, None, room=10)):
            drafted.append(0)
        drafted.append(1)
        spec.record(seq, len(draft), accepted)
    # one miss: one step without a draft; two in a row: three; an acceptance resets
    assert drafted == [1, 0, 1, 0, 0, 0, 1, 1]
    assert spec.report()["backed_off_row_steps"] == 4
