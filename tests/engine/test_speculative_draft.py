"""Speculative decoding from a draft model (engine.speculative.draft): exact.

The draft model is the target itself (every draft is the target's own greedy token, so
every one is accepted: a wrong trim or a misfed cache would show as a rejection), or a
smaller tiny model with other random weights (most drafts rejected: each rejection trims
the draft's cache back). Either way the target's tokens and logprobs are those it gives
without speculation, alone and in a batch of rows that accept different numbers of drafts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import EngineRequest, SamplingParams
from engine.loader import LoadedModel
from engine.speculative import DraftModel, DraftModelError, SpeculativeConfig
from engine.tiny_model import TinyModelShape, build_tiny_model
from tests.engine.test_speculative import _echo_prompt, _mixed, _random_prompt, _run


@pytest.fixture(scope="module")
def other_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller tiny model (2 layers, other weights) with the same tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("draft") / "tiny-draft",
                            TinyModelShape(num_hidden_layers=2, seed=11))


def _spec(draft: Path | str, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig("draft-model", num_tokens=k, max_rows=8, draft_model=str(draft))


def test_the_target_as_its_own_draft_accepts_every_draft_and_stays_exact(
        make_engine, tiny_model_path: Path) -> None:
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    req = EngineRequest("random", _random_prompt(3, 50), 40, params)
    base = _run(make_engine, [req], None)
    spec = _run(make_engine, [req], _spec(tiny_model_path))
    assert spec.out.tokens["random"] == base.out.tokens["random"]
    assert spec.out.logprobs["random"] == pytest.approx(base.out.logprobs["random"], abs=1e-4)
    report = spec.core.stats.speculative
    assert report is not None and report["draft_model"] == str(tiny_model_path)
    assert report["drafted_tokens"] > 0 and report["accepted_tokens"] == report["drafted_tokens"]
    assert report["draft_cache_bytes"] == 0  # a finished row's draft cache is dropped
    assert spec.core.stats.decode_steps < base.core.stats.decode_steps / 3


def test_another_model_s_drafts_are_verified_and_the_output_is_exact_alone_and_batched(
        make_engine, other_tiny: Path) -> None:
    req = EngineRequest("echo", _echo_prompt(0), 48, SamplingParams(temperature=0.0, logprobs=True))
    base = _run(make_engine, [req], None)
    alone = _run(make_engine, [req], _spec(other_tiny))
    assert alone.out.tokens["echo"] == base.out.tokens["echo"]
    assert alone.out.logprobs["echo"] == pytest.approx(base.out.logprobs["echo"], abs=1e-4)
    report = alone.core.stats.speculative
    assert report is not None and 0 <= report["accepted_tokens"] < report["drafted_tokens"]

    base = _run(make_engine, _mixed(), None)
    h = make_engine(prefix_cache_bytes=0, speculative=_spec(other_tiny, k=3), max_concurrency=8)
    reqs = _mixed()  # greedy, a stop token, fewer tokens than drafts, a penalised row, a seeded sampler
    for r in reqs[:3]:
        h.submit(r)
    h.run_until(lambda: len(h.core.batch.seqs) >= 2)
    for r in reqs[3:]:
        h.step()
        h.submit(r)
    h.run_until(lambda: h.out.finished.keys() >= {r.request_id for r in reqs})
    for r in reqs:
        assert h.out.tokens[r.request_id] == base.out.tokens[r.request_id], r.request_id
        assert h.out.finished[r.request_id] == base.out.finished[r.request_id]
    assert h.core.stats.speculative["steps"] > 0
    assert not h.core.store.requests


def test_a_draft_that_cannot_draft_for_the_target_is_refused(tiny_loaded: LoadedModel) -> None:
    vocab = tiny_loaded.tokenizer.get_vocab()
    shifted = {t: (i + 1) % len(vocab) for t, i in vocab.items()}
    with pytest.raises(DraftModelError, match="tokenizer differs from the target's"):
        DraftModel.check(tiny_loaded.model, shifted, vocab)
    DraftModel.check(tiny_loaded.model, vocab, vocab)  # the same tokens, plain attention: fine
    from tests.engine.tiny_archs import build  # a sliding-window model: its caches do not trim

    with pytest.raises(DraftModelError, match=r"\(KVCache, RotatingKVCache\) cannot be trimmed"):
        DraftModel.check(build("gemma3_text"), vocab, vocab)
