"""The engine's admission in bytes, for one request on an idle server: a pure mirror.

The numbers follow the engine's admission arithmetic (``engine/admission.py`` over the
KV store, ``engine/kv/store.py``; keep them in step: ``tests/server/test_load_admission.py``
checks that a real server admits exactly the longest prompt computed here, and refuses one
token more) for one request at a time, on an idle server with an empty prefix cache:

- a request of P prompt tokens and M output tokens *reserves* P + M tokens of KV in whole
  blocks, allocated when it is admitted: in a new segment of the default size if that
  fits with its first full-size chunk, else in a segment sized exactly to it; a model
  whose geometry carries a cache layout of several kinds (sliding windows, recurrent
  state) is served through mlx-lm's own caches instead (``engine/dense/store.py``), which
  reserve what the request's caches hold at most and have no segments;
- every prefill chunk is predicted by :func:`~memory.estimate.estimate_prefill` times the
  tracker's margin (joining the batch copies nothing);
- each engine step runs at most ``step_tokens`` prompt tokens (one chunk unless set;
  four chunks on CUDA), in chunks of at most ``chunk_tokens``, each its own model call;
  a chunk is cut to what is left of the step's budget, except that a prompt is finished
  rather than left fewer than ``min_chunk_tokens`` for a step of their own;
- a chunk that does not fit is halved down to the floor before the request is refused,
  and a request whose full-size first chunk does not fit is still admitted when a
  floor-sized one does.

Nothing else runs on that idle server, so two rules the engine follows beside other
requests do not enter: the order among prompts (shortest remaining prefill first,
``engine.step_budget.prefill_order``) and the decode-stall target, which cuts a step's
prefill only while rows decode (``engine.step_budget.StepBudget``). Beside other requests
the target only ever makes a chunk smaller, and each chunk is still asked of the guard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .estimate import FULL, ModelGeometry, estimate_prefill
from .paged import PagedLayout, paged_layout
from .tracker import DEFAULT_MARGIN


@dataclass(frozen=True)
class EngineParams:
    """The engine settings that shape admission (mirrors ``EngineConfig`` and the KV
    store's sizes, which the server reads from the engine)."""

    chunk_tokens: int = 512
    min_chunk_tokens: int = 32
    step_tokens: int | None = None  # the engine's token budget per step (None: one chunk)
    backend: str = "cpu"
    margin: float = DEFAULT_MARGIN
    kv_block_tokens: int = 16
    kv_segment_tokens: int = 2048  # a new segment's default size, in tokens
    fuse_projections: bool = True  # the loader fuses q/k/v and gate/up (memory.weights.FUSED_GROUPS)
    paged_windows: bool = True  # window layers in the paged store (EngineConfig.paged_windows)
    paged_states: bool = True  # hybrids' attention layers in the paged store (EngineConfig.paged_states)
    ring_tokens: int | None = None  # the rings' chunk (engine.core.ring_chunk_tokens); None: chunk_tokens


def paged_groups(geometry: ModelGeometry, params: EngineParams) -> PagedLayout | None:
    """The paged store's layer groups for a model with window layers, where it holds them."""
    if geometry.kv_windows is None or not params.paged_windows:
        return None
    return paged_layout(geometry.kv_windows, geometry.kv_bytes_per_token // len(geometry.kv_windows))


def paged_states(geometry: ModelGeometry, params: EngineParams) -> tuple[int, int] | None:
    """A hybrid the paged store holds: (its attention layers' bytes per token, one
    sequence's recurrent state), or None."""
    layout = geometry.kv_layout
    if geometry.kv_states is None or layout is None or not params.paged_states:
        return None
    return sum(g.bytes_per_token for g in layout.groups if g.kind == FULL), layout.fixed_bytes


def _ring_chunk(params: EngineParams) -> int:
    return params.ring_tokens or max(params.chunk_tokens, params.min_chunk_tokens)


def reservation_bytes(
    geometry: ModelGeometry, final_lens: Sequence[int], params: EngineParams = EngineParams()
) -> int:
    """KV the store reserves for requests of these final lengths: each its own, in whole
    blocks (no padding to the longest). A model with a cache layout of several kinds is
    served through mlx-lm's own caches: each request what its caches hold at most
    (:meth:`~memory.estimate.KVLayout.bytes_for`, prefilled a chunk at a time), unless the
    store holds it in layer groups (``memory.paged``): full groups every token, window
    groups a ring each."""
    groups = paged_groups(geometry, params)
    if groups is not None:
        block = params.kv_block_tokens
        return sum(groups.bytes_for(max(n, 1), block, _ring_chunk(params)) for n in final_lens)
    hybrid = paged_states(geometry, params)
    if hybrid is not None:  # blocks for the attention layers, and a state each
        block = params.kv_block_tokens
        return sum(-(-max(n, 1) // block) * block * hybrid[0] + hybrid[1] for n in final_lens)
    if geometry.kv_layout is not None:
        return sum(geometry.kv_layout.bytes_for(max(n, 1), params.chunk_tokens) for n in final_lens)
    block = params.kv_block_tokens
    return sum(-(-max(n, 1) // block) * block for n in final_lens) * geometry.kv_bytes_per_token


def segment_bytes(
    geometry: ModelGeometry, final_len: int, params: EngineParams, *, exact: bool
) -> int:
    """A new segment for one request: its blocks exactly, or the default size if larger
    (mlx-lm's own caches have no segments: the request's own reservation)."""
    groups = paged_groups(geometry, params)
    if groups is not None:
        block = params.kv_block_tokens
        need = groups.segment_blocks(groups.blocks_for(max(final_len, 1), block, _ring_chunk(params)), block)
        blocks = need if exact else max(need, max(1, params.kv_segment_tokens // block))
        return blocks * block * groups.slots * groups.layer_bytes_per_token
    hybrid = paged_states(geometry, params)
    if hybrid is not None:  # the segment, and the request's state beside it
        block = params.kv_block_tokens
        need = -(-max(final_len, 1) // block)
        blocks = need if exact else max(need, max(1, params.kv_segment_tokens // block))
        return blocks * block * hybrid[0] + hybrid[1]
    if geometry.kv_layout is not None:
        return reservation_bytes(geometry, [final_len], params)
    block = params.kv_block_tokens
    need = -(-max(final_len, 1) // block)
    blocks = need if exact else max(need, max(1, params.kv_segment_tokens // block))
    return blocks * block * geometry.kv_bytes_per_token


def store_bytes(geometry: ModelGeometry, final_len: int, n: int, params: EngineParams) -> int:
    """Segments holding ``n`` requests of ``final_len`` tokens: full default segments, and
    the requests left over in segments sized to them."""
    one = reservation_bytes(geometry, [final_len], params)
    default = segment_bytes(geometry, final_len, params, exact=False)
    full, rest = divmod(n, default // one)  # a default segment is never smaller than one
    return full * default + min(default, rest * one)


def chunk_bytes(geometry: ModelGeometry, tokens: int, context: int, params: EngineParams) -> int:
    """A prefill chunk's predicted transient bytes, as the engine's tracker predicts them
    before it has measured anything: the static estimate times the margin."""
    static = estimate_prefill(
        geometry, chunk_tokens=max(tokens, 1), context_tokens=context, batch=1,
        backend=params.backend,
    ).total_bytes
    return math.ceil(float(static) * params.margin)


def largest_chunk_bytes(geometry: ModelGeometry, prompt_tokens: int, params: EngineParams) -> int:
    """The largest full-size chunk of a prompt's prefill."""
    remaining = max(prompt_tokens - 1, 0)
    worst = chunk_bytes(geometry, min(params.chunk_tokens, max(remaining, 1)), 0, params)
    for done in range(0, remaining, params.chunk_tokens):
        tokens = min(params.chunk_tokens, remaining - done)
        worst = max(worst, chunk_bytes(geometry, tokens, done, params))
    return worst


@dataclass(frozen=True)
class RequestWalk:
    """One request walked through admission: admitted or not, and its worst step."""

    admitted: bool
    reserved_bytes: int  # the KV reservation of prompt + max_tokens
    kv_bytes: int  # what the store holds for it: its segment, at least the reservation
    peak_bytes: int  # the largest need of any step; when refused, the refused step's need
    peak_chunk_tokens: int  # the chunk at that step


def walk_single_request(
    geometry: ModelGeometry,
    *,
    prompt_tokens: int,
    max_tokens: int,
    usage_bytes: int,
    ceiling_bytes: int,
    params: EngineParams,
) -> RequestWalk:
    """Would the engine, idle with ``usage_bytes`` in use, run this request to the end of
    its prefill? Walks its admission step by step (see the module docstring)."""
    g, hard = geometry, ceiling_bytes
    final = prompt_tokens + max_tokens
    remaining = max(prompt_tokens - 1, 0)
    reserved = reservation_bytes(g, [final], params)
    full = chunk_bytes(g, max(min(params.chunk_tokens, remaining), 1), 0, params)
    floor_tokens = max(min(params.min_chunk_tokens, remaining), 1)
    floor = chunk_bytes(g, floor_tokens, 0, params)

    # Preflight: a default-size segment with a full chunk, else an exact one, else an exact
    # one with a floor-sized chunk (the request's chunks will shrink).
    default = segment_bytes(g, final, params, exact=False)
    exact = segment_bytes(g, final, params, exact=True)
    first = max(min(params.chunk_tokens, remaining), 1)
    tries = ((default, full, first), (exact, full, first), (exact, floor, floor_tokens))
    for segment, chunk, first in tries:  # noqa: B007 (the one that fits is used below)
        need = usage_bytes + segment + chunk
        if need <= hard:
            break
    else:
        return RequestWalk(False, reserved, exact, need, first)

    kv = max(segment, reserved)  # committed = what the reservation has beyond its segment
    held = usage_bytes + kv
    peak, peak_tokens = need, first
    step = max(params.step_tokens or params.chunk_tokens, params.min_chunk_tokens)
    processed, budget = 0, step  # prompt tokens left in this engine step
    while processed < remaining:
        left = remaining - processed
        # the engine finishes a prompt rather than leave it fewer than the floor's tokens
        allow = left if 0 < left - budget < params.min_chunk_tokens else budget
        tokens = min(params.chunk_tokens, left, allow)
        while True:
            need = held + chunk_bytes(g, tokens, processed, params)
            if need <= hard:
                break
            if tokens <= params.min_chunk_tokens:
                return RequestWalk(False, reserved, kv, need, tokens)
            tokens = max(tokens // 2, params.min_chunk_tokens)
        if need > peak:
            peak, peak_tokens = need, tokens
        processed += tokens
        budget = budget - tokens if budget > tokens else step
    return RequestWalk(True, reserved, kv, peak, peak_tokens)
