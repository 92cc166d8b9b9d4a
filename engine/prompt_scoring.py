"""Prompt logprobs: each prompt token's log-probability given the tokens before it.

Evaluation harnesses score a text through `/v1/completions` with `echo` and `logprobs`
(lm-evaluation-harness's `local-completions` sums them per choice). The numbers come from
the prefill's own logits, so scoring costs no second forward pass: the chunk's logits at
position j give the distribution of prompt token j + 1. A prefill evaluates only the KV
cache otherwise; a scoring request also evaluates its chunk's logits, [T, vocab] in
float32, which admission counts (`engine.admission`).

A prefix-cache hit has no logits for the cached part, so a scoring request does not use
the prefix cache: its whole prompt is recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from engine.request import TokenLogprob

# Buffers of [T, vocab] float32 alive while a chunk is scored: the logits cast to
# float32, their log-softmax, and the top-k's partition.
SCORING_BUFFERS = 3


def score_chunk(logits: mx.array, next_tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """`logits` is [T, vocab] for one chunk; `next_tokens[j]` the token that followed
    position j (as many as there are positions to score, at most T)."""
    n = len(next_tokens)
    if n == 0:
        return []
    rows = logits[:n].astype(mx.float32)
    logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    targets = mx.array(next_tokens, dtype=mx.uint32)[:, None]
    chosen = mx.take_along_axis(logprobs, targets, axis=-1)[:, 0]
    if top > 0:
        top_ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
        top_lp = mx.take_along_axis(logprobs, top_ids, axis=-1)
        order = mx.argsort(-top_lp, axis=-1)
        top_ids = mx.take_along_axis(top_ids, order, axis=-1)
        top_lp = mx.take_along_axis(top_lp, order, axis=-1)
        mx.eval(chosen, top_ids, top_lp)
        ids, lps = top_ids.tolist(), top_lp.tolist()
    else:
        mx.eval(chosen)
        ids = lps = [[] for _ in range(n)]
    return [
        TokenLogprob(tok, lp, tuple(zip(ids[j], lps[j], strict=True)))
        for j, (tok, lp) in enumerate(zip(next_tokens, chosen.tolist(), strict=True))
    ]
