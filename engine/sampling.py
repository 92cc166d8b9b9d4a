"""Batched sampling: one set of array ops for the whole decode batch, per-row parameters.

Each row keeps its own temperature, top-p, top-k, min-p and seed, yet the batch is
sampled in one call (no per-row model calls), so a seeded request is reproducible
without being taken out of the batch: its noise comes from a key derived from its seed
and its token index, never from the shared generator.

Rows may also carry a `LogitsProcessor` (grammar constraint, frequency and presence
penalties) and a static `logit_bias`. Those are applied to the logits before anything
else; a batch without them skips that code entirely. A processor needs every sampled
token back before it can mask the next one: `needs_feedback` tells the decode batch to
call `accept` with the previous step's tokens before `sample`.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine.logits_processor import LogitsProcessor, bitmask_words
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
        self._processors: list[tuple[int, LogitsProcessor]] = [
            (i, p.processor) for i, p in enumerate(params) if p.processor is not None
        ]
        self._constrained = [(i, pr) for i, pr in self._processors if pr.constraint is not None]
        self._penalized = [(i, pr) for i, pr in self._processors if pr.penalized]
        self._biased = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
        self._bias: mx.array | None = None
        self._bitmask: np.ndarray | None = None

    @property
    def needs_feedback(self) -> bool:
        """Some row must see each sampled token before its next one can be sampled."""
        return bool(self._processors)

    def accept(self, tokens: list[int]) -> None:
        """The tokens the batch just emitted, one per row, in row order; rows past the end
        (they joined this step) have emitted nothing yet."""
        for i, processor in self._processors:
            if i < len(tokens):
                processor.accept(tokens[i])

    def sample(self, logits: mx.array, steps: list[int]) -> SampledStep:
        """`logits` is [B, V]; `steps[i]` is the index of the token row i is about to emit."""
        if self._biased or self._processors:
            logits = self._shape_logits(logits)
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

    def _shape_logits(self, logits: mx.array) -> mx.array:
        rows, vocab = logits.shape
        logits = logits.astype(mx.float32)
        if self._biased:
            if self._bias is None:
                self._bias = _sparse_rows(rows, vocab, [
                    (i, [t for t, _ in pairs if t < vocab], [b for t, b in pairs if t < vocab])
                    for i, pairs in self._biased
                ])
            logits = logits + self._bias
        if self._penalized:
            logits = logits - _sparse_rows(rows, vocab, [(i, *pr.penalties()) for i, pr in self._penalized])
        if self._constrained:
            words = bitmask_words(vocab)
            if self._bitmask is None or self._bitmask.shape != (rows, words):
                self._bitmask = np.full((rows, words), -1, dtype=np.int32)
            for i, processor in self._constrained:
                assert processor.constraint is not None
                processor.constraint.fill_bitmask(self._bitmask[i])
            allowed = _unpack_bitmask(mx.array(self._bitmask), vocab)
            logits = mx.where(allowed, logits, -mx.inf)
        return logits

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


def _unpack_bitmask(words: mx.array, vocab: int) -> mx.array:
    """int32 words [B, W] -> bool [B, vocab]; bit t % 32 of word t // 32 is token t."""
    shifts = mx.arange(32, dtype=mx.uint32)
    bits = (words.astype(mx.uint32)[:, :, None] >> shifts) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab].astype(mx.bool_)


def _sparse_rows(rows: int, vocab: int, entries: list[tuple[int, list[int], list[float]]]) -> mx.array:
    """A [rows, vocab] array, zero except at the given (row, token) values, built on the
    device from the sparse entries (no dense host buffer per step)."""
    r: list[int] = []
    c: list[int] = []
    v: list[float] = []
    for row, ids, values in entries:
        r += [row] * len(ids)
        c += ids
        v += values
    dense = mx.zeros((rows, vocab), dtype=mx.float32)
    if not r:
        return dense
    return dense.at[mx.array(r), mx.array(c)].add(mx.array(v, dtype=mx.float32))


def _scatter_rows(base: mx.array, rows: mx.array, values: mx.array) -> mx.array:
    out = base
    out[rows] = values
    return out
