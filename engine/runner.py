"""The model calls themselves: prefill chunks (several requests per call), a decode step for
the batch.

KV lives in the engine's `KVStore`; the runner only names which request's blocks a call
reads and writes. A request joins the batch with no model call of its own: its last
prompt token is simply its input in the next decode step, whose sample is its first
output token. Sampling stays one call of `BatchSampler` on the step's [B, vocab] logits
with per-row parameters.

Pipelining. Step n+1's graph is built while step n runs on the device. By default it is
queued (`mx.async_eval`) only once step n's tokens are back: MLX decides at queue time
whether a slice update may write in place, and a buffer that in-flight work still
references is copied instead, so queueing the writes of step n+1 while step n still
reads the pool would copy the pool's layer arrays every step (measured on the CPU: 5x
slower). `overlap=True` queues first (mlx-lm's order); docs/kv-store.md has both measured,
and the engine picks per backend (`EngineConfig.decode_overlap`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.compiled_decode import CompiledDecode
from engine.kv import KVStore, decode_caches, plan_decode, prefill_caches
from engine.kv.cache import DecodeTables, PrefillCache
from engine.kv.plan_ahead import plan_ahead
from engine.kv.prefill import PrefillRow, batch_prefill_caches, group_by_segment, plan_prefill
from engine.kv.state import Snapshot, StateRows
from engine.kv.store import Allocation
from engine.prefix.checkpoints import checkpoints_between
from engine.prompt_scoring import score_chunk
from engine.request import TokenLogprob
from engine.sampling import BatchSampler, SampledStep
from engine.sequence import Sequence
from engine.slice_choice import SliceChoice
from engine.speculative import ChunkRow, Speculator, Verified, accepted_length, verify

log = logging.getLogger("mlx_headroom.engine")


@dataclass(frozen=True)
class StepToken:
    seq: Sequence
    token: int
    logprob: TokenLogprob | None


class ReadsEarly:
    """What both runners (this one and `engine.dense.DenseRunner`) share around their
    queued decode step: a prefill waits for it (`settle`), and its tokens are read when the
    engine asks, once it is done, rather than by the next `step`."""

    pending: SampledStep | None
    read: list[int] | None  # `pending`'s tokens, read and handed out early
    seqs: list[Sequence]
    sampler: BatchSampler
    decode_wait_s: float
    settle_s: float
    _on_settled: Callable[[], None] | None = None  # run once by the next settle (prefill's)

    def prefill(self, chunks: Seq[tuple[Sequence, int]],
                on_settled: Callable[[], None] | None = None) -> int:
        """Run each request's next `tokens` prompt tokens (`_prefill`, the runner's own);
        `on_settled` runs once the queued decode step is done, after the first call's graph
        is built and before it runs (`settle`). Returns the number of model calls made."""
        self._on_settled = on_settled
        try:
            return self._prefill(chunks)
        finally:
            self._on_settled = None

    def _prefill(self, chunks: Seq[tuple[Sequence, int]]) -> int:
        raise NotImplementedError

    def settle(self) -> None:
        """Let the queued decode step finish: writes into the pool or the caches (a prefill
        chunk, a prefix's copy-on-write) must find no queued work reading them, or MLX
        copies the arrays instead of writing in place. Then run what the engine asked for
        once that step is done (`prefill(on_settled=...)`): its tokens are there to read."""
        started = time.perf_counter()
        if self.pending is not None:
            mx.eval(*self.pending.arrays())
        hook, self._on_settled = self._on_settled, None
        if hook is not None:
            hook()
        self.settle_s += time.perf_counter() - started

    def read_pending(self) -> list[StepToken]:
        """The queued decode step's tokens, now (the engine hands them out before a prefill
        call that waits for that step anyway). Not where rows need feedback: their
        processors take the tokens as the step reads them."""
        current = self.pending
        if current is None or self.read is not None or self.sampler.needs_feedback:
            return []
        self.read = self._read_tokens(current)
        return step_tokens(current, self.seqs, self.read)

    def _take(self, current: SampledStep) -> tuple[list[int], bool]:
        """`current`'s tokens, and whether `read_pending` handed them out already."""
        read, self.read = self.read, None
        return (read, True) if read is not None else (self._read_tokens(current), False)

    def _read_tokens(self, step: SampledStep) -> list[int]:
        """The host sync of a decode step: its time is the device's, not the host's."""
        started = time.perf_counter()
        tokens: list[int] = step.tokens.tolist()
        self.decode_wait_s += time.perf_counter() - started
        return tokens


def _records_first_full(caches: list[PrefillCache]) -> None:
    """Ask the first full layer's cache read as a view to keep its attention call."""
    for cache in caches:
        if cache.window is None and cache.run_start is not None:
            cache.records_call = True
            return


def step_tokens(step: SampledStep, seqs: list[Sequence], tokens: list[int]) -> list[StepToken]:
    """The first len(tokens) rows' tokens of a read step, with their logprobs."""
    emitting = seqs[: len(tokens)]
    logprobs = _read_logprobs(step, emitting)
    return [
        StepToken(seq, tok, logprobs[i] if logprobs else None)
        for i, (seq, tok) in enumerate(zip(emitting, tokens, strict=True))
    ]


class Runner(ReadsEarly):
    def __init__(
        self, model: Any, store: KVStore, *, overlap: bool = False, prefill_batch: int = 8,
        compiled: CompiledDecode | None = None, slice_decode: bool | None = None,
        speculator: Speculator | None = None, plan_ahead: bool = True, states: StateRows | None = None,
        checkpoint_every: int = 0,
    ) -> None:
        self.model = model
        # A hybrid's recurrent state, beside the store's blocks (engine.kv.state); None: none.
        # Its prompts' calls end on the prefix cache's checkpoint boundaries (every this many
        # tokens; 0: none), where the state is kept (`kept`: request -> [(tokens, state)]).
        self.states = states
        self.checkpoint_every = checkpoint_every
        self.kept: dict[str, list[tuple[int, Snapshot]]] = {}
        self.store = store
        self.overlap = overlap
        self.compiled = compiled  # replays decode steps whose shape holds still (None: all eager)
        self.prefill_batch = max(prefill_batch, 1)  # most chunks in one prefill call
        self.seqs: list[Sequence] = []  # the batch; rows [0, len(pending)) have a token in flight
        self.pending: SampledStep | None = None
        self.read: list[int] | None = None  # `pending`'s tokens, read and handed out early
        self.fresh: list[int] = []  # last prompt token of each row that joined since the last step
        self.sampler = BatchSampler([])
        # block tables, kept while the batch's rows stay the same; `slice_decode`: a lone row on
        # consecutive blocks is read as one slice of the pool (engine.kv.attention.run_decode),
        # stepped eagerly. None: always where steps are eager; where they are replayed, the
        # faster of the two paths on this machine, timed on the first lone rows (SliceChoice).
        self.slice_decode = slice_decode
        self.slice_choice = SliceChoice() if slice_decode is None and compiled is not None else None
        self.force_slice: bool | None = None  # set by the warm-up: this path, and no timing
        self.tables = DecodeTables(runs=slice_decode is not False)
        self._lone: tuple[bool, bool, float] | None = None  # last lone step: sliced, clean, start
        self.max_batch_seen = 0
        self.sliced_steps = 0  # decode steps with a row read as one slice of the pool
        # Seconds the engine thread sat waiting for the device (reading a step's tokens,
        # evaluating a prefill call): the rest of its busy time is host work.
        self.decode_wait_s = 0.0
        self.prefill_wait_s = 0.0
        self.queue_s = 0.0  # inside mx.async_eval of decode steps (see _queue)
        self.settle_s = 0.0  # of those waits, for a queued decode step before a write (settle)
        self.last_chunk_s = 0.0  # the last lone prefill chunk's time on the device, once queued
        self.plan_ahead = plan_ahead  # plan the next chunk's shape behind this one (engine.kv.plan_ahead)
        # Tensor parallel: every rank feeds back rank 0's tokens (engine.distributed).
        self.agree: Callable[[SampledStep], SampledStep] | None = None
        # Speculative decoding (engine.speculative): while the batch is small, rows with drafts
        # verify them in one chunk each. None: every step is the ordinary one.
        self.speculator = speculator

    def __len__(self) -> int:
        return len(self.seqs)

    # ---- prefill ---------------------------------------------------------------------
    def prefill_chunk(self, seq: Sequence, tokens: int) -> None:
        """Run prompt tokens [processed, processed + tokens) into the request's own blocks."""
        self.prefill([(seq, tokens)])

    def _prefill(self, chunks: Seq[tuple[Sequence, int]]) -> int:
        """Run each request's next `tokens` prompt tokens, several requests per model call.

        Chunks living in one segment share a call (`engine.kv.prefill`), up to
        `prefill_batch` of them; a lone chunk keeps the single-request path (no padding,
        the "causal" mask). Returns the number of model calls made.
        """
        rows = []
        calls = 0
        more: dict[str, int] = {}  # prompt tokens each request has left after this chunk
        lengths = {seq.request_id: len(seq.request.prompt_tokens) for seq, _ in chunks}
        for seq, tokens in chunks:
            alloc = self.store.get(seq.request_id)
            start = alloc.length
            row = PrefillRow(alloc, tuple(seq.request.prompt_tokens[start : start + tokens]))
            more[seq.request_id] = len(seq.request.prompt_tokens) - start - tokens
            if seq.scores_prompt:
                self._prefill_scored(seq, row)  # alone: its logits are read, row by row
                calls += 1
            else:
                rows.append(row)
        advanced: set[str] = set()
        if self.states is not None:  # one prompt per call, each its own rows' state
            for r in rows:
                calls += self._prefill_with_state(r, lengths[r.alloc.request_id])
                advanced.add(r.alloc.request_id)
            rows = []
        layers = self.store.geometry.num_layers
        for group in group_by_segment(rows) if self.prefill_batch > 1 else [[r] for r in rows]:
            for part in _batches(group, self.prefill_batch):
                ahead: list[PrefillCache] = []
                if len(part) == 1:
                    r = part[0]
                    chunk = mx.array(r.tokens)[None]
                    caches = prefill_caches(self.store, r.alloc, len(r.tokens))
                    if more[r.alloc.request_id] >= len(r.tokens) and self._plan_pays(r):
                        ahead = caches
                        _records_first_full(caches)
                    self.model(chunk, cache=self._with_states(caches, r.alloc.request_id))
                else:
                    plan = plan_prefill(self.store, part)
                    self.model(plan.inputs, cache=batch_prefill_caches(plan, layers))
                calls += 1
                # The chunk writes into a segment the queued decode step may still read:
                # let that step finish first, or MLX would copy the segment's arrays.
                started = time.perf_counter()
                self.settle()
                self._run_call(part, ahead)
                self.prefill_wait_s += time.perf_counter() - started
        for seq, tokens in chunks:
            if seq.request_id not in advanced:
                self.store.advance(seq.request_id, tokens)
        return calls

    def _prefill_with_state(self, row: PrefillRow, prompt_len: int) -> int:
        """A hybrid's chunk: one call per stretch between the prefix cache's checkpoint
        boundaries it crosses (`engine.prefix.checkpoints`), since recurrent state can be
        kept only where a call ends; each boundary's state goes to `kept`. The state is
        evaluated with the blocks, so that no call's activations stay referenced by it.
        Returns the calls made."""
        assert self.states is not None
        rid, alloc = row.alloc.request_id, row.alloc
        start = alloc.length
        end = start + len(row.tokens)
        stops = [b for b in checkpoints_between(start, end, prompt_len, self.checkpoint_every) if b < end]
        at = start
        for stop in [*stops, end]:
            piece = row.tokens[at - start : stop - start]
            caches = prefill_caches(self.store, alloc, len(piece))
            self.model(mx.array(piece)[None], cache=self._with_states(caches, rid))
            started = time.perf_counter()
            self.settle()
            mx.eval(alloc.segment.arrays(), self.states.arrays(rid))
            self.last_chunk_s = time.perf_counter() - started
            self.prefill_wait_s += self.last_chunk_s
            self.store.advance(rid, len(piece))
            if stop < end:
                self.kept.setdefault(rid, []).append((stop, self.states.snapshot(rid)))
            at = stop
        return len(stops) + 1

    def _run_call(self, part: list[PrefillRow], ahead: list[PrefillCache]) -> None:
        """Evaluate a prefill call. A lone request's call is timed on the device
        (`_plan_pays`); where `ahead` holds its caches, the next chunk's attention shape
        is planned behind it (`engine.kv.plan_ahead`)."""
        arrays = part[0].alloc.segment.arrays()
        launched = time.perf_counter()
        planning = None
        if ahead:
            mx.async_eval(*arrays)  # queued first: the plan is built while the device runs it
            planning = plan_ahead(self.store, part[0].alloc, ahead, len(part[0].tokens))
        if planning is None:
            mx.eval(*arrays)
            if len(part) == 1:
                self.last_chunk_s = time.perf_counter() - launched
            return
        mx.async_eval(planning)  # the plan is built here, on the host
        built = time.perf_counter()
        mx.eval(*arrays, planning)
        done = time.perf_counter()
        # The device still ran once the plan was built: the chunk took about the whole wait,
        # and the plan was hidden. Else the chunk ended first, and what is left of the wait
        # is its last part, not its length.
        hidden = done - built >= 0.1 * (done - launched)
        self.last_chunk_s = done - launched if hidden else done - built

    def _plan_pays(self, row: PrefillRow) -> bool:
        """Whether to plan the chunk after `row`'s (of its size) while `row`'s runs: where
        the last lone chunk's time on the device hides enough of a plan that it costs less
        than padding that chunk (`KeyLengths.ahead_pays`, `engine.kv.plan_ahead`)."""
        tokens = len(row.tokens)
        return self.plan_ahead and self.store.key_lengths.ahead_pays(
            tokens, row.alloc.length + 2 * tokens, self.last_chunk_s * 1e3)

    def _prefill_scored(self, seq: Sequence, row: PrefillRow) -> None:
        """A chunk of a request that scores its prompt: the single-request call, whose
        logits at position j give the logprob of the prompt token after it."""
        start = row.alloc.length
        logits = self.model(mx.array(row.tokens)[None], cache=self._with_states(
            prefill_caches(self.store, row.alloc, len(row.tokens)), seq.request_id))
        states = [] if self.states is None else self.states.arrays(seq.request_id)
        started = time.perf_counter()
        self.settle()
        following = seq.request.prompt_tokens[start + 1 : start + 1 + len(row.tokens)]
        seq.prompt_logprobs.extend(score_chunk(logits[0], following, seq.request.prompt_logprobs or 0))
        mx.eval(row.alloc.segment.arrays(), states)
        self.prefill_wait_s += time.perf_counter() - started

    # ---- the batch -------------------------------------------------------------------
    def _with_states(self, caches: list[PrefillCache], request_id: str) -> list[Any]:
        """A prefill call's caches: the store's, and a hybrid's own state caches for the
        request between them."""
        if self.states is None:
            return caches  # type: ignore[return-value]
        return self.states.caches(caches, self.states.of(request_id))

    def join(self, seq: Sequence) -> None:
        if self.states is not None:
            self.states.join(seq.request_id)
        self.seqs.append(seq)
        self.fresh.append(seq.request.prompt_tokens[-1])
        self.sampler = BatchSampler([s.request.sampling for s in self.seqs])
        self.max_batch_seen = max(self.max_batch_seen, len(self.seqs))

    def step(self) -> list[StepToken]:
        """Queue this step's forward and sampling, then read back the previous step's tokens."""
        if not self.seqs:
            return []
        spec = self.speculator
        if spec is not None and self.agree is None and spec.active(len(self.seqs)):
            produced = self._speculate(spec)
            if produced is not None:
                return produced
        current = self.pending
        n_current = 0 if current is None else current.tokens.shape[0]
        inputs = self._inputs(current)
        started = time.perf_counter()
        allocs = [self.store.get(s.request_id) for s in self.seqs]
        choosing = self._choose_path(allocs, started)
        plan = plan_decode(self.store, allocs, self.tables)
        sliced = any(g.run_start is not None for g in plan.groups)
        self.sliced_steps += sliced
        replays = -1 if self.compiled is None else self.compiled.replays
        traces = -1 if self.compiled is None else self.compiled.traces
        logits = None if self.compiled is None else self.compiled.logits(plan, inputs, self.states)
        if choosing and self.compiled is not None:  # SliceChoice exists only where steps replay
            clean = sliced or (self.compiled.replays > replays and self.compiled.traces == traces)
            self._lone = (sliced, clean, started)
        if logits is None:
            caches: list[Any] = decode_caches(plan, self.store.geometry.num_layers)
            if self.states is not None:
                assert self.states.batch is not None
                caches = self.states.caches(caches, self.states.batch)
            logits = self.model(inputs[:, None], cache=caches)[:, -1, :]
        # each row's count of emitted tokens once its pending one is out (already, if read early)
        out = n_current if self.read is None else 0
        steps = [s.generated + (1 if i < out else 0) for i, s in enumerate(self.seqs)]
        for s in self.seqs:
            self.store.advance(s.request_id, 1)
        self.fresh = []
        if self.sampler.needs_feedback:
            return self._step_with_feedback(current, logits, steps)
        self.pending = self._sample(logits, steps)
        if current is None or self.overlap:
            self._queue(self.pending)
        if current is None:
            return []
        tokens, handed_out = self._take(current)
        if not self.overlap:
            self._queue(self.pending)
        return [] if handed_out else step_tokens(current, self.seqs, tokens)

    def _speculate(self, spec: Speculator) -> list[StepToken] | None:
        """A step that verifies drafts: the previous step's tokens are read first (they end
        the text the drafts are looked up in), then every row runs its input and its drafts
        as one chunk (none: one token), all rows of a segment in one prefill call. Each row
        emits the drafts the target agreed with; the target's next token is its new pending
        one. None, having read but not consumed the previous step, when no row has a draft:
        the ordinary step runs."""
        current = self.pending
        n_current = 0 if current is None else current.tokens.shape[0]
        tokens, handed_out = self._take(current) if current is not None else ([], False)
        allocs = [self.store.get(s.request_id) for s in self.seqs]
        drafts = []
        for i, (seq, alloc) in enumerate(zip(self.seqs, allocs, strict=True)):
            emitted = seq.generated + (i < n_current and not handed_out)  # once its pending token is out
            room = min(seq.request.max_tokens - emitted - 1,  # the target's token ends the run
                       alloc.capacity * self.store.block_size - alloc.length - 1)
            last = tokens[i] if i < n_current and not handed_out else None  # else in its outputs
            if last is not None and last in seq.request.stop_token_ids:
                room = 0  # it ends with this step
            drafts.append(spec.propose(seq, last, room))
        if not any(drafts):
            spec.skipped_steps += 1
            self.read = tokens if handed_out else None  # the ordinary step emits them, or not
            return None
        self.settle()
        if handed_out:
            n_emit = 0
            logprobs = []
        else:
            n_emit = n_current
            logprobs = _read_logprobs(current, self.seqs[:n_current]) if current is not None else []
        if self.sampler.needs_feedback:
            self.sampler.accept(tokens)
        inputs = [*tokens, *self.fresh]
        rows = [
            ChunkRow(PrefillRow(alloc, (inputs[i], *drafts[i])), seq.request.sampling,
                     seq.generated + (i < n_current and not handed_out))
            for i, (seq, alloc) in enumerate(zip(self.seqs, allocs, strict=True))
        ]
        started = time.perf_counter()
        verified = verify(self.model, self.store, rows)
        self.decode_wait_s += time.perf_counter() - started
        out: list[StepToken] = []
        pending: list[tuple[Verified, int]] = []
        for i, (seq, draft, v) in enumerate(zip(self.seqs, drafts, verified, strict=True)):
            if i < n_emit:
                out.append(StepToken(seq, tokens[i], logprobs[i] if logprobs else None))
            n = accepted_length(draft, v.tokens)
            if draft:
                spec.record(seq, len(draft), n)
            out.extend(StepToken(seq, v.tokens[j], _verified_logprob(v, j, seq)) for j in range(n))
            pending.append((v, n))
            self.store.advance(seq.request_id, n + 1)
        spec.steps += 1
        self.pending = _host_step(pending)
        self.fresh = []
        self._lone = None
        return out

    def _choose_path(self, allocs: list[Allocation], now: float) -> bool:
        """Set this step's slice rule; True when the step is one SliceChoice times (a trial
        step, or one of the chosen path's, which stays watched). The interval since the last
        timed step is a sample when both took the same path and that one was clean (the
        slice, or a replay that traced nothing)."""
        choice = self.slice_choice
        if self.force_slice is not None:
            self.tables.runs = self.force_slice
            self._lone = None
            return False
        if choice is None:
            return False
        self.tables.keep(allocs, self.store)
        if not self.tables.lone_run:
            self._lone = None
            if choice.chosen is not None:
                self.tables.runs = choice.chosen
            return False
        sliced = choice.next_sliced()
        last = self._lone
        if last is not None and last[0] == sliced and last[1]:
            before = choice.chosen
            choice.record(sliced, now - last[2])
            if choice.chosen != before:
                log.info("lone-row decode path, timed on this machine: %s", choice.report())
            sliced = choice.next_sliced()  # the slice's samples may be in: on to the graph
        self.tables.runs = sliced
        return True

    def _sample(self, logits: mx.array, steps: list[int]) -> SampledStep:
        step = self.sampler.sample(logits, steps)
        return step if self.agree is None else self.agree(step)

    def _step_with_feedback(
        self, current: SampledStep | None, logits: mx.array, steps: list[int]
    ) -> list[StepToken]:
        """A constrained or penalised row must see the token it just emitted before its next
        mask: read the previous step's tokens first (which also lets that step finish before
        this one writes the pool), hand them to the rows' processors, then sample. Rows that
        joined this step have emitted nothing yet; their first sample needs no feedback."""
        tokens, handed_out = self._take(current) if current is not None else ([], False)
        self.sampler.accept(tokens)
        self.pending = self._sample(logits, steps)
        self._queue(self.pending)
        if current is None or handed_out:
            return []
        return step_tokens(current, self.seqs, tokens)

    def _queue(self, step: SampledStep) -> None:
        """Queue a decode step. On CUDA this is launch work; MLX also blocks here while too
        many tasks are in flight, which on the CPU backend means computing the step."""
        started = time.perf_counter()
        mx.async_eval(*step.arrays())
        self.queue_s += time.perf_counter() - started

    def _inputs(self, current: SampledStep | None) -> mx.array:
        fresh = mx.array(self.fresh, dtype=mx.uint32) if self.fresh else None
        if current is None:
            assert fresh is not None
            return fresh
        return current.tokens if fresh is None else mx.concatenate([current.tokens, fresh])

    def remove(self, leaving: Seq[Sequence]) -> None:
        """Rows leave; only the small per-row token arrays are compacted, never KV."""
        if not leaving:
            return
        gone = {id(s) for s in leaving}
        n_current = 0 if self.pending is None else self.pending.tokens.shape[0]
        keep = [i for i, s in enumerate(self.seqs) if id(s) not in gone]
        keep_pending = [i for i in keep if i < n_current]
        self.fresh = [self.fresh[i - n_current] for i in keep if i >= n_current]
        self.seqs = [self.seqs[i] for i in keep]
        if self.states is not None:
            self.states.keep(keep)
        if self.read is not None:
            self.read = [self.read[i] for i in keep_pending] if keep_pending else None
        if self.pending is not None:
            if not keep_pending:
                self.pending = None
            elif len(keep_pending) < n_current:
                idx = mx.array(keep_pending)
                p = self.pending
                self.pending = SampledStep(
                    p.tokens[idx],
                    None if p.logprobs is None else p.logprobs[idx],
                    None if p.top_ids is None else p.top_ids[idx],
                    None if p.top_logprobs is None else p.top_logprobs[idx],
                )
        self.sampler = BatchSampler([s.request.sampling for s in self.seqs])
        if self.speculator is not None:
            for seq in leaving:
                self.speculator.forget(seq)


def _verified_logprob(v: Verified, j: int, seq: Sequence) -> TokenLogprob | None:
    sp = seq.request.sampling
    if not sp.logprobs or v.logprobs is None:
        return None
    top: tuple[tuple[int, float], ...] = ()
    if v.top_ids is not None and v.top_logprobs is not None and sp.top_logprobs > 0:
        top = tuple(zip(v.top_ids[j][: sp.top_logprobs], v.top_logprobs[j][: sp.top_logprobs], strict=True))
    return TokenLogprob(v.tokens[j], v.logprobs[j], top)


def _host_step(rows: list[tuple[Verified, int]]) -> SampledStep:
    """The rows' pending tokens after a verification (each row's position `n`), as the
    step a later one reads."""
    tokens = mx.array([v.tokens[n] for v, n in rows], dtype=mx.uint32)
    first = rows[0][0]
    logprobs = None if first.logprobs is None else mx.array([v.logprobs[n] for v, n in rows if v.logprobs])
    top_ids = top_lp = None
    if first.top_ids is not None:
        top_ids = mx.array([v.top_ids[n] for v, n in rows if v.top_ids])
        top_lp = mx.array([v.top_logprobs[n] for v, n in rows if v.top_logprobs])
    return SampledStep(tokens, logprobs, top_ids, top_lp)


def _batches(rows: list[PrefillRow], size: int) -> list[list[PrefillRow]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def _read_logprobs(step: SampledStep, seqs: list[Sequence]) -> list[TokenLogprob | None]:
    if step.logprobs is None:
        return []
    tokens = step.tokens.tolist()
    chosen = step.logprobs.tolist()
    top_ids = step.top_ids.tolist() if step.top_ids is not None else None
    top_lp = step.top_logprobs.tolist() if step.top_logprobs is not None else None
    out: list[TokenLogprob | None] = []
    for i, seq in enumerate(seqs):
        sp = seq.request.sampling
        if not sp.logprobs:
            out.append(None)
            continue
        top: tuple[tuple[int, float], ...] = ()
        if top_ids is not None and top_lp is not None and sp.top_logprobs > 0:
            top = tuple(zip(top_ids[i][: sp.top_logprobs], top_lp[i][: sp.top_logprobs], strict=True))
        out.append(TokenLogprob(tokens[i], chosen[i], top))
    return out
