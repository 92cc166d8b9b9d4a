"""The KV store against the left-padded `BatchKVCache` it replaces: decode-step time and
memory, plus the CUDA paged kernel checked against the plain-MLX path.

    python -m bench.kv_store --model llama3-8b --dtype bfloat16 --batch 8,32,64 --context 1024

Rows have ragged lengths (context - (37 i mod 256)), as in KV-NOTES. Every path times the
same pipelined loop: the model's forward for one token per row, argmax, `mx.async_eval`,
read the previous step's tokens. Paths:

- `batchkv`: today's engine path before the store: a left-padded `BatchKVCache` (masked).
- `store_kernel`: the store, attention by the paged CUDA kernel (CUDA only).
- `store_plain`: the store, attention by the plain-MLX fallback (gather + masked SDPA).

Also measured: the step's peak memory above the steady state (`peak_step_mib`), and for the
store the kernel's agreement with the plain path (`kernel_check`), on random data and on
the model's logits.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from engine.dummy_model import build_dummy_model, dummy_config
from engine.kv import KVGeometry, KVStore, decode_caches, install_attention_hook, plan_decode, use_kernel
from engine.kv.attention import plain_decode
from engine.kv.cache import DecodeGroup
from memory import geometry_from_model


def ragged(batch: int, context: int) -> list[int]:
    return [context - (37 * i) % 256 for i in range(batch)]


def reference_kv(model: Any, context: int) -> list[KVCache]:
    caches = make_prompt_cache(model)
    tokens = mx.random.randint(0, 256, (1, context))
    for start in range(0, context, 2048):
        model(tokens[:, start : start + 2048], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def timed_loop(step: Any, batch: int, steps: int, overlap: bool = True) -> tuple[float, float]:
    """Seconds per step, and the peak MiB above the state before timing. `overlap` queues
    step n+1 before reading step n (mlx-lm's order); otherwise it is built first, then
    queued once step n's tokens are back (the runner's default)."""
    y = mx.zeros((batch,), mx.uint32)
    for _ in range(3):
        y = step(y)
        mx.eval(y)
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    start = time.perf_counter()
    for _ in range(steps):
        nxt = step(y)
        if overlap:
            mx.async_eval(nxt)
            y.tolist()
        else:
            y.tolist()
            mx.async_eval(nxt)
        y = nxt
    mx.eval(y)
    elapsed = (time.perf_counter() - start) / steps
    return elapsed, (mx.get_peak_memory() - before) / 2**20


def batchkv_path(model: Any, ref: list[KVCache], lengths: list[int], steps: int) -> dict[str, Any]:
    rows = []
    for n in lengths:
        row = []
        for c in ref:
            k = KVCache()
            k.keys, k.values, k.offset = c.keys[..., :n, :], c.values[..., :n, :], n
            row.append(k)
        rows.append(row)
    cache = [BatchKVCache.merge([r[layer] for r in rows]) for layer in range(len(ref))]
    mx.eval([c.state for c in cache])

    def step(y: mx.array) -> mx.array:
        return mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1).astype(mx.uint32)

    sec, peak = timed_loop(step, len(lengths), steps)
    kv_bytes = sum(c.nbytes for c in cache)
    return {"ms": round(sec * 1e3, 2), "peak_step_mib": round(peak, 1), "kv_mib": round(kv_bytes / 2**20, 1)}


def filled_store(model: Any, ref: list[KVCache], lengths: list[int], steps: int,
                 slack: int = 1) -> tuple[KVStore, list]:
    g = geometry_from_model(model)
    dtype = ref[0].keys.dtype
    need = sum(n + steps + 32 for n in lengths) * slack
    store = KVStore(KVGeometry(g.num_layers, g.num_kv_heads, g.head_dim, dtype), segment_tokens=need)
    allocs = []
    for i, n in enumerate(lengths):
        a = store.reserve(f"r{i}", n + steps + 16)
        assert len(store.segments) == 1
        pos = np.arange(n)
        table = np.asarray(a.table)
        slots = mx.array((table[pos // store.block_size] * store.block_size + pos % store.block_size)
                         .astype(np.int32))
        for layer, c in enumerate(ref):
            a.segment.keys[layer][slots] = c.keys[0, :, :n, :].transpose(1, 0, 2)
            a.segment.values[layer][slots] = c.values[0, :, :n, :].transpose(1, 0, 2)
        mx.eval(a.segment.arrays())
        store.advance(a.request_id, n)
        allocs.append(a)
    return store, allocs


def store_path(model: Any, store: KVStore, allocs: list, steps: int, kernel: bool,
               overlap: bool = False) -> dict[str, Any]:
    use_kernel(kernel)
    layers = store.geometry.num_layers
    saved = [a.length for a in allocs]

    def step(y: mx.array) -> mx.array:
        plan = plan_decode(store, allocs)
        out = model(y[:, None], cache=decode_caches(plan, layers))
        for a in allocs:
            a.length += 1
        return mx.argmax(out[:, -1, :], axis=-1).astype(mx.uint32)

    sec, peak = timed_loop(step, len(allocs), steps, overlap=overlap)
    for a, n in zip(allocs, saved, strict=True):
        a.length = n
    use_kernel(None)
    layer_array = allocs[0].segment.keys[0].nbytes
    return {"ms": round(sec * 1e3, 2), "peak_step_mib": round(peak, 1),
            "kv_mib": round(store.reserved_bytes() / 2**20, 1),
            "pool_layer_array_mib": round(layer_array / 2**20, 1)}


def batchkv_logits(model: Any, ref: list[KVCache], lengths: list[int]) -> mx.array:
    rows = []
    for n in lengths:
        row = []
        for c in ref:
            k = KVCache()
            k.keys, k.values, k.offset = c.keys[..., :n, :], c.values[..., :n, :], n
            row.append(k)
        rows.append(row)
    cache = [BatchKVCache.merge([r[layer] for r in rows]) for layer in range(len(ref))]
    y = mx.arange(len(lengths), dtype=mx.uint32)
    out = model(y[:, None], cache=cache)[:, -1, :].astype(mx.float32)
    mx.eval(out)
    return out


def logits_agreement(model: Any, store: KVStore, allocs: list,
                     reference: mx.array | None = None) -> dict[str, float]:
    """One step's logits through the kernel and through the plain path (same KV, same tokens),
    and each against the left-padded BatchKVCache path when `reference` is given."""
    layers = store.geometry.num_layers
    y = mx.arange(len(allocs), dtype=mx.uint32)
    outs = {}
    for name, kernel in (("kernel", True), ("plain", False)):
        use_kernel(kernel)
        plan = plan_decode(store, allocs)
        outs[name] = model(y[:, None], cache=decode_caches(plan, layers))[:, -1, :].astype(mx.float32)
        mx.eval(outs[name])
    use_kernel(None)
    if reference is not None:
        outs["batchkv"] = reference
    res: dict[str, float] = {"logits_scale": float(mx.max(mx.abs(outs["plain"])).item())}
    names = list(outs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            res[f"{a}_vs_{b}_max_abs_diff"] = float(mx.max(mx.abs(outs[a] - outs[b])).item())
            res[f"{a}_vs_{b}_argmax_agreement"] = float(
                mx.mean(mx.argmax(outs[a], -1) == mx.argmax(outs[b], -1)).item())
    return res


def donation_probe(model: Any, ref: list[KVCache], lengths: list[int], steps: int) -> dict[str, Any]:
    """Decode with a pool whose layer arrays are large (8x slack): a copy of one would lift
    the step's peak by at least its size. Both queue orders."""
    store, allocs = filled_store(model, ref, lengths, steps, slack=8)
    out = {}
    for overlap in (False, True):
        r = store_path(model, store, allocs, steps, kernel=kernel_active_default(), overlap=overlap)
        r["copied_a_layer_array"] = r["peak_step_mib"] >= r["pool_layer_array_mib"]
        out["overlap" if overlap else "ordered"] = r
    return out


def kernel_active_default() -> bool:
    return bool(mx.cuda.is_available())


def kernel_vs_plain(dtype: mx.Dtype, batch: int, heads: int, kv_heads: int, dim: int, lengths: list[int],
                    block_size: int = 16) -> dict[str, Any]:
    """The paged kernel against the plain path on random pools, ragged rows, shuffled blocks."""
    from engine.kv.cuda_decode import paged_decode

    rng = np.random.default_rng(0)
    nb = max(-(-n // block_size) for n in lengths)
    total = batch * nb + 7
    perm = rng.permutation(total).astype(np.int32)
    table = perm[: batch * nb].reshape(batch, nb)
    shape = (total * block_size, kv_heads, dim)
    k_pool = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    v_pool = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    q = mx.array(rng.standard_normal((batch, heads, 1, dim)).astype(np.float32)).astype(dtype)
    lens = mx.array(np.asarray(lengths, dtype=np.int32))
    tbl = mx.array(table)
    scale = dim**-0.5
    got = paged_decode(q, k_pool, v_pool, tbl, lens, max(lengths), scale, block_size)
    group = DecodeGroup(segment=None, rows=None, write=lens, table=tbl, lengths=lens,  # type: ignore[arg-type]
                        max_length=max(lengths))
    want = plain_decode(q, k_pool, v_pool, group, scale, block_size)
    err = mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item()
    return {"dtype": str(dtype), "batch": batch, "heads": heads, "kv_heads": kv_heads, "dim": dim,
            "max_len": max(lengths), "max_abs_err": err}


def attention_only(dtype: mx.Dtype, batch: int, context: int, layers: int = 32,
                   lengths: list[int] | None = None,
                   paths: tuple[str, ...] = ("kernel", "plain")) -> dict[str, Any]:
    """ms for `layers` decode attentions (32 query / 8 KV heads, dim 128), as KV-NOTES' table,
    by each of `paths`; the rows' lengths default to `ragged` ones up to `context`."""
    from engine.kv.cuda_decode import paged_decode

    bs = 16
    lengths = ragged(batch, context) if lengths is None else lengths
    nb = -(-context // bs)
    total = batch * nb
    rng = np.random.default_rng(1)
    table = mx.array(rng.permutation(total).astype(np.int32).reshape(batch, nb))
    k_pool = mx.random.normal((total * bs, 8, 128)).astype(dtype)
    v_pool = mx.random.normal((total * bs, 8, 128)).astype(dtype)
    q = mx.random.normal((batch, 32, 1, 128)).astype(dtype)
    lens = mx.array(np.asarray(lengths, dtype=np.int32))
    group = DecodeGroup(segment=None, rows=None, write=lens, table=table, lengths=lens,  # type: ignore[arg-type]
                        max_length=max(lengths))
    out = {}
    for name in paths:
        def run(name: str = name) -> mx.array:
            outs = []
            for _ in range(layers):
                if name == "kernel":
                    outs.append(paged_decode(q, k_pool, v_pool, table, lens, max(lengths), 0.088, bs))
                else:
                    outs.append(plain_decode(q, k_pool, v_pool, group, 0.088, bs))
            return mx.stack(outs)
        for _ in range(3):
            mx.eval(run())
        t = time.perf_counter()
        for _ in range(20):
            mx.eval(run())
        out[f"{name}_ms"] = round((time.perf_counter() - t) / 20 * 1e3, 2)
    return {"batch": batch, "context": context, **out}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype")
    p.add_argument("--batch", default="8,32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out")
    p.add_argument("--probe", action="store_true", help="also run the donation probe")
    p.add_argument("--no-kernel-checks", action="store_true")
    p.add_argument("--checks-only", action="store_true",
                   help="only the kernel checks and attention timings (CUDA), no model")
    args = p.parse_args()
    cuda = mx.cuda.is_available()
    results: dict[str, Any] = {"device": str(mx.default_device()), "cuda": cuda, "model": args.model,
                               "dtype": args.dtype, "context": args.context, "steps": args.steps}
    if cuda and not args.no_kernel_checks:
        from engine.kv import cuda_decode

        checks, results["attention_only"] = [], []
        for unroll in (1, cuda_decode.UNROLL) if cuda_decode.UNROLL != 1 else (1,):
            cuda_decode.UNROLL = unroll  # tokens per warp step: 1 is the first kernel
            for dt in (mx.float32, mx.bfloat16, mx.float16):
                checks.append(kernel_vs_plain(dt, 5, 32, 8, 128, [1, 17, 300, 1024, 4099]))
                checks.append(kernel_vs_plain(dt, 3, 8, 8, 64, [2, 513, 40]))
                checks.append(kernel_vs_plain(dt, 64, 32, 8, 128, ragged(64, 1000)))  # one partition
            for c in checks[-9:]:
                c["unroll"] = unroll
            print(json.dumps(checks[-9:]), flush=True)
            for b in (8, 32, 64):
                results["attention_only"].append({"unroll": unroll,
                                                  **attention_only(mx.bfloat16, b, args.context)})
                print(json.dumps(results["attention_only"][-1]), flush=True)
        results["kernel_check"] = checks
    if args.checks_only:
        return
    model = build_dummy_model(dummy_config(args.model, args.dtype))
    mx.eval(model.parameters())
    install_attention_hook(model)
    ref = reference_kv(model, args.context)
    rows = []
    for b in (int(x) for x in args.batch.split(",")):
        lengths = ragged(b, args.context)
        row: dict[str, Any] = {"batch": b, "context": args.context}
        row["batchkv"] = batchkv_path(model, ref, lengths, args.steps)
        mx.clear_cache()
        store, allocs = filled_store(model, ref, lengths, args.steps)
        if cuda:
            row["store_kernel"] = store_path(model, store, allocs, args.steps, kernel=True)
            row["store_kernel_overlap"] = store_path(model, store, allocs, args.steps, kernel=True,
                                                     overlap=True)
            row["kernel_check"] = logits_agreement(model, store, allocs,
                                                   batchkv_logits(model, ref, lengths))
        row["store_plain"] = store_path(model, store, allocs, args.steps, kernel=False)
        del store, allocs
        mx.clear_cache()
        if args.probe:
            row["donation_probe"] = donation_probe(model, ref, lengths, args.steps)
            mx.clear_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    results["steps_by_batch"] = rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
