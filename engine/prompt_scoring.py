"""Prompt logprobs: each prompt token's log-probability given the tokens before it.

Evaluation harnesses score a text through `/v1/completions` with `echo` and `logprobs`
(lm-evaluation-harness's `local-completions` sums them per choice). The numbers come from
the prefill's own logits, so scoring costs no second forward pass: the chunk's logits at
position j give the distribution of prompt token j + 1. A prefill evaluates only the KV
cache otherwise; a scoring request also evaluates its chunk's logits, [T, vocab] in
float32, which admission counts (`engine.admission`, `scoring_bytes`).

A prefix-cache hit has no logits for the cached part, so a scoring request does not use
the prefix cache: its whole prompt is recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from engine.request import TokenLogprob


def scoring_bytes(tokens: int, vocab: int, dtype_bytes: int, top: int) -> int:
    """What scoring a chunk of `tokens` holds at its peak, which admission counts: the chunk's
    logits in the model's dtype, their float32 cast (none when they are float32 already),
    and with alternatives (`top` > 0) the partition's uint32 indices, each [tokens, vocab].
    Measured on the CPU with MLX 0.32 (peak over the inputs, in [T, vocab] float32 buffers):
    float32 logits 1.0 without alternatives and 2.0 with, bfloat16 1.5 and 2.5 (the full
    log-softmax and a negated copy for the partition had made it 2.0 / 4.0 and 2.5 / 4.5)."""
    per_row = dtype_bytes + (4 if dtype_bytes != 4 else 0) + (4 if top > 0 else 0)
    return tokens * vocab * per_row


def score_chunk(logits: mx.array, next_tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """`logits` is [T, vocab] for one chunk; `next_tokens[j]` the token that followed
    position j (as many as there are positions to score, at most T).

    A log-probability is the logit less the row's log-sum-exp: the full log-softmax is
    never built, and the top alternatives are found on the logits themselves (the same
    order)."""
    n = len(next_tokens)
    if n == 0:
        return []
    rows = logits[:n].astype(mx.float32)
    norm = mx.logsumexp(rows, axis=-1, keepdims=True)
    targets = mx.array(next_tokens, dtype=mx.uint32)[:, None]
    chosen = (mx.take_along_axis(rows, targets, axis=-1) - norm)[:, 0]
    if top > 0:
        vocab = rows.shape[-1]
        top_ids = mx.argpartition(rows, kth=vocab - top, axis=-1)[:, vocab - top :]
        top_lp = mx.take_along_axis(rows, top_ids, axis=-1) - norm
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
