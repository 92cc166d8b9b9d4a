"""Batched sampling: one set of array ops for the whole decode batch, per-row parameters.

Each row keeps its own temperature, top-p, top-k, min-p and seed, yet the batch is
sampled in one call (no per-row model calls), so a seeded request is reproducible
without being taken out of the batch: its noise comes from a key derived from its seed
and its token index, never from the shared generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.request import SamplingParams

_SEED_MIX = 0x9E3779B1


@dataclass(frozen=True)
class SampledStep:
    """Lazy arrays for one step: evaluate them with mx.async_eval, read them later."""

    tokens: mx.array  # [B] uint32
    logprobs: mx.array | None  # [B] logprob of the chosen token
    top_ids: mx.array | None  # [B, K]
    top_logprobs: mx.array | None  # [B, K]

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.tokens, self.logprobs, self.top_ids, self.top_logprobs) if a is not None]


class BatchSampler:
    """Holds the batch's per-row parameters as arrays; rebuilt only when rows change."""

    def __init__(self, params: list[SamplingParams]) -> None:
        self.params = params
        self._all_greedy = all(p.greedy for p in params)
        self._truncates = any(p.truncates and not p.greedy for p in params)
        self._seeded = [i for i, p in enumerate(params) if p.seed is not None and not p.greedy]
        self._want_logprobs = any(p.logprobs for p in params)
        self._top_k_logprobs = max((p.top_logprobs for p in params), default=0)
        if not self._all_greedy:
            self._temps = mx.array([max(p.temperature, 1e-6) for p in params])[:, None]
            self._greedy_rows = mx.array([p.greedy for p in params])
        if self._truncates:
            self._top_p = mx.array([p.top_p for p in params])[:, None]
            self._top_k = mx.array([p.top_k if p.top_k > 0 else 0 for p in params])
            self._min_p = mx.array([p.min_p for p in params])[:, None]

    def sample(self, logits: mx.array, steps: list[int]) -> SampledStep:
        """`logits` is [B, V]; `steps[i]` is the index of the token row i is about to emit."""
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self._all_greedy:
            tokens = mx.argmax(logprobs, axis=-1)
        else:
            scaled = logprobs / self._temps
            if self._truncates:
                scaled = self._truncate(scaled, logprobs)
            noise = self._gumbel(scaled.shape, steps)
            sampled = mx.argmax(scaled + noise, axis=-1)
            tokens = mx.where(self._greedy_rows, mx.argmax(logprobs, axis=-1), sampled)
        tokens = tokens.astype(mx.uint32)
        if not self._want_logprobs:
            return SampledStep(tokens, None, None, None)
        chosen = mx.take_along_axis(logprobs, tokens[:, None].astype(mx.int32), axis=-1)[:, 0]
        top_ids = top_lp = None
        if self._top_k_logprobs > 0:
            k = self._top_k_logprobs
            top_ids = mx.argsort(-logprobs, axis=-1)[:, :k]
            top_lp = mx.take_along_axis(logprobs, top_ids, axis=-1)
        return SampledStep(tokens, chosen, top_ids, top_lp)

    def _truncate(self, scaled: mx.array, logprobs: mx.array) -> mx.array:
        vocab = scaled.shape[-1]
        sorted_desc = -mx.sort(-scaled, axis=-1)
        # top-k: the k-th largest value is the smallest one kept
        k = mx.where(self._top_k > 0, mx.minimum(self._top_k, vocab), vocab)
        kth = mx.take_along_axis(sorted_desc, (k - 1)[:, None].astype(mx.int32), axis=-1)
        # top-p: keep the smallest prefix whose probability mass reaches top_p
        probs = mx.softmax(sorted_desc, axis=-1)
        before = mx.cumsum(probs, axis=-1) - probs
        keep_n = mx.maximum(mx.sum(before < self._top_p, axis=-1), 1)
        pth = mx.take_along_axis(sorted_desc, (keep_n - 1)[:, None].astype(mx.int32), axis=-1)
        threshold = mx.maximum(kth, pth)
        # min-p: relative to the most likely token, on the scaled distribution
        top = sorted_desc[:, :1]
        min_p_th = mx.where(self._min_p > 0, top + mx.log(mx.maximum(self._min_p, 1e-30)), -mx.inf)
        threshold = mx.maximum(threshold, min_p_th)
        return mx.where(scaled >= threshold, scaled, -mx.inf)

    def _gumbel(self, shape: tuple[int, ...], steps: list[int]) -> mx.array:
        noise = mx.random.gumbel(shape=shape)
        if not self._seeded:
            return noise
        rows = []
        for i in self._seeded:
            seed = self.params[i].seed or 0
            key = mx.random.key((seed * _SEED_MIX + steps[i]) & 0xFFFFFFFFFFFF)
            rows.append(mx.random.gumbel(shape=(shape[-1],), key=key))
        seeded = mx.array(self._seeded)
        return _scatter_rows(noise, seeded, mx.stack(rows))


def _scatter_rows(base: mx.array, rows: mx.array, values: mx.array) -> mx.array:
    out = base
    out[rows] = values
    return out
