"""The running batch: one decode step for every generating sequence, pipelined.

Step n+1 is queued with `mx.async_eval` before step n's tokens are read back, so the
device never waits on Python bookkeeping. Rows join after their prefill (their caches
are merged into the batch's left-padded `BatchKVCache`) and leave when they finish.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from engine.request import TokenLogprob
from engine.sampling import BatchSampler, SampledStep
from engine.sequence import Sequence


@dataclass(frozen=True)
class StepToken:
    seq: Sequence
    token: int
    logprob: TokenLogprob | None


class DecodeBatch:
    def __init__(self, model: Any) -> None:
        self.model = model
        self.seqs: list[Sequence] = []
        self.cache: list[BatchKVCache] | None = None
        self.pending: SampledStep | None = None
        self.sampler = BatchSampler([])
        self.max_batch_seen = 0

    def __len__(self) -> int:
        return len(self.seqs)

    def kv_nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache) if self.cache else 0

    def kv_length(self) -> int:
        return self.cache[0].size() if self.cache else 0

    def join(self, seq: Sequence, caches: list[KVCache], last_token: int) -> None:
        """Run the prompt's last token on its own cache, sample the first output token, join."""
        logits = self.model(mx.array([[last_token]]), cache=caches)[:, -1, :]
        first = BatchSampler([seq.request.sampling]).sample(logits, [0])
        merged = [BatchKVCache.merge([c]) for c in caches]
        if self.cache is None or self.pending is None:
            self.cache, self.pending = merged, first
        else:
            for mine, theirs in zip(self.cache, merged, strict=True):
                mine.extend(theirs)
            self.pending = _concat_steps(self.pending, first)
        mx.async_eval(*self.pending.arrays(), *[c.state for c in self.cache])
        self.seqs.append(seq)
        self.sampler = BatchSampler([s.request.sampling for s in self.seqs])
        self.max_batch_seen = max(self.max_batch_seen, len(self.seqs))

    def step(self) -> list[StepToken]:
        """Queue the next step, then read back this one's tokens."""
        current = self.pending
        if current is None or not self.seqs:
            return []
        logits = self.model(current.tokens[:, None], cache=self.cache)[:, -1, :]
        if self.sampler.needs_feedback:
            # A constrained or penalised row needs this step's tokens before the next
            # mask: queue the forward pass, read the tokens while it runs, then sample.
            mx.async_eval(logits)
            tokens = current.tokens.tolist()
            self.sampler.accept(tokens)
            self.pending = self.sampler.sample(logits, [s.generated + 1 for s in self.seqs])
            mx.async_eval(*self.pending.arrays())
        else:
            self.pending = self.sampler.sample(logits, [s.generated + 1 for s in self.seqs])
            mx.async_eval(*self.pending.arrays())
            tokens = current.tokens.tolist()
        logprobs = _read_logprobs(current, self.seqs)
        return [
            StepToken(seq, tok, logprobs[i] if logprobs else None)
            for i, (seq, tok) in enumerate(zip(self.seqs, tokens, strict=True))
        ]

    def remove(self, leaving: Seq[Sequence]) -> None:
        if not leaving:
            return
        gone = {id(s) for s in leaving}
        keep = [i for i, s in enumerate(self.seqs) if id(s) not in gone]
        if not keep:
            self.seqs, self.cache, self.pending = [], None, None
            self.sampler = BatchSampler([])
            return
        idx = mx.array(keep)
        assert self.cache is not None and self.pending is not None
        for c in self.cache:
            c.filter(idx)
        p = self.pending
        self.pending = SampledStep(
            p.tokens[idx],
            None if p.logprobs is None else p.logprobs[idx],
            None if p.top_ids is None else p.top_ids[idx],
            None if p.top_logprobs is None else p.top_logprobs[idx],
        )
        self.seqs = [self.seqs[i] for i in keep]
        self.sampler = BatchSampler([s.request.sampling for s in self.seqs])


def _concat_steps(a: SampledStep, b: SampledStep) -> SampledStep:
    def cat(x: mx.array | None, y: mx.array | None, width: int) -> mx.array | None:
        if x is None and y is None:
            return None
        x = _fill(x, y, a.tokens.shape[0], width)
        y = _fill(y, x, b.tokens.shape[0], width)
        if x.ndim == 2 and y.ndim == 2 and x.shape[1] != y.shape[1]:
            k = max(x.shape[1], y.shape[1])
            x = mx.pad(x, [(0, 0), (0, k - x.shape[1])])
            y = mx.pad(y, [(0, 0), (0, k - y.shape[1])])
        return mx.concatenate([x, y])

    return SampledStep(
        mx.concatenate([a.tokens, b.tokens]),
        cat(a.logprobs, b.logprobs, 0),
        cat(a.top_ids, b.top_ids, 1),
        cat(a.top_logprobs, b.top_logprobs, 1),
    )


def _fill(x: mx.array | None, like: mx.array | None, rows: int, width: int) -> mx.array:
    if x is not None:
        return x
    assert like is not None
    shape = (rows,) if like.ndim == 1 else (rows, like.shape[1])
    return mx.zeros(shape, like.dtype)


def _read_logprobs(step: SampledStep, seqs: list[Sequence]) -> list[TokenLogprob | None]:
    if step.logprobs is None:
        return []
    tokens = step.tokens.tolist()
    chosen = step.logprobs.tolist()
    top_ids = step.top_ids.tolist() if step.top_ids is not None else None
    top_lp = step.top_logprobs.tolist() if step.top_logprobs is not None else None
    out: list[TokenLogprob | None] = []
    for i, seq in enumerate(seqs):
        sp = seq.request.sampling
        if not sp.logprobs:
            out.append(None)
            continue
        top: tuple[tuple[int, float], ...] = ()
        if top_ids is not None and top_lp is not None and sp.top_logprobs > 0:
            top = tuple(zip(top_ids[i][: sp.top_logprobs], top_lp[i][: sp.top_logprobs], strict=True))
        out.append(TokenLogprob(tokens[i], chosen[i], top))
    return out
