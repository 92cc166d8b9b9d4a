"""Decode-step cost without HTTP: a bare batched model step against the engine's step.

    python -m bench.engine_step --model llama3-8b --dtype bfloat16 --batch 32 --context 1024

The difference between the two is the engine's per-step bookkeeping (sampling, stop
checks, reading tokens back) and its KV store's paged attention; on a GPU it is what the
decode loop adds to the model. `bench/kv_store.py` compares the store with the left-padded
`BatchKVCache` directly.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from bench.cuda_profiler import profiled
from bench.gpu_busy import GpuBusy
from bench.host_probe import host_probe
from engine.compiled_decode import CompiledDecode
from engine.dummy_model import build_dummy_model, dummy_config
from engine.fusion import fuse_projections
from engine.kv import KVGeometry, KVStore, decode_caches, install_attention_hook, plan_decode
from engine.kv.store import default_segment_tokens
from engine.loader import backend_name, device_memory_bytes, on_cuda_by_default
from engine.request import EngineRequest, SamplingParams
from engine.runner import Runner
from engine.sequence import Sequence
from memory import geometry_from_model


def prefilled_caches(model, context: int) -> list:
    caches = make_prompt_cache(model)
    tokens = mx.random.randint(0, 256, (1, context))
    for start in range(0, context, 2048):
        model(tokens[:, start:start + 2048], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def bare_steps(model, batch: int, context: int, steps: int, census: dict | None = None,
               busy: dict | None = None) -> float:
    """mlx-lm's own batched step; `census` receives its graph's primitives by type, `busy`
    the GPU's utilisation over the timed steps (`bench.gpu_busy`)."""
    one = prefilled_caches(model, context)
    cache = [BatchKVCache.merge([c] * batch) for c in one]
    y = mx.zeros((batch,), mx.uint32)
    for _ in range(3):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        if census is not None and not census:
            census.update(op_census(y))
        mx.eval(y)
    start = time.perf_counter()
    with GpuBusy() as gpu:
        for _ in range(steps):
            nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
            mx.async_eval(nxt)
            y.tolist()
            y = nxt
        mx.eval(y)
    if busy is not None:
        busy["bare_gpu_busy_pct"] = gpu.percent
    return (time.perf_counter() - start) / steps


def step_ops(*arrays: mx.array) -> int:
    """Primitives in a step's graph: on CUDA each costs host time to encode and launch."""
    return sum(op_census(*arrays).values())


def op_census(*arrays: mx.array) -> collections.Counter[str]:
    """The step graph's primitives by name (the dot label's first word)."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        names = re.findall(r'label ?= ?"([A-Za-z0-9_]+)[^"]*"[^\n]*shape=rectangle', f.read())
    return collections.Counter(names)


def census_difference(ours: collections.Counter[str], bare: collections.Counter[str]) -> dict[str, int]:
    """Per primitive, how many more (or fewer) our step has than the bare one."""
    return {k: ours[k] - bare[k] for k in sorted(set(ours) | set(bare)) if ours[k] != bare[k]}


def fill_row(store: KVStore, one: list, request_id: str, context: int, reserve: int) -> Any:
    """Reserve `reserve` tokens for a row and copy the first `context - 1` tokens of the
    prefilled single-row cache `one` into its blocks (its last prompt token decodes)."""
    alloc = store.reserve(request_id, reserve)
    n = context - 1
    slots = mx.array([alloc.table[j // store.block_size] * store.block_size + j % store.block_size
                      for j in range(n)], dtype=mx.int32)
    for layer, c in enumerate(one):
        alloc.segment.keys[layer][slots] = c.keys[0, :, :n, :].transpose(1, 0, 2)
        alloc.segment.values[layer][slots] = c.values[0, :, :n, :].transpose(1, 0, 2)
    mx.eval(alloc.segment.arrays())
    store.advance(request_id, n)
    return alloc


def step_census(model, store: KVStore, allocs: list[Any],
                pick: Callable[[mx.array], mx.array] = lambda logits: mx.argmax(logits, axis=-1),
                compiled: CompiledDecode | None = None) -> collections.Counter[str]:
    """Build one decode step's graph over `allocs` (`pick` turns its logits into tokens)
    and count its primitives by type; with `compiled`, the replayed graph's (its fused
    kernels count one each). Slice assignment rebinds the pool's arrays in place, so the
    step's KV writes (into each row's next slot, which the real steps overwrite) are
    evaluated here rather than left to join the next step's graph."""
    plan = plan_decode(store, allocs)
    inputs = mx.zeros((len(allocs),), mx.uint32)
    logits = None if compiled is None else compiled.logits(plan, inputs)
    if logits is None:
        logits = model(inputs[:, None], cache=decode_caches(plan, store.geometry.num_layers))[:, -1, :]
    census = op_census(pick(logits))
    mx.eval([a for seg in store.segments.values() for a in seg.arrays()])
    return census


def graph_census(model, store: KVStore, decode: Runner) -> collections.Counter[str]:
    """The runner's decode step, its own sampling included."""
    rows = len(decode.seqs)
    return step_census(model, store, [store.get(s.request_id) for s in decode.seqs],
                       lambda logits: decode.sampler.sample(logits, [1] * rows).tokens, decode.compiled)


def engine_steps(model, batch: int, context: int, steps: int, temperature: float,
                 segments: int = 1, split: dict | None = None, compile_decode: bool = False,
                 server_segment: bool = False, profile: bool = False, host_work_ms: float = 0.0,
                 side_burst_ms: float = 0.0, side_period_ms: float = 0.0,
                 slice_decode: bool | None = None) -> float:
    """The runner's decode step; rows spread over `segments` KV segments (the server adds
    one per ~segment of reserved tokens). `split` receives the step's time split.
    `compile_decode` replays the step from a traced graph, as the server does on CUDA;
    `server_segment` sizes the one segment as the server would (16 GiB on an H200) rather
    than to the rows, so that a step which copied its pool instead of writing in place
    would show. `profile` marks the timed steps for a CUDA profiler (`bench.cuda_profiler`).

    The server's step has more host work than this loop (the scheduler, emitting tokens:
    3.5-4.3 ms against 1.2-1.7 ms at batch 32 on the H200), and an event loop beside it
    that takes the GIL. `host_work_ms` adds that much pure-Python work to each step, after
    the runner's; `side_burst_ms` runs a second thread that holds the GIL for that long
    every `side_period_ms`. If the step grows by the work added, the host chain paces the
    step; if not, the pipelining hides it (docs/throughput.md, session 9: the device is
    74-88 % busy in the server against 100 % here)."""
    one = prefilled_caches(model, context - 1)
    g = geometry_from_model(model)
    per_row = context + steps + 32
    rows_per_segment = -(-batch // segments)
    geometry = KVGeometry(g.num_layers, g.num_kv_heads, g.head_dim, one[0].keys.dtype)
    segment_tokens = rows_per_segment * (per_row + 16)
    if server_segment:
        segment_tokens = max(segment_tokens, default_segment_tokens(
            backend_name(), geometry.bytes_per_token, device_memory_bytes()))
    store = KVStore(geometry, segment_tokens=segment_tokens)
    install_attention_hook(model)
    compiled = None
    if compile_decode:
        compiled = CompiledDecode(model, store, model.args.num_attention_heads)
    decode = Runner(model, store, overlap=mx.cuda.is_available(), compiled=compiled,
                    slice_decode=slice_decode)
    params = SamplingParams(temperature=temperature)
    for i in range(batch):
        seq = Sequence(EngineRequest(f"r{i}", (1,) * context, steps + 8, params))
        fill_row(store, one, seq.request_id, context, context + steps + 8)
        decode.join(seq)
    for _ in range(3 if compiled is None else compiled.after + 2):  # traced and replayed once
        decode.step()
    if split is not None:
        split["segments"] = len(store.segments)
        census = graph_census(model, store, decode)
        split["ops"] = sum(census.values())
        split["census"] = census
    wait0, queue0 = decode.decode_wait_s, decode.queue_s
    replays0 = 0 if compiled is None else compiled.replays
    start = time.perf_counter()
    with GpuBusy() as gpu, profiled(profile), gil_holder(side_burst_ms, side_period_ms):
        for _ in range(steps):
            for item in decode.step():
                item.seq.generated += 1
            if host_work_ms:
                spin(host_work_ms)
        if profile:
            decode.settle()
    per_step = (time.perf_counter() - start) / steps
    if split is not None:
        wait = (decode.decode_wait_s - wait0) / steps
        queue = (decode.queue_s - queue0) / steps
        split.update(ms=round(per_step * 1e3, 2), wait_ms=round(wait * 1e3, 2),
                     queue_ms=round(queue * 1e3, 2), host_ms=round((per_step - wait - queue) * 1e3, 2),
                     gpu_busy_pct=gpu.percent,
                     replayed=None if compiled is None else compiled.replays - replays0,
                     slice_decode=decode.tables.runs,
                     slice_choice=None if decode.slice_choice is None else decode.slice_choice.report(),
                     segment_gib=round(sum(seg.nbytes for seg in store.segments.values()) / 2**30, 2))
    return per_step


def spin(ms: float) -> None:
    """Pure-Python work for `ms` milliseconds: it holds the GIL, as the engine's own host
    work does (a sleep would release it)."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


@contextlib.contextmanager
def gil_holder(burst_ms: float, period_ms: float) -> Iterator[None]:
    """A thread that spins for `burst_ms` every `period_ms` while the block runs: the event
    loop's share of the GIL when it streams (12 % of a core at C=32 on the H200)."""
    if burst_ms <= 0 or period_ms <= 0:
        yield
        return
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(max(period_ms - burst_ms, 0.0) / 1e3):
            spin(burst_ms)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


SUMMED = ("bare_ms", "ms", "wait_ms", "queue_ms", "host_ms", "ops", "bare_ops", "gpu_busy_pct",
          "bare_gpu_busy_pct")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype")
    p.add_argument("--batch", default="1,32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--segments", default="1", help="comma list: KV segments the rows spread over")
    p.add_argument("--merge", choices=["kernel", "ops"], default="kernel",
                   help="CUDA: merge the paged kernel's partitions in one kernel or in MLX ops")
    p.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=True,
                   help="fuse q/k/v and gate/up as the server does (engine.fusion); bare stays mlx-lm")
    p.add_argument("--compile-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="replay the step from a traced graph (default: on CUDA only, as the server)")
    p.add_argument("--server-segment", action="store_true",
                   help="size the KV segment as the server does (engine.kv.store), not to the rows")
    p.add_argument("--kernel-variant", help="time the step with a bench.kernel_sweep variant of the "
                   "paged kernel (CUDA), e.g. group16")
    p.add_argument("--profile", action="store_true",
                   help="mark the timed engine steps for ncu/nsys --profile-from-start off")
    p.add_argument("--host-work-ms", type=float, default=0.0,
                   help="pure-Python work added to each timed step (the server's scheduler and emits)")
    p.add_argument("--side-burst-ms", type=float, default=0.0,
                   help="a second thread holds the GIL this long every --side-period-ms (the event loop)")
    p.add_argument("--side-period-ms", type=float, default=0.0)
    p.add_argument("--slice-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="a lone row on consecutive blocks attended as one slice of the pool, "
                   "stepped eagerly (engine.kv.attention.run_decode; default: as the engine, "
                   "timed against the replayed step where steps are replayed)")
    p.add_argument("--split-only", action="store_true",
                   help="only the greedy engine step per segment count, with its time split")
    args = p.parse_args()
    if args.merge == "ops":
        from engine.kv import cuda_decode

        cuda_decode.merge_partitions = cuda_decode.merge_partitions_reference
    config = dummy_config(args.model, args.dtype)
    bare_model = build_dummy_model(config)
    mx.eval(bare_model.parameters())
    model = bare_model
    if args.fuse:
        model = build_dummy_model(config)
        mx.eval(model.parameters())
        fuse_projections(model)
    compile_decode = on_cuda_by_default(args.compile_decode, backend_name())
    if args.kernel_variant:
        from bench.kernel_sweep import use_variant

        dtype = getattr(mx, str(config["torch_dtype"]))
        use_variant(args.kernel_variant, dtype, geometry_from_model(model).head_dim)
    out = []
    combined: dict[str, Any] = {"probe_start": host_probe()}
    for b in (int(x) for x in args.batch.split(",")):
        if args.split_only:
            bare_census: collections.Counter[str] = collections.Counter()
            bare_busy: dict = {}
            bare = bare_steps(bare_model, b, args.context, args.steps, census=bare_census, busy=bare_busy)
            for n in (int(x) for x in args.segments.split(",")):
                split: dict = {}
                engine_steps(model, b, args.context, args.steps, 0.0, segments=n, split=split,
                             compile_decode=compile_decode, server_segment=args.server_segment,
                             profile=args.profile, host_work_ms=args.host_work_ms,
                             side_burst_ms=args.side_burst_ms, side_period_ms=args.side_period_ms,
                             slice_decode=args.slice_decode)
                census = split.pop("census")
                line = {"batch": b, "context": args.context, "merge": args.merge, "fused": args.fuse,
                        "kernel_variant": args.kernel_variant or "engine",
                        "compiled": compile_decode, "host_work_ms": args.host_work_ms,
                        "side_burst_ms": args.side_burst_ms, "side_period_ms": args.side_period_ms,
                        "bare_ms": round(bare * 1e3, 2), "bare_ops": sum(bare_census.values()), **bare_busy,
                        **split,
                        "ops_over_bare": census_difference(census, bare_census)}
                print(json.dumps(line), flush=True)
                suffix = f"_b{b}" + (f"_s{n}" if n != 1 else "")
                combined.update({f"{k}{suffix}": v for k, v in line.items() if k in SUMMED})
                combined[f"ops_over_bare{suffix}"] = line["ops_over_bare"]
            continue
        bare = bare_steps(bare_model, b, args.context, args.steps)
        greedy = engine_steps(model, b, args.context, args.steps, 0.0)
        sampled = engine_steps(model, b, args.context, args.steps, 0.8)
        out.append({"batch": b, "context": args.context, "bare_ms": round(bare * 1e3, 2),
                    "engine_greedy_ms": round(greedy * 1e3, 2),
                    "engine_sampled_ms": round(sampled * 1e3, 2),
                    "engine_tok_s": round(b / greedy, 1)})
        print(json.dumps(out[-1]), flush=True)
    if args.split_only:
        combined["probe_end"] = host_probe()
        combined["py_loop_us_start"] = combined["probe_start"]["py_loop_us"]
        combined["py_loop_us"] = combined["probe_end"]["py_loop_us"]
        combined["env"] = {k: v for k, v in os.environ.items() if k.startswith("MLX_")}
        print(json.dumps(combined), flush=True)


if __name__ == "__main__":
    main()
