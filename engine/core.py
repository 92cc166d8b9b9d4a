"""The engine thread: it owns every MLX call, from loading the model to the last token.

Its loop reads like a vLLM step: drain new requests and aborts, schedule (admission),
run at most one prefill chunk, run one decode step for the batch, publish what came out.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.admission import Admission, ChunkSample
from engine.compiled_decode import CompiledDecode
from engine.dense import DensePrefixCache, DenseRunner, DenseStore
from engine.device_errors import is_out_of_memory
from engine.errors import EngineStepError, InsufficientMemoryError, MemoryProbeUnavailableError
from engine.kv import KVGeometry, KVStore, install_attention_hook
from engine.kv.buckets import QUERY_FLOOR, QUERY_QUANTUM, default_key_bucket, default_plan_ms
from engine.kv.state import Snapshot, StateRows, make_state_caches
from engine.kv.store import SharedPrefix, default_segment_tokens
from engine.loader import LoadedModel, device_memory_bytes, on_cuda_by_default
from engine.prefix import ChainKey, PrefixCache, PrefixCacheStats
from engine.prefix.checkpoints import checkpoints_between
from engine.prefix.disk import open_disk_tier
from engine.request import EngineRequest, RequestOutput, Speculation
from engine.runner import Runner, StepToken
from engine.sequence import RequestStatus, Sequence
from engine.speculative import SpeculativeConfig, Speculator, load_draft
from engine.step_budget import StepBudget, prefill_order
from memory import Decision, MemoryGuard, Outcome, ProbeUnavailableError
from memory.decision import CODE_PROBE_FAILED, CODE_READING_STALE, CODE_WAITING

log = logging.getLogger("mlx_headroom.engine")

Publish = Callable[[list[RequestOutput]], None]

# A step's token budget, by default, in chunks. One: a long prompt takes the step, short
# prompts (and prompts' last chunks) share it. On the CPU a 4-chunk budget did not raise
# throughput and lengthened TTFT (docs/throughput.md). The server passes its own budget:
# four chunks on CUDA, where that raised C=64 by 15 % (server.settings.backend_defaults).
STEP_CHUNKS = 1
# An idle engine's wake-up: it refreshes its memory figures (and a tensor-parallel rank 0
# tells the others it is alive, engine.distributed.lockstep).
IDLE_WAKE_S = 0.5

# Steps in a row that may raise (each failing its own requests) before the engine gives up:
# one failure is a request's problem, a run of them means the engine itself is broken, and
# a dead engine answers 503 and exits non-zero so that a service manager restarts it.
MAX_FAILED_STEPS_IN_A_ROW = 3

# At shutdown the prefix cache's blocks go to its disk tier for this long at most (the server
# waits ENGINE_JOIN_TIMEOUT_S, 30 s, for the engine thread).
SPILL_S = 10.0
# A run of blocks read back from disk at once: what a read-back holds beside the store (on
# the host, then on the device), 16 blocks of an 8B model.
READ_BACK_BYTES = 32 << 20


@dataclass(frozen=True)
class EngineConfig:
    prefill_step_size: int = 512
    max_concurrency: int = 32
    wait_timeout_s: float = 30.0
    # The prefix cache fills what admission leaves free under the memory ceiling and gives
    # it back first (engine.prefix). A number caps it (0: off); None: the guard governs.
    prefix_cache_bytes: int | None = None
    prefix_cache_dir: str | None = None  # the disk tier (engine.prefix.disk); None: none
    prefix_cache_disk_bytes: int = 16 << 30
    min_chunk_tokens: int = 32
    kv_block_size: int = 16
    kv_segment_tokens: int | None = None  # None: sized from the model (engine.kv.store)
    # Prefill keys padded to lengths from a small set (engine.kv.buckets). None: 4,096 on
    # CUDA, where attention is planned per shape; 0: never padded.
    prefill_key_bucket: int | None = None
    # What a new attention shape's plan costs (ms): a padded call attends its exact keys
    # where padding would cost more (engine.kv.buckets.KeyLengths). None: timed by the
    # warm-up where it runs (engine.kv.plan_probe), else 35 on CUDA.
    prefill_plan_ms: float | None = None
    decode_overlap: bool | None = None  # None: on for CUDA (measured safe), off elsewhere (engine.runner)
    max_step_tokens: int | None = None  # tokens per step, decode rows included (None: prefill_step_size)
    # While rows decode, a step's prefill is cut to what keeps the step within this many
    # seconds, by the measured cost of a prefill token at its context (engine.step_budget).
    # None: only the token budget bounds it. The server passes its backend's default.
    max_decode_stall_s: float | None = None
    prefill_batch: int = 8  # most prompts' chunks in one prefill model call (1: one per call)
    # Replay decode steps from traced graphs (engine.compiled_decode). None: on for CUDA,
    # where it won every interleaved server A/B (docs/throughput.md).
    compile_decode: bool | None = None
    compile_after: int = 4  # steps a batch shape must hold before it is traced
    # A lone decoding row on consecutive blocks is attended as one slice of the pool, by MLX's
    # fused SDPA, and stepped eagerly (engine.kv.attention.run_decode). None: always where
    # decode steps are eager; where they are replayed, whichever of the slice and the graph
    # stepped faster on this machine's first lone rows (engine.slice_choice): on two H200
    # machines the slice won by 13 % and lost by 6 % at C=1 (docs/throughput.md).
    # The kept path stays watched: on a third the slice won its trial, then slowed to 1.8x.
    slice_decode: bool | None = None
    # Run a few small requests before serving, so that first-use kernel compilation is not
    # paid inside users' requests (engine.warmup). None: on for CUDA, where it was measured.
    warm_up: bool | None = None
    # The GIL's switch interval while the engine runs (engine.client): the engine thread and
    # the event loop hand the GIL back and forth every step.
    gil_switch_interval_s: float = 0.001
    # Quantized KV (engine.kv.quant): the store holds keys and values as `kv_bits`-bit values
    # with a scale and a bias per `kv_group_size` along head_dim. None: the model's dtype.
    kv_bits: int | None = None
    kv_group_size: int = 64
    # Sliding-window layers held in the paged store, at their window (`memory.paged`);
    # False: such models are served through mlx-lm's own caches (engine.dense), as before.
    paged_windows: bool = True
    # Plain caches of other shapes than the config's heads (MLA) held in the paged store, the
    # model's own attention run on each decode row's gathered K/V (`KVGeometry.gather`);
    # False: served through mlx-lm's own caches (engine.dense), as before.
    paged_gather: bool = True
    # Hybrids' attention layers in the paged store, their recurrent state beside it
    # (engine.kv.state). False: served through mlx-lm's own caches (engine.dense), as before.
    paged_states: bool = True
    # Plan a lone prompt's next prefill chunk's attention shape while this chunk runs, where
    # shapes are planned (engine.kv.plan_ahead). False: an A/B.
    plan_ahead: bool = True
    # Speculative decoding (engine.speculative): drafts verified as one chunk per row while
    # the batch is small. Off unless asked for (docs/throughput.md has what it gains).
    speculative: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)


@dataclass(frozen=True)
class EngineStats:
    """Published after every step; read from any thread without a lock."""

    waiting: int = 0
    prefilling: int = 0
    running: int = 0
    committed_bytes: int = 0
    kv_bytes: int = 0
    kv_reserved_bytes: int = 0
    kv_used_bytes: int = 0
    kv_pool_bytes: int = 0
    kv_bytes_per_token: int = 0
    kv_block_size: int = 0
    kv_segments: int = 0
    kv_bits: int | None = None  # quantized KV's bits; None: the model's dtype
    kv_group_size: int | None = None  # values per scale and bias of quantized KV
    kv_layer_groups: tuple[dict[str, int | None], ...] = ()  # the paged store's (memory.paged)
    kv_state_bytes: int = 0  # a hybrid's recurrent state per sequence (engine.kv.state)
    prefix_cache: PrefixCacheStats | None = None
    prefix_budget_bytes: int = 0  # what the prefix cache may hold now, under the ceiling
    steps: int = 0
    decode_steps: int = 0
    prefill_chunks: int = 0
    prefill_calls: int = 0  # model calls that ran those chunks (several chunks per call)
    max_batch: int = 0
    batched_steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    preemptions: int = 0
    oom_recoveries: int = 0
    step_failures: int = 0  # steps that raised (not out of memory): their requests got 500
    admission_checks: int = 0
    admission_s: float = 0.0
    # Where the engine thread's time goes (bench/run.py reports it per step): busy = inside
    # step(); of that, waiting for the device to finish decode steps and prefill calls;
    # cpu = the thread's own CPU time (host work: graph building, bookkeeping, the GIL).
    busy_s: float = 0.0
    decode_wait_s: float = 0.0
    prefill_wait_s: float = 0.0
    queue_s: float = 0.0  # inside mx.async_eval (launches; on the CPU, compute MLX throttles)
    compiled_steps: int = 0  # decode steps replayed from a traced graph (engine.compiled_decode)
    decode_traces: int = 0  # graphs traced for them
    sliced_steps: int = 0  # decode steps that read a lone row as one slice of the pool (eager)
    slice_choice: dict[str, object] | None = None  # the timed choice's numbers (engine.slice_choice)
    engine_cpu_s: float = 0.0
    recent_chunks: tuple[ChunkSample, ...] = ()  # oldest first: prediction against measurement
    peak_bytes: int = 0  # MLX's peak active memory since start
    cache_limit_bytes: int = 0  # MLX's cache limit, as read back from MLX
    warmup_s: float = 0.0  # the start-up warm-up's wall time (engine.warmup); 0: none ran
    # The decode-stall target, the decode step and prefill cost it measures (engine.step_budget)
    step_budget: dict[str, float | int | None] | None = None
    decode_rows: int = 0  # rows summed over decode steps: generated_tokens / decode_rows per row and step
    # Prefill keys: the bucket, the plan cost padding is priced by, calls exact and padded
    # (engine.kv.buckets.KeyLengths)
    prefill_keys: dict[str, float | int | bool] | None = None
    speculative: dict[str, object] | None = None  # acceptance and tokens per step (engine.speculative)


@dataclass(frozen=True)
class _Submit:
    request: EngineRequest


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[], Any]
    done: Callable[[Any, BaseException | None], None]


def ring_chunk_tokens(config: EngineConfig) -> int:
    """The most tokens one call writes for a request: a prefill chunk, or a verify of the
    most drafts (a window group's ring holds its window plus that, `memory.paged`)."""
    verify = config.speculative.num_tokens + 1 if config.speculative.on else 1
    return max(config.prefill_step_size, config.min_chunk_tokens, verify)


def quantized_kv(loaded: LoadedModel, config: EngineConfig) -> KVGeometry | None:
    """The paged store's geometry with the configured KV quantization (None: the model is
    not served by the paged store). The store refuses bits or a group size that do not fit
    the heads (`engine.kv.quant.KVQuant`)."""
    kv = loaded.kv_geometry(windows=config.paged_windows, gather=config.paged_gather,
                            states=config.paged_states)
    if kv is None or config.kv_bits is None:
        return kv
    if kv.gather:
        raise ValueError(f"quantized KV needs keys and values of one width, and {loaded.model_id}'s "
                         f"caches hold keys of {kv.head_dim} and values of {kv.value_dim}")
    return dataclasses.replace(kv, kv_bits=config.kv_bits, kv_group_size=config.kv_group_size)


class EngineCore:
    def __init__(
        self,
        loaded: LoadedModel,
        guard: MemoryGuard,
        config: EngineConfig,
        publish: Publish,
        *,
        admission_cls: type[Admission] = Admission,
    ) -> None:
        self.model = loaded.model
        self.loaded = loaded
        self.guard = guard
        self.config = config
        self.publish = publish
        # The paged store takes plain attention through mlx-lm's shared function, or a
        # model's own attention on gathered K/V (`KVGeometry.gather`); every other cache kind
        # is served through mlx-lm's own caches (engine.dense).
        kv = quantized_kv(loaded, config)
        self.store: KVStore | DenseStore
        if kv is not None and (install_attention_hook(self.model) or kv.gather):
            segment_tokens = config.kv_segment_tokens
            if segment_tokens is None:
                segment_tokens = default_segment_tokens(loaded.backend, kv.bytes_per_token,
                                                        device_memory_bytes(),
                                                        groups=-(-kv.num_layers // kv.block_layers))
            key_bucket = config.prefill_key_bucket
            if key_bucket is None:
                key_bucket = default_key_bucket(loaded.backend)
            if kv.gather:
                key_bucket = 0  # the model masks its own scores: keys exactly its own
            plan_ms = config.prefill_plan_ms
            if plan_ms is None:
                plan_ms = default_plan_ms(loaded.backend)
            g = loaded.geometry
            self.store = KVStore(kv, block_size=config.kv_block_size, segment_tokens=segment_tokens,
                                 key_bucket=key_bucket, plan_ms=plan_ms,
                                 pair_flops=4 * g.num_heads * g.head_dim * g.num_layers,
                                 chunk_tokens=ring_chunk_tokens(config))
            if kv.windowed:
                log.info("serving %s with window layers in the paged store: %s", loaded.model_id,
                         loaded.cache_layout().describe())
            if kv.gather:
                log.info("serving %s from the paged store through its own attention (keys %d, values %d "
                         "wide, %d heads)", loaded.model_id, kv.head_dim, kv.value_dim, kv.num_kv_heads)
            if kv.states:
                log.info("serving %s with its %d attention layers in the paged store and the state of "
                         "its %d recurrent layers beside it (%d bytes a sequence)", loaded.model_id,
                         kv.num_layers, sum(kv.states), kv.state_bytes)
        else:
            if config.kv_bits is not None:
                raise ValueError(f"quantized KV needs the paged KV store, and {loaded.model_id}'s "
                                 "caches are served through mlx-lm's own (engine.dense)")
            layout = loaded.cache_layout()
            self.store = DenseStore(self.model, layout, chunk_tokens=config.prefill_step_size)
            log.info("serving %s through mlx-lm's own caches: %s", loaded.model_id, layout.describe())
            if config.speculative.on:
                log.warning("speculative decoding needs the paged KV store: off for %s", loaded.model_id)
        self.admission = admission_cls(
            guard, dataclasses.replace(loaded.geometry, kv_bits=config.kv_bits,
                                       kv_group_size=config.kv_group_size),
            self.store, backend=loaded.backend,
            min_chunk_tokens=config.min_chunk_tokens, weight_bytes=loaded.weight_bytes,
        )
        self.prefix_cache: PrefixCache | DensePrefixCache
        if isinstance(self.store, DenseStore):  # snapshots of mlx-lm's caches (engine.dense.prefix)
            self.prefix_cache = DensePrefixCache(
                self.store.block_size, checkpoint_tokens=config.prefill_step_size,
                max_bytes=config.prefix_cache_bytes,  # any snapshot hit saves its prefill
            )
        else:
            self.prefix_cache = PrefixCache(
                self.store, max_bytes=config.prefix_cache_bytes, min_hit_tokens=self.store.block_size,
            )
        self._prefix_budget = 0  # what the cache may hold now (the last upkeep's room)
        if config.prefix_cache_dir and config.prefix_cache_bytes != 0:
            geo = getattr(self.store, "geometry", None)
            if isinstance(self.store, KVStore) and not geo.windowed and not geo.gather and not geo.states:
                self.prefix_cache.disk = open_disk_tier(
                    config.prefix_cache_dir, config.prefix_cache_disk_bytes, loaded.path, self.store)
                self.prefix_cache.prefill_rate = self._prefill_rate
                self.prefix_cache.prefill_seconds = self._prefill_seconds
            else:  # its blocks are copies of rings, keys and values of two widths, or no blocks
                log.warning("prefix cache: no disk tier for %s (%s): --prefix-cache-dir is ignored",
                            loaded.model_id, "recurrent state" if geo is not None and geo.states else
                            "window layers" if geo is not None and geo.windowed else
                            "keys and values of two widths" if geo is not None else "mlx-lm's own caches")
        self.batch: Runner | DenseRunner
        if isinstance(self.store, DenseStore):
            checkpoints = self.prefix_cache if isinstance(self.prefix_cache, DensePrefixCache) else None
            self.batch = DenseRunner(self.model, self.store, checkpoints,
                                     prefill_batch=config.prefill_batch)
        else:
            overlap = on_cuda_by_default(config.decode_overlap, loaded.backend)
            compiled = None
            # a model attending with its own code on gathered K/V stays eager (untried traced)
            geo = self.store.geometry
            traceable = not geo.gather
            if on_cuda_by_default(config.compile_decode, loaded.backend) and traceable:
                compiled = CompiledDecode(self.model, self.store, loaded.geometry.num_heads,
                                          after=config.compile_after)
            speculator = None
            states = None
            if geo.states:
                states = StateRows(geo.states, make_state_caches(self.model, geo.states))
                if config.speculative.on:
                    log.warning("speculative decoding cannot roll recurrent state back: off for %s",
                                loaded.model_id)
            elif config.speculative.on:
                spec = config.speculative
                draft = None if spec.draft_model is None else load_draft(
                    spec.draft_model, loaded, dtype=spec.draft_dtype)
                speculator = Speculator(spec, loaded.backend, draft)
            self.batch = Runner(self.model, self.store, overlap=overlap,
                                # prompts padded to one length would run their padding through state
                                prefill_batch=1 if states else config.prefill_batch, compiled=compiled,
                                slice_decode=config.slice_decode, speculator=speculator,
                                plan_ahead=config.plan_ahead, states=states,
                                checkpoint_every=config.prefill_step_size
                                if states and config.prefix_cache_bytes != 0 else 0)
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # in admission order; each step runs them in prefill_order
        self.step_budget = StepBudget(
            config.max_decode_stall_s,
            floor_tokens=max(config.min_chunk_tokens, QUERY_FLOOR if self.store.key_bucket else 0),
            quantum_tokens=QUERY_QUANTUM if self.store.key_bucket else 0,
        )
        disk = self.prefix_cache.disk
        if disk is not None and disk.calibration.get("prefill"):
            try:  # an earlier process's prefill measurements of this model on this machine
                self.step_budget.seed(disk.calibration["prefill"])
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("prefix cache: ignoring the saved prefill cost line: %s", exc)
        self._prefill_s = 0.0  # this step's prefill calls, waits for the queued decode step excluded
        self._step_prompt_tokens = 0  # this step's prompt tokens prefilled
        self._step_context = 0  # the furthest context a chunk of this step started at
        self.inbox: queue.SimpleQueue[_Submit | _Abort | _Call | None] = queue.SimpleQueue()
        self.stats = EngineStats()
        self._counters = dict(
            decode_rows=0, steps=0, decode_steps=0, prefill_chunks=0, prefill_calls=0, batched_steps=0,
            generated_tokens=0, prompt_tokens=0, preemptions=0, oom_recoveries=0, step_failures=0,
        )
        self._failed_steps = 0  # steps in a row that raised (MAX_FAILED_STEPS_IN_A_ROW)
        self._stop = False
        self._outputs: list[RequestOutput] = []
        # Rows whose tokens this step handed out before its prefill (`_emit_early`), and
        # the batch's size then: the step's decode counts them as its own.
        self._early: dict[int, Sequence] = {}
        self._early_rows = 0
        self._prefilling_now: Sequence | None = None
        self._prefilling_batch: list[Sequence] = []  # the chunks of the prefill call in flight
        self._busy_s = 0.0  # wall time inside step()
        self._cpu_s = 0.0  # the engine thread's CPU time inside step()
        self.warmup_s = 0.0
        # Tensor parallel (engine.distributed): every rank steps in lockstep with rank 0,
        # on rank 0's clock. None and the wall clock on a single device.
        self.lockstep: Any = None
        self.clock: Callable[[], float] = time.monotonic
        self._publish_stats()  # the idle engine's numbers (peak, cache limit) before any step

    # ---- called from other threads ------------------------------------------------
    def submit(self, request: EngineRequest) -> None:
        self.inbox.put(_Submit(request))

    def abort(self, request_id: str) -> None:
        self.inbox.put(_Abort(request_id))

    def call(self, fn: Callable[[], Any], done: Callable[[Any, BaseException | None], None]) -> None:
        """Run `fn` on the engine thread between steps (for anything touching MLX state)."""
        self.inbox.put(_Call(fn, done))

    def stop(self) -> None:
        self._stop = True
        self.inbox.put(None)

    # ---- the engine thread ----------------------------------------------------------
    def run_forever(self) -> None:
        idle = True
        while not self._stop:
            self._drain_inbox(timeout=self.inbox_wait_s(idle))
            if self._stop:
                break
            idle = not self.step()
        if self.lockstep is not None:
            self.lockstep.stop(self)
        self._abort_all("the server is shutting down")
        if self.prefix_cache.disk is not None:
            written = self.prefix_cache.spill(deadline=time.monotonic() + SPILL_S)
            log.info("prefix cache: %d blocks written to %s", written, self.prefix_cache.disk.dir)
            cost = self.step_budget.cost
            self.prefix_cache.disk.save_calibration(cost.state() if cost.line is not None else None)

    def step(self) -> bool:
        """One engine step; False when it could do nothing (everything waits)."""
        if self.lockstep is not None and not self.lockstep.before_step(self):
            self._stop = True
            return False
        started, cpu_started = time.perf_counter(), time.thread_time()
        chunks_before = self._counters["prefill_chunks"]
        failures_before = self._failed_steps
        try:
            self._schedule_waiting()
        except ProbeUnavailableError as exc:
            self._refuse_unprobed(self.waiting[0] if self.waiting else None, exc)
        try:
            self._prefill()
        except ProbeUnavailableError as exc:
            victim, self._prefilling_now = self._prefilling_now, None
            self._refuse_unprobed(victim, exc)
        except Exception as exc:
            victim, self._prefilling_now = self._prefilling_now, None
            victims, self._prefilling_batch = self._prefilling_batch, []
            self._step_failed(exc, victims or ([victim] if victim else []))
        decoding = len(self.batch)
        try:
            self._decode()
        except Exception as exc:
            self._step_failed(exc, list(self.batch.seqs))
        if decoding:
            self.step_budget.observe_step(time.perf_counter() - started, self._prefill_s)
        if log.isEnabledFor(logging.DEBUG) and self._counters["prefill_chunks"] != chunks_before:
            log.debug("step: %d rows decoding, %d prompt tokens in %d chunks (context up to %d), "
                      "prefill %.1f ms, step %.1f ms",
                      decoding, self._step_prompt_tokens, self._counters["prefill_chunks"] - chunks_before,
                      self._step_context,
                      self._prefill_s * 1e3, (time.perf_counter() - started) * 1e3)
        if self.admission.upkeep_due():
            self._trim_prefix_cache(self.admission.upkeep(
                self.admission.committed_bytes(self._admitted(), self._allocated_kv())))
        progressed = bool(self._outputs or len(self.batch))
        worked = progressed or self._counters["prefill_chunks"] != chunks_before
        if worked and self._failed_steps == failures_before:
            self._failed_steps = 0  # work done without raising ends a run of failures
        if worked:
            self._counters["steps"] += 1  # steps that did work: an idle wake-up is not one
        self._busy_s += time.perf_counter() - started
        self._cpu_s += time.thread_time() - cpu_started
        self._publish_stats()
        if self.lockstep is not None:
            self.lockstep.after_step(self)
        if self._outputs:
            outputs, self._outputs = self._outputs, []
            self.publish(outputs)
        return progressed or self._counters["prefill_chunks"] != chunks_before

    def _has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or len(self.batch))

    def inbox_wait_s(self, idle: bool) -> float:
        """How long the loop waits for the inbox before its next step (`idle`: the last
        step could do nothing). Nothing to do: until something comes, waking at least every
        IDLE_WAKE_S (a tensor-parallel group every `Lockstep.idle_s`: the other ranks wait
        as long between steps). Everything waiting for memory that only an abort or a new
        setting can free: a gentle poll instead of a spin."""
        if not self._has_work():
            return self.lockstep.idle_s if self.lockstep is not None else IDLE_WAKE_S
        return 0.005 if idle else 0.0

    def _drain_inbox(self, *, timeout: float) -> None:
        """Take everything queued; wait up to `timeout` seconds for the first."""
        try:
            item = self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is None:
                return
            if self.lockstep is not None and isinstance(item, _Submit | _Abort):
                self.lockstep.took(item)
            if isinstance(item, _Submit):
                self.submit_now(item.request)
            elif isinstance(item, _Abort):
                self._abort(item.request_id)
            else:
                try:
                    item.done(item.fn(), None)
                except BaseException as exc:  # the caller gets the error, the engine lives on
                    item.done(None, exc)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def submit_now(self, request: EngineRequest) -> None:
        """On the engine thread: queue a request (the inbox's, or rank 0's on another rank)."""
        self.waiting.append(Sequence(request, chunk_tokens=self.config.prefill_step_size))

    # ---- admission -------------------------------------------------------------------
    def _admitted(self) -> list[Sequence]:
        return [*self.prefilling, *self.batch.seqs]

    def _allocated_kv(self) -> int:
        """KV memory that admitted requests hold (their segments), all allocated up front."""
        return self.store.request_bytes()

    def _protected(self) -> frozenset[ChainKey]:
        keys = {s.prefix_key for s in [*self.waiting, *self.prefilling] if s.prefix_key}
        return frozenset(keys)

    def _trim_prefix_cache(self, decision: Decision) -> None:
        """Once a second: the prefix cache may hold what is free under the ceiling (MLX's
        buffer cache is free too: it is handed back first). When the process is over it
        (the ceiling fell, or memory is used elsewhere), the cache's least recently used
        segments go until room for the smallest prefill chunk is left. Otherwise admission
        evicts, when a request needs the room. Under tensor parallelism every rank's cache
        must stay the same, so only the admission decisions rank 0 shares evict there."""
        if decision.outcome not in (Outcome.ADMIT, Outcome.EVICT) or decision.code:
            return
        held = decision.needed_bytes - decision.cache_bytes
        self._prefix_budget = max(decision.limit_bytes - held, 0) + self.prefix_cache.nbytes
        if held > decision.limit_bytes and self.lockstep is None:
            margin = self.admission.headroom_bytes(self.config.min_chunk_tokens)
            self.prefix_cache.evict(held - decision.limit_bytes + margin, self._protected(), cause="ceiling")
            self.admission.hand_back()

    def _schedule_waiting(self) -> None:
        """Admit waiting requests first come, first served, while they fit."""
        now = self.clock()
        while self.waiting and len(self._admitted()) < self.config.max_concurrency:
            seq = self.waiting[0]
            self._lookup_prefix(seq)
            reuse = self._reusable_segment(seq)
            decision, exact, in_place = self.admission.preflight(
                seq, self._admitted(), self._allocated_kv(),
                self.prefix_cache.evictable_bytes(self._protected()), reusable=reuse is not None,
            )
            if not self._act_on(seq, decision, now):
                return
            self.waiting.popleft()
            if in_place and reuse is not None:
                self._evict_in_place(seq, reuse)
            self._reserve(seq, exact=exact)
            seq.status = RequestStatus.PREFILLING
            seq.wait_since = None
            self.prefilling.append(seq)

    def _lookup_prefix(self, seq: Sequence) -> None:
        """Ask the prefix cache, again at every admission attempt (what it holds changes
        while a request waits); the hit and miss counters count a request once."""
        first, seq.looked_up = not seq.looked_up, True
        seq.shared = seq.prefix_key = None
        seq.disk_blocks = ()
        seq.processed = seq.cached_tokens = 0
        if seq.scores_prompt:
            return  # a cached prefix has no logits to score: recompute it (engine.prompt_scoring)
        hit = self.prefix_cache.lookup(seq.request.prompt_tokens, count=first, memo=seq.chain)
        if hit is None:
            return
        seq.shared = hit.prefix
        seq.disk_blocks = hit.disk
        seq.processed = seq.cached_tokens = hit.cached_tokens
        seq.prefix_key = hit.key

    def _reusable_segment(self, seq: Sequence) -> int | None:
        """When no segment has the request's blocks free, one where evicting cached blocks
        would make them free (its hit's segment first): a reservation there needs no new
        segment. None when a segment has room anyway, or none could."""
        if not isinstance(self.store, KVStore) or not len(self.prefix_cache):
            return None
        if self.admission.growth_bytes(seq, exact=True) == 0:
            return None
        need = self.store.request_blocks(seq.final_len)
        if seq.shared is not None:
            own = need - seq.shared.tokens // self.store.block_size
            segment = seq.shared.segment_id
            if self.prefix_cache.room_in_segment(own, self._protected(), only=segment) is not None:
                return segment
        return self.prefix_cache.room_in_segment(need, self._protected())

    def _evict_in_place(self, seq: Sequence, segment_id: int) -> None:
        """Make the request's blocks free in `segment_id` by evicting cached blocks there."""
        assert isinstance(self.store, KVStore)
        need = self.store.request_blocks(seq.final_len)
        if seq.shared is not None and seq.shared.segment_id == segment_id:
            need -= seq.shared.tokens // self.store.block_size
        store = self.store
        protect = self._protected() | ({seq.prefix_key} if seq.prefix_key else set())  # it left the queue
        self.prefix_cache.evict_in_segment(segment_id, lambda: store.free_blocks(segment_id) >= need,
                                           frozenset(protect))

    def _reserve(self, seq: Sequence, *, exact: bool) -> None:
        """The request's KV, allocated now for its whole life (prompt + max_tokens)."""
        shared = seq.shared
        if shared is not None and (seq.prefix_key is None or seq.prefix_key not in self.prefix_cache):
            shared = None  # the entry was evicted meanwhile: recompute from scratch
            seq.processed = seq.cached_tokens = 0
            seq.prefix_key = None
            seq.disk_blocks = ()
        if shared is not None and shared.tokens % self.store.block_size:
            # The hit copies the prefix's partly filled last block into the request's own
            # block, a write into a segment the queued decode step still reads: MLX would
            # copy every layer array of the segment instead of writing in place.
            self.batch.settle()
        alloc = self.store.reserve(seq.request_id, seq.final_len, shared, exact=exact)
        states = self._states()
        if states is not None and shared is not None:
            states.resume(seq.request_id, shared.state)
        if seq.disk_blocks:
            self._read_back(seq)
        assert alloc.length == seq.processed
        seq.has_kv = True
        seq.shared = None

    def _read_back(self, seq: Sequence) -> None:
        """Read the hit's blocks on disk into the request's own blocks, after those it
        shares: its reservation, which admission granted, holds them, and one run of at most
        READ_BACK_BYTES (in host memory, then on the device) is the only transient. A file
        that fails its checks ends the read there: the request prefills the rest."""
        disk, blocks = self.prefix_cache.disk, seq.disk_blocks
        seq.disk_blocks = ()
        assert disk is not None and isinstance(self.store, KVStore)
        self.batch.settle()  # the writes go into a segment the queued decode step may read
        alloc = self.store.get(seq.request_id)
        start = alloc.length
        per_run = max(1, READ_BACK_BYTES // disk.block_bytes)
        for at in range(0, len(blocks), per_run):
            run = blocks[at : at + per_run]
            kv = disk.read_blocks(run)
            if kv is None:
                break
            self.store.load_blocks(seq.request_id, kv)
            mx.eval(alloc.segment.arrays())
            del kv
            if alloc.length < start + (at + len(run)) * self.store.block_size:
                break  # a file failed its checks
        disk.release_buffer()
        seq.processed = seq.cached_tokens = alloc.length

    def _prefill_rate(self) -> float | None:
        """Prompt tokens prefilled per second of waiting for the device, so far."""
        tokens, waited = self._counters["prompt_tokens"], self.batch.prefill_wait_s
        return tokens / waited if tokens and waited > 0 else None

    def _prefill_seconds(self, context: int, tokens: int) -> float | None:
        """What prefilling `tokens` prompt tokens after `context` others would take, for the
        disk tier's read-or-prefill decision: the step budget's fitted line (a token's cost
        grows with the context it attends), else the average rate, else unknown (None)."""
        line = self.step_budget.cost.line
        if line is not None:
            return line.seconds(context, tokens)
        rate = self._prefill_rate()
        return tokens / rate if rate else None

    def _act_on(self, seq: Sequence, decision: Decision, now: float) -> bool:
        """Evict, wait or refuse as the decision says; True when the work may go ahead.

        A request re-checked while it waits is recorded once, when it starts waiting.
        """
        if decision.outcome is not Outcome.WAIT or seq.wait_since is None:
            self.guard.record(decision)
        if decision.outcome is Outcome.ADMIT:
            return True
        if decision.outcome is Outcome.EVICT:
            self.prefix_cache.evict(decision.bytes_to_free, self._protected())
            self.admission.hand_back()  # evicted buffers sit in MLX's cache until then
            return True
        if decision.outcome is Outcome.WAIT:
            if seq.wait_since is None:
                seq.wait_since = now
            if now - seq.wait_since < self.config.wait_timeout_s:
                return False
            self._refuse(seq, decision, timed_out=True)
            return False
        self._refuse(seq, decision, timed_out=False)
        return False

    def _refuse(self, seq: Sequence, decision: Decision, *, timed_out: bool) -> None:
        waited = time.monotonic() - (seq.wait_since or time.monotonic())
        if timed_out and decision.code in (CODE_PROBE_FAILED, CODE_READING_STALE):
            # It waited for a reading, not for memory: say so, and that it is temporary.
            log.info("refused request %s: no memory reading for %.1fs", seq.request_id, waited)
            self.guard.record(dataclasses.replace(decision, outcome=Outcome.REJECT))
            unavailable = MemoryProbeUnavailableError(
                f"Waited {waited:.1f}s for a memory reading and gave up: {decision.reason} "
                "Nothing is admitted blind; retry shortly.",
                retry_after_s=5,
            )
            self._finish(seq, RequestStatus.FINISHED_REJECTED, error=unavailable)
            return
        if timed_out:
            message = (
                f"Waited {waited:.1f}s for memory and gave up: {decision.reason} "
                "Retry when fewer requests are running."
            )
            code = "memory_wait_timeout"
            self.guard.record(
                dataclasses.replace(decision, outcome=Outcome.REJECT, code=code, reason=message)
            )
        else:
            message = decision.reason
            code = decision.code or "prefill_memory_exceeded"
        error = InsufficientMemoryError(
            message,
            code=code,
            estimated_bytes=decision.needed_bytes,
            limit_bytes=decision.limit_bytes,
            binding=decision.binding,
            retryable=timed_out,
        )
        log.info("refused request %s: %s (%s)", seq.request_id, code, decision.binding)
        self._finish(seq, RequestStatus.FINISHED_REJECTED, error=error)

    # ---- prefill ---------------------------------------------------------------------
    def _prefill(self) -> None:
        """This step's prefill: chunks of the prefilling prompts, shortest remaining first
        with aging (`engine.step_budget.prefill_order`), under the step's token budget, run
        together (several prompts per model call).

        The budget is `max_step_tokens` (default: `prefill_step_size`) less one token per
        decoding row, as vLLM's scheduler counts it, but never below the smallest chunk:
        waiting prompts always move. While rows decode, the stall target cuts it further
        to what the step's time allows (`engine.step_budget.StepBudget`). Each round gathers
        at most one chunk per prompt and runs them as one batch; while budget is left (a
        chunk was halved under memory pressure, a prompt finished), another round follows,
        so a lone prompt takes the step's whole budget in several chunks, as before batching.
        """
        step_tokens = self.config.max_step_tokens or STEP_CHUNKS * self.config.prefill_step_size
        budget = max(step_tokens - len(self.batch), self.config.min_chunk_tokens)
        # Tensor-parallel ranks step on rank 0's decisions: a time budget measured on each
        # rank's own clock would cut their chunks differently, so they keep the token budget.
        self.step_budget.begin(decoding=bool(len(self.batch)) and self.lockstep is None)
        self._prefill_s = 0.0
        self._step_prompt_tokens = self._step_context = 0
        ran: set[str] = set()  # prompts that ran a chunk this step
        while budget > 0:
            planned, predicted, stopped = self._gather_chunks(budget, ran=ran)
            ran.update(s.request_id for s, _ in planned)
            if planned:
                self._prefilling_batch = [s for s, _ in planned]
                self._run_chunks(planned, predicted)
                self._prefilling_batch = []
                budget -= sum(n for _, n in planned)
            for seq in [s for s in self.prefilling if s.remaining_prefill == 0]:
                self._join_batch(seq)
            if not planned or stopped:
                break
        if ran:  # aging: a prompt passed over while others ran moves up (prefill_order)
            for seq in self.prefilling:
                if seq.request_id not in ran and seq.remaining_prefill:
                    seq.passed_over += 1

    def _gather_chunks(
        self, budget: int, *, ran: frozenset[str] | set[str] = frozenset()
    ) -> tuple[list[tuple[Sequence, int]], int, bool]:
        """One chunk per prompt while `budget` lasts, each admitted for the batch so far.

        A chunk may be cut short by the budget only when it runs alone: in the step's first
        round (nothing `ran` yet), or as the continuation of a prompt that ran earlier in
        this step (a lone prompt takes the whole budget in several chunks, as load
        admission's mirror, `memory/walk.py`, counts on). A prompt that would get less than its whole
        chunk beside others, or after others, waits for the next step instead.
        A call's rows are right-padded to its longest chunk, so a 28-token remnant beside
        two 1,000-token chunks costs a third 1,000-token row, and the prompt's next chunk
        then starts at 28 while its peers start at 0, which takes the rows off the fused
        causal path (measured on the H200: 47 chunks for 32 prompts of 1,000 tokens).

        Returns the chunks, their batch's prediction, and whether a prompt had to wait (a
        chunk that does not fit beside the batch is no WAIT decision: it is asked again in
        the next round or step; one that does not fit alone waits, and everyone behind it).
        """
        planned: list[tuple[Sequence, int]] = []
        predicted = 0
        order = prefill_order(self.prefilling)
        i = 0
        while i < len(order) and budget > 0:
            seq = self._prefilling_now = order[i]
            if seq.remaining_prefill == 0 or seq not in self.prefilling:
                i += 1  # a prefix hit covered it: it joins (or it was preempted)
                continue
            allow = self.step_budget.allow(seq.processed, budget)
            if allow <= 0:
                break  # the step's time is spent
            if 0 < seq.remaining_prefill - allow < self.config.min_chunk_tokens:
                # Finish the prompt rather than leave a few tokens for a step of their own
                # (the decode rows' share of the budget would otherwise cut 1,000-token
                # prompts into 985 + 15, and rows of unequal length need an array mask).
                allow = seq.remaining_prefill
            if allow < min(seq.chunk_tokens, seq.remaining_prefill) and (
                planned or (ran and seq.request_id not in ran)
            ):
                break  # it would be cut beside other chunks: whole, in the next step
            plan = self.admission.plan_chunk(
                seq, self._admitted(), self._allocated_kv(),
                self.prefix_cache.evictable_bytes(self._protected()),
                max_tokens=allow, batch=planned,
            )
            if planned and plan.decision.outcome is Outcome.WAIT:
                break  # no room beside this batch: asked again in the next round
            if not self._act_on(seq, plan.decision, self.clock()):
                if seq not in self.prefilling:
                    i += 1
                    continue  # refused: the next one may fit
                if (not planned and not len(self.batch) and plan.decision.code == CODE_WAITING
                        and self._preempt_youngest_prefill(seq)):
                    continue  # memory was handed back: ask again (not for an unreadable probe)
                self._prefilling_now = None
                return planned, predicted, True  # it waits, and so does everyone behind it
            seq.wait_since = None
            planned.append((seq, plan.tokens))
            self.step_budget.spend(seq.processed, plan.tokens)
            predicted = plan.predicted_bytes
            budget -= plan.tokens
            i += 1
        self._prefilling_now = None
        return planned, predicted, False

    def _preempt_youngest_prefill(self, head: Sequence) -> bool:
        """Break a wait that nothing would end: the head of the prefill queue waits for
        memory, no sequence is decoding (none will finish and release any), and the rest
        is held by prefills queued behind it. Send the youngest of those back to the
        waiting queue, its KV dropped (it is recomputed later), as vLLM preempts."""
        victims = [s for s in self.prefilling if s is not head]
        if not victims:
            return False
        seq = victims[-1]
        self.prefilling.remove(seq)
        self._drop_kv(seq)
        seq.processed = seq.cached_tokens = 0
        seq.prefix_key = None
        seq.wait_since = None
        seq.status = RequestStatus.WAITING
        self.waiting.appendleft(seq)  # older than anything still waiting
        self._counters["preemptions"] += 1
        mx.clear_cache()
        log.info("preempted request %s to let %s prefill", seq.request_id, head.request_id)
        return True

    def _run_chunks(self, chunks: list[tuple[Sequence, int]], predicted: int) -> None:
        """Run the step's chunks, several prompts per model call, and let the tracker
        learn what the step's batch took against what was predicted for it."""
        tokens = sum(n for _, n in chunks)
        active_before = mx.get_active_memory()
        self.admission.reset_peak()
        started, settled = time.perf_counter(), self.batch.settle_s
        self._counters["prefill_calls"] += self.batch.prefill(chunks, on_settled=self._emit_early)
        seconds = time.perf_counter() - started - (self.batch.settle_s - settled)
        self._prefill_s += seconds
        self._step_prompt_tokens += tokens
        self._step_context = max(self._step_context, *(s.processed for s, _ in chunks))
        self.step_budget.observe_prefill([(s.processed, n) for s, n in chunks], seconds)
        self.admission.observe_chunk(tokens, max(mx.get_peak_memory() - active_before, 0), predicted)
        # No clear_cache here: the guard has memory handed back when admission needs room.
        for seq, n in chunks:
            self._keep_window_checkpoints(seq, seq.processed, seq.processed + n)
            seq.processed += n
        self._counters["prefill_chunks"] += len(chunks)
        self._counters["prompt_tokens"] += tokens

    def _keep_window_checkpoints(self, seq: Sequence, start: int, end: int) -> None:
        """On a model with window layers, a prompt's head is found again only where a copy of
        its rings was kept (`KVStore.hold_prefix`): keep one at the checkpoints a chunk
        passes (`engine.prefix.checkpoints`), so that prompts sharing a long system prompt
        resume from near its end. Its full blocks are shared, not copied."""
        if not isinstance(self.store, KVStore) or self.prefix_cache.max_bytes == 0 or seq.scores_prompt:
            return
        geo = self.store.geometry
        if not geo.windowed and not geo.states:
            return
        prompt = seq.request.prompt_tokens
        # a hybrid's state where its calls ended on boundaries inside the chunk (`Runner.kept`)
        kept = dict(self.batch.kept.pop(seq.request_id, ())) if geo.states else {}
        for boundary in checkpoints_between(start, end, len(prompt), self.config.prefill_step_size):
            if boundary <= seq.cached_tokens or (geo.states and boundary != end and boundary not in kept):
                continue
            # the room kept for the prompt's and the conversation's ends stays free
            prefix = self._hold(seq, boundary, leave_free=self.store.snapshot_spare(),
                                state=kept.get(boundary))
            if prefix is not None:
                self.prefix_cache.insert(prompt[:boundary], prefix)

    def _join_batch(self, seq: Sequence) -> None:
        """Joining copies nothing: the request's blocks stay where they are, and its last
        prompt token is its input in the next decode step."""
        prompt = seq.request.prompt_tokens
        if seq.processed > seq.cached_tokens and seq.processed > 0:
            prefix = self._hold(seq, seq.processed)
            if prefix is not None:
                self.prefix_cache.insert(prompt[: prefix.tokens], prefix)
        scores = (None, *seq.prompt_logprobs) if seq.scores_prompt else ()
        seq.prompt_logprobs = []
        if seq.request.max_tokens == 0:  # scoring only: the prompt was the work
            self.prefilling.remove(seq)
            seq.status = RequestStatus.FINISHED_LENGTH
            self._drop_kv(seq)
            seq.prefix_key = None
            self._outputs.append(RequestOutput(seq.request_id, (), finish_reason="length",
                                               cached_tokens=seq.cached_tokens, prompt_logprobs=scores))
            return
        if scores:
            self._outputs.append(RequestOutput(seq.request_id, (), prompt_logprobs=scores))
        self.batch.join(seq)
        self.prefilling.remove(seq)
        seq.prefix_key = None
        seq.status = RequestStatus.RUNNING

    # ---- decode ----------------------------------------------------------------------
    def _emit_early(self) -> None:
        """Once a prefill call has waited for the queued decode step (it writes the pool
        the step reads, `Runner.settle`), with its graph built and before it runs: read that
        step's tokens and hand them out now. Left to the step's own decode, they would wait
        for the prefill too, and a request whose prompt just finished would get its first
        token a whole prefill chunk late (beside a long prompt's 512-token chunk at 80k of
        context, 138 ms on an H100)."""
        produced = self.batch.read_pending()
        if not produced:
            return
        self._early_rows = len(self.batch)
        self._early.update((id(item.seq), item.seq) for item in produced)
        self._emit(produced)
        outputs, self._outputs = self._outputs, []
        self.publish(outputs)

    def _decode(self) -> None:
        early, early_rows = self._early, self._early_rows
        self._early, self._early_rows = {}, 0
        rows = len(self.batch)
        produced = self.batch.step() if rows else []
        if rows or early:
            self._counters["decode_steps"] += 1
        stepped = {**early, **{id(item.seq): item.seq for item in produced}}
        if len(stepped) > 1:
            self._counters["batched_steps"] += 1
        for seq in stepped.values():
            seq.decode_steps += 1
        if produced or early:
            self._counters["decode_rows"] += max(rows, early_rows)
        self._emit(produced)

    def _emit(self, produced: list[StepToken]) -> None:
        """A step's tokens to their requests, in order; rows that finish leave the batch."""
        finished: list[Sequence] = []
        for item in produced:  # a row's tokens in order: several where drafts were accepted
            seq = item.seq
            if seq.status.finished:
                continue  # verified past its stop token or max_tokens
            seq.generated += 1
            self._counters["generated_tokens"] += 1
            seq.outputs.append(item.token)
            status = None
            if item.token in seq.request.stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif seq.generated >= seq.request.max_tokens:
                status = RequestStatus.FINISHED_LENGTH
            emitted = () if status is RequestStatus.FINISHED_STOPPED else (item.token,)
            logprobs = (item.logprob,) if item.logprob is not None and emitted else ()
            if status is None:
                self._outputs.append(RequestOutput(seq.request_id, emitted, logprobs))
            else:
                seq.status = status
                finished.append(seq)
                self._outputs.append(
                    RequestOutput(
                        seq.request_id, emitted, logprobs,
                        finish_reason="stop" if status is RequestStatus.FINISHED_STOPPED else "length",
                        cached_tokens=seq.cached_tokens,
                        speculation=Speculation(seq.drafted, seq.accepted, seq.decode_steps)
                        if seq.drafted else None,
                    )
                )
        ends: dict[int, Snapshot] = {}  # a hybrid's finished rows' state, before the rows leave
        states = self._states()
        if states is not None:
            index = {id(s): i for i, s in enumerate(self.batch.seqs)}
            ends = {id(s): states.row(index[id(s)]) for s in finished if id(s) in index}
        self.batch.remove(finished)
        for seq in finished:
            self._cache_conversation(seq, ends.get(id(seq)))
            self._drop_kv(seq)

    def _states(self) -> StateRows | None:
        """A hybrid's recurrent state beside the paged store (`engine.kv.state`), or None."""
        return getattr(self.batch, "states", None)

    def _hold(self, seq: Sequence, tokens: int, *, leave_free: int = 0,
              state: Snapshot | None = None) -> SharedPrefix | None:
        """`KVStore.hold_prefix`, and on a hybrid the recurrent state after `tokens`:
        `state`, taken there, or (None) the request's own, where `tokens` is what it has
        written. Nothing is held where the state is not there (a prefix without its state
        cannot be resumed)."""
        if not isinstance(self.store, KVStore):
            return self.store.hold_prefix(seq.request_id, tokens)  # a snapshot of mlx-lm's caches
        prefix = self.store.hold_prefix(seq.request_id, tokens, leave_free=leave_free)
        states = self._states()
        if prefix is None or states is None:
            return prefix
        at = self.store.get(seq.request_id).length if state is None else tokens
        if prefix.tokens != at:
            self.store.drop_prefix(prefix)
            return None
        return dataclasses.replace(prefix, state=states.snapshot(seq.request_id) if state is None else state)

    def _cache_conversation(self, seq: Sequence, state: Snapshot | None = None) -> None:
        """A finished request's prompt and answer stay in the prefix cache: the next turn of
        the conversation sends both back, and finds them."""
        if not seq.has_kv or seq.scores_prompt:
            return
        tokens = (*seq.request.prompt_tokens, *seq.outputs)
        written = self.store.get(seq.request_id).length
        if self._states() is not None and (state is None or written > len(tokens)):
            return  # a hybrid's state is after `written` tokens, and only those are known
        prefix = self._hold(seq, min(written, len(tokens)), state=state)
        if prefix is not None:
            self.prefix_cache.insert(tokens[: prefix.tokens], prefix)

    def _drop_kv(self, seq: Sequence) -> None:
        states = self._states()
        if states is not None:
            states.drop(seq.request_id)
            self.batch.kept.pop(seq.request_id, None)  # type: ignore[union-attr]
        if seq.has_kv:
            self.store.release(seq.request_id)
            seq.has_kv = False
        seq.shared = None
        seq.looked_up = False

    def _step_failed(self, exc: Exception, victims: list[Sequence]) -> None:
        """A prefill or decode raised. A device out-of-memory is refused with 507; anything
        else fails the step's requests with 500 and its cause. Either way their KV is freed
        and the engine serves on, unless steps keep failing: then the engine is broken, and
        the exception ends the engine thread (503 for everyone, a non-zero exit)."""
        if self.lockstep is not None:
            raise exc  # a step that failed on one rank leaves the group apart: it ends the group
        if is_out_of_memory(exc):
            self._recover_from_device_oom(exc, victims)
            return
        self._failed_steps += 1
        if self._failed_steps >= MAX_FAILED_STEPS_IN_A_ROW:
            log.error("%d steps in a row failed; stopping the engine", self._failed_steps)
            raise exc
        log.error("a step failed (%s: %s); failing %d request(s)", type(exc).__name__, exc,
                  len(victims), exc_info=exc)
        self._counters["step_failures"] += 1
        self._drop_victims(victims, EngineStepError(exc))

    def _drop_victims(self, victims: list[Sequence], error: Exception) -> None:
        """Fail `victims` with `error`. A decode failure leaves the batch's in-flight arrays
        unusable, so its caller passes every row; the prefix cache may hold blocks the
        failed call half wrote, so it goes too."""
        if victims and victims == self.batch.seqs:
            self.batch.remove(list(victims))
        for seq in victims:
            self._finish(seq, RequestStatus.FINISHED_REJECTED, error=error)
        self.prefix_cache.clear()
        mx.clear_cache()

    def _recover_from_device_oom(self, exc: Exception, victims: list[Sequence]) -> None:
        """The last line of defence, for backends where an allocation failure is catchable
        (CUDA, recent Metal). Admission should have prevented it; free the work involved,
        refuse it with 507, and keep serving."""
        log.error("device out of memory; refusing %d request(s)", len(victims))
        self._counters["oom_recoveries"] += 1
        error = InsufficientMemoryError(
            "The device ran out of memory during this request although admission allowed "
            "it; it was stopped to keep the server up. Retry, or lower the memory tier.",
            code="device_out_of_memory",
            estimated_bytes=0,
            limit_bytes=0,
            binding="device",
            retryable=True,
        )
        self._drop_victims(victims, error)

    def _refuse_unprobed(self, seq: Sequence | None, exc: ProbeUnavailableError) -> None:
        """No memory reading to admit on: refuse the work that asked (503, retry later);
        what is already decoding goes on, since decode steps need no admission."""
        if seq is None:
            return
        log.info("refused request %s: memory probe unavailable", seq.request_id)
        error = MemoryProbeUnavailableError(str(exc), retry_after_s=exc.retry_after_s)
        self._finish(seq, RequestStatus.FINISHED_REJECTED, error=error)

    # ---- endings ---------------------------------------------------------------------
    def _abort(self, request_id: str) -> None:
        for seq in [*self.waiting, *self.prefilling, *self.batch.seqs]:
            if seq.request_id == request_id:
                self._finish(seq, RequestStatus.FINISHED_ABORTED)
                return

    def _finish(self, seq: Sequence, status: RequestStatus, error: Exception | None = None) -> None:
        seq.status = status
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.prefilling:
            self.prefilling.remove(seq)
        elif seq in self.batch.seqs:
            self.batch.remove([seq])
        self._drop_kv(seq)
        seq.prefix_key = None
        reason = "abort" if status is RequestStatus.FINISHED_ABORTED else "rejected"
        self._outputs.append(
            RequestOutput(
                seq.request_id, (), finish_reason=reason, cached_tokens=seq.cached_tokens, error=error
            )
        )

    def release(self) -> None:
        """Drop everything this core holds but its last stats: the model, the batch, every
        cache, the queues. Call it on the engine thread once the loop has ended, so the
        arrays are freed there (the caller then collects garbage and synchronizes). It
        drops attributes wholesale rather than by name, so whatever holds MLX state next
        (a KV store, a runner) goes too."""
        keep = {"stats", "config", "inbox", "_stop"}
        for name in [n for n in vars(self) if n not in keep]:
            delattr(self, name)

    def _abort_all(self, why: str) -> None:
        for seq in [*self.waiting, *self.prefilling, *self.batch.seqs]:
            self._finish(seq, RequestStatus.FINISHED_ABORTED)
        if self._outputs:
            outputs, self._outputs = self._outputs, []
            self.publish(outputs)
        log.info("engine stopped: %s", why)

    def _publish_stats(self) -> None:
        c = self._counters
        kv = self.store.stats()
        self.stats = EngineStats(
            waiting=len(self.waiting),
            prefilling=len(self.prefilling),
            running=len(self.batch),
            committed_bytes=kv.request_bytes,
            kv_bytes=kv.request_bytes,
            kv_reserved_bytes=kv.reserved_bytes,
            kv_used_bytes=kv.used_bytes,
            kv_pool_bytes=kv.pool_bytes,
            kv_bytes_per_token=kv.bytes_per_token,
            kv_block_size=kv.block_size,
            kv_segments=kv.segments,
            kv_bits=self.config.kv_bits,
            kv_group_size=None if self.config.kv_bits is None else self.config.kv_group_size,
            kv_layer_groups=kv.groups,
            kv_state_bytes=kv.state_bytes,
            prefix_cache=self.prefix_cache.stats(),
            prefix_budget_bytes=max(self._prefix_budget, self.prefix_cache.nbytes),
            steps=c["steps"],
            decode_steps=c["decode_steps"],
            prefill_chunks=c["prefill_chunks"],
            prefill_calls=c["prefill_calls"],
            max_batch=self.batch.max_batch_seen,
            batched_steps=c["batched_steps"],
            generated_tokens=c["generated_tokens"],
            prompt_tokens=c["prompt_tokens"],
            preemptions=c["preemptions"],
            oom_recoveries=c["oom_recoveries"],
            step_failures=c["step_failures"],
            admission_checks=self.admission.checks,
            admission_s=round(self.admission.check_seconds, 6),
            busy_s=round(self._busy_s, 6),
            decode_wait_s=round(self.batch.decode_wait_s, 6),
            prefill_wait_s=round(self.batch.prefill_wait_s, 6),
            queue_s=round(self.batch.queue_s, 6),
            compiled_steps=0 if self.batch.compiled is None else self.batch.compiled.replays,
            decode_traces=0 if self.batch.compiled is None else self.batch.compiled.traces,
            sliced_steps=self.batch.sliced_steps,
            slice_choice=None if self.batch.slice_choice is None else self.batch.slice_choice.report(),
            engine_cpu_s=round(self._cpu_s, 6),
            recent_chunks=self.admission.recent_chunks(),
            peak_bytes=self.admission.lifetime_peak_bytes(),
            cache_limit_bytes=self.admission.cache_limit_bytes,
            warmup_s=round(self.warmup_s, 3),
            step_budget=self.step_budget.report(),
            decode_rows=c["decode_rows"],
            prefill_keys=self.store.key_lengths.report(),
            speculative=self._speculative_report(),
        )

    def _speculative_report(self) -> dict[str, object] | None:
        spec = getattr(self.batch, "speculator", None)
        if spec is None:
            return None
        rows = self._counters["decode_rows"]
        per_step = round(self._counters["generated_tokens"] / rows, 4) if rows else None
        return {**spec.report(), "tokens_per_row_step": per_step}

    def follow_memory_policy(self) -> int:
        """Re-derive MLX's cache limit after the guard's policy changed; on the engine thread
        (through `call`). Returns the limit MLX now holds."""
        committed = self.admission.committed_bytes(self._admitted(), self._allocated_kv())
        limit = self.admission.follow_ceiling(committed)
        self._publish_stats()
        return limit
