"""Does planning a prefill chunk's attention shape ahead make its call a planned one?

`engine.kv.plan_ahead` queues one layer's attention at the next chunk's exact shape while a
chunk runs, so that cuDNN builds that shape's plan off the critical path (CUDA plans each
shape of its inputs, strides included). This script checks that premise on the engine's own
store: a lone request read as a view of the pool (`engine.kv.cache.PrefillCache`), chunks of
`--chunk` queries of Llama-3-8B's attention (32 heads over 8 KV heads of 128, bf16) at
contexts from `--start` on. For each chunk it times the call three ways:

- `ahead`: exact keys after `plan_ahead` ran at the chunk before (the plan should be there);
- `first`: exact keys at a shape never seen (the plan built inside the call);
- `again`: that same shape a second time (planned for sure);
- `padded`: keys padded to the bucket under a mask, what the engine does otherwise.

    python -m bench.plan_check                    # on a CUDA machine
    python -m bench.plan_check --out plan_check.json

`ahead` near `again` and well under `first` means the plan made ahead is the one the call
uses (the view's K/V are evaluated before the timed call, so each time is the
attention's). On the CPU and Metal nothing is planned and `ahead`, `first` and `again` read
alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from engine.kv import KVGeometry, KVStore, prefill_caches
from engine.kv.cache import PrefillCache
from engine.kv.plan_ahead import plan_ahead

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def _attend(cache: PrefillCache, q: mx.array, k: mx.array, v: mx.array) -> float:
    """One chunk's write and attention through `cache`, as a model layer runs it (what the
    attention hook records for `plan_ahead` included); seconds."""
    keys, values = cache.update_and_fetch(k, v)
    mx.eval(keys, values)
    mask = cache.make_mask(q.shape[2])
    cache.call = (q, HEAD_DIM ** -0.5, mask, None)
    started = time.perf_counter()
    mx.eval(mx.fast.scaled_dot_product_attention(q, keys, values, scale=HEAD_DIM ** -0.5, mask=mask))
    return time.perf_counter() - started


Row = dict[str, float | int | None]


def run(chunk: int, start: int, chunks: int, ahead: bool, dtype: mx.Dtype) -> list[Row]:
    """Chunks of a lone request from `start` on. `ahead`: keys padded unless planned, and
    each chunk plans the next (`plan_ahead`); else every call attends exact keys at a shape
    not seen before (the plan built inside it), and then once again (`again_ms`)."""
    total = start + (chunks + 1) * chunk
    store = KVStore(KVGeometry(1, KV_HEADS, HEAD_DIM, dtype), segment_tokens=total + 4096,
                    key_bucket=4096, plan_ms=1e9 if ahead else 0.0, pair_flops=4 * HEADS * HEAD_DIM)
    alloc = store.reserve("r", total)
    alloc.length = start
    rows: list[Row] = []
    for _ in range(chunks):
        q = mx.random.normal((1, HEADS, chunk, HEAD_DIM)).astype(dtype)
        k = mx.random.normal((1, KV_HEADS, chunk, HEAD_DIM)).astype(dtype)
        mx.eval(q, k)
        end = alloc.length + chunk
        planned = store.key_lengths.is_planned(chunk, end)
        (cache,) = prefill_caches(store, alloc, chunk)
        seconds = _attend(cache, q, k, k)
        again = None
        if not ahead:
            (repeat,) = prefill_caches(store, alloc, chunk)
            again = _attend(repeat, q, k, k)
        elif (planning := plan_ahead(store, alloc, [cache], chunk)) is not None:
            mx.eval(planning)
        rows.append({"ahead": int(ahead), "context": end, "exact": int(cache.padded_mask is None),
                     "planned_ahead": int(planned), "call_ms": round(seconds * 1e3, 3),
                     "again_ms": None if again is None else round(again * 1e3, 3)})
        store.advance("r", chunk)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--start", type=int, default=40_000, help="context before the first chunk")
    parser.add_argument("--chunks", type=int, default=12)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    rows = run(args.chunk, args.start, args.chunks, True, dtype)
    rows += run(args.chunk, args.start + 16, args.chunks, False, dtype)  # shapes not seen above
    for row in rows:
        print(json.dumps(row))

    def median(values: list) -> float | None:
        return statistics.median(values) if values else None

    summary = {
        "device": str(mx.default_device()), "chunk": args.chunk, "start": args.start,
        "ahead_ms": median([r["call_ms"] for r in rows if r["planned_ahead"]]),
        "first_ms": median([r["call_ms"] for r in rows if not r["ahead"]]),
        "again_ms": median([r["again_ms"] for r in rows if r["again_ms"] is not None]),
        "padded_ms": median([r["call_ms"] for r in rows if r["ahead"] and not r["exact"]]),
    }
    print(json.dumps(summary))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
