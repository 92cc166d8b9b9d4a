"""Verification: a row's next input and its k drafts run as one (k+1)-token chunk through
the prefill path, which writes their K/V into the row's own blocks and returns logits at
every position; the row's own sampler then picks the target's token at each position.

Acceptance. Draft j is accepted while it equals the token the target picked at its
position; the first target token that differs (or the one after the last draft) is the
row's bonus token. Every emitted token is therefore the target's own sample given the
emitted prefix, so the output is exactly the target's distribution:

- greedy: the argmax at each position, the tokens decoding without drafts would give;
- sampling: the row's Gumbel-max sample with the noise of that token's index
  (`engine.sampling`: a seeded row gives the same tokens with and without drafts). A
  draft is a point mass q, so this is rejection sampling (accept with min(1, p/q) =
  p(draft); on rejection sample from p with the draft zeroed and renormalised, which is
  what a Gumbel-max sample conditioned on differing from the draft is).

Only the input and the accepted drafts count as written (`KVStore.advance`); the slots of
rejected drafts are overwritten by the next step.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.kv import KVStore, prefill_caches
from engine.kv.prefill import PrefillRow, batch_prefill_caches, group_by_segment, plan_prefill
from engine.request import SamplingParams
from engine.sampling import BatchSampler


@dataclass(frozen=True)
class ChunkRow:
    """One row of a verification call: its input token, then its drafts."""

    row: PrefillRow
    params: SamplingParams
    step: int  # the index of the token the row's first position samples


@dataclass(frozen=True)
class Verified:
    """What the target picked at each position of one row's chunk; the logprobs when any
    row of the call asked for them (the `top_*` lists as wide as the widest request)."""

    tokens: list[int]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


def accepted_length(drafts: Seq[int], targets: Seq[int]) -> int:
    """How many leading drafts equal the target's picks."""
    n = 0
    for d, t in zip(drafts, targets, strict=False):
        if d != t:
            break
        n += 1
    return n


def verify(model: Any, store: KVStore, rows: list[ChunkRow]) -> list[Verified]:
    """Run every row's chunk (one model call per segment) and sample each position with the
    row's parameters. Synchronous: the caller needs the tokens to accept drafts."""
    out: dict[int, Verified] = {}
    index = {id(r.row): i for i, r in enumerate(rows)}
    by_row = {id(r.row): r for r in rows}
    # One shape for every row, whichever call it is in: logprobs when any row asks, the top
    # lists as wide as the widest request (rows that asked for less read a prefix).
    want = any(r.params.logprobs for r in rows)
    width_top = max((r.params.top_logprobs for r in rows), default=0) if want else 0
    layers = store.geometry.num_layers
    for group in group_by_segment([r.row for r in rows]):
        if len(group) == 1:
            one = group[0]
            caches = prefill_caches(store, one.alloc, len(one.tokens))
            logits = model(mx.array(one.tokens)[None], cache=caches)
        else:
            plan = plan_prefill(store, group)
            logits = model(plan.inputs, cache=batch_prefill_caches(plan, layers))
        width = logits.shape[1]
        flat: list[int] = []
        params: list[SamplingParams] = []
        steps: list[int] = []
        for b, row in enumerate(group):
            chunk = by_row[id(row)]
            n = len(row.tokens)
            flat.extend(range(b * width, b * width + n))
            params.extend([chunk.params] * n)
            steps.extend(range(chunk.step, chunk.step + n))
        picked = BatchSampler(params).sample(
            logits.reshape(-1, logits.shape[-1])[mx.array(flat, dtype=mx.int32)], steps
        )
        mx.eval(*picked.arrays(), *group[0].alloc.segment.arrays())
        tokens = picked.tokens.tolist()
        n_all = len(tokens)
        chosen = top_ids = top_lp = None
        if want:
            chosen = [0.0] * n_all if picked.logprobs is None else picked.logprobs.tolist()
        if width_top:
            top_ids = _widen(None if picked.top_ids is None else picked.top_ids.tolist(), n_all, width_top, 0)
            top_lp = _widen(None if picked.top_logprobs is None else picked.top_logprobs.tolist(),
                            n_all, width_top, 0.0)
        at = 0
        for row in group:
            cut = slice(at, at + len(row.tokens))
            out[index[id(row)]] = Verified(
                tokens[cut], None if chosen is None else chosen[cut],
                None if top_ids is None else top_ids[cut], None if top_lp is None else top_lp[cut],
            )
            at += len(row.tokens)
    return [out[i] for i in range(len(rows))]



def _widen(rows: list[Any] | None, n: int, width: int, fill: Any) -> list[Any]:
    """`n` lists of `width` entries: a call's top lists padded to the step's widest."""
    if rows is None:
        return [[fill] * width for _ in range(n)]
    return [r + [fill] * (width - len(r)) for r in rows]
