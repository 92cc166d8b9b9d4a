"""The model calls of the dense path: mlx-lm's semantics, the paged runner's interface.

Prefill runs each request's chunk through the model with the request's own caches, one
request per call, exactly as mlx-lm's `generate_step` does; prompts that begin in the same
step share a call, right-padded, as mlx-lm's `BatchGenerator` prefills them. A request joins the decode
batch with no model call of its own (its last prompt token is its input in the next
step), as in the paged runner. A decode step is one model call over the merged batch
caches (`DenseStore.batch`), or, where a cache kind cannot merge, one call per row whose
logits are stacked. Sampling is the paged runner's: one `BatchSampler` call on the
step's [B, vocab] logits, per-row parameters, logits processors fed back before their
row's next sample.

Decode is pipelined as mlx-lm pipelines it: step n+1 is queued before step n's tokens
are read.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from typing import Any

import mlx.core as mx

from engine.dense.prefix import DensePrefixCache
from engine.dense.store import DenseStore, merge_caches
from engine.prompt_scoring import score_chunk
from engine.runner import ReadsEarly, StepToken, step_tokens
from engine.sampling import BatchSampler, SampledStep
from engine.sequence import Sequence


class DenseRunner(ReadsEarly):
    compiled = None  # no traced decode steps here
    slice_choice = None
    slice_decode = False

    def __init__(self, model: Any, store: DenseStore, prefix: DensePrefixCache | None = None, *,
                 prefill_batch: int = 8) -> None:
        self.model = model
        self.prefill_batch = prefill_batch  # most prompts in one call (1: one per call)
        self.store = store
        self.prefix = prefix  # where checkpoints taken during prefill go
        self.seqs: list[Sequence] = []  # the batch; rows [0, len(pending)) have a token in flight
        self.pending: SampledStep | None = None
        self.read: list[int] | None = None  # `pending`'s tokens, read and handed out early
        self.fresh: list[int] = []  # last prompt token of each row that joined since the last step
        self.sampler = BatchSampler([])
        self.force_slice: bool | None = None  # the warm-up sets it; nothing to slice here
        self.max_batch_seen = 0
        self.sliced_steps = 0
        self.decode_wait_s = 0.0
        self.prefill_wait_s = 0.0
        self.queue_s = 0.0
        self.settle_s = 0.0  # waiting for a queued decode step (settle)
        self.agree: Any = None  # tensor parallel's token agreement (engine.distributed)

    def __len__(self) -> int:
        return len(self.seqs)

    # ---- prefill ---------------------------------------------------------------------
    def _prefill(self, chunks: Seq[tuple[Sequence, int]]) -> int:
        """Run each request's next `tokens` prompt tokens into its own caches (a request
        scoring its prompt reads the call's logits, as in the paged runner). Prompts that
        begin here run together in one call (`_prefill_together`); the others one request
        per call. A chunk that crosses a checkpoint boundary of the prefix cache
        (`engine.dense.prefix`) runs as two calls, and the caches are snapshotted between
        them. Returns the number of model calls made."""
        together = [(s, n) for s, n in chunks if self._starts_here(s, n)] if self.prefill_batch > 1 else []
        parts = [together[i : i + self.prefill_batch] for i in range(0, len(together), self.prefill_batch)]
        shared = [part for part in parts if len(part) > 1]  # a lone one runs as any other chunk
        for part in shared:
            self._prefill_together(part)
        ran = {id(s) for part in shared for s, _ in part}
        calls = len(shared)
        for seq, tokens in (c for c in chunks if id(c[0]) not in ran):
            start = self.store.get(seq.request_id).length
            end = start + tokens
            while start < end:  # a chunk ends on each checkpoint boundary it crosses
                cut = None if self.prefix is None else self.prefix.checkpoint_at(start, end)
                stop = end if cut is None else cut
                self._prefill_piece(seq, start, stop - start)
                calls += 1
                start = stop
                self._keep_checkpoint(seq, stop)
        return calls

    def _keep_checkpoint(self, seq: Sequence, tokens: int) -> None:
        """Snapshot the request's caches into the prefix cache where `tokens` is one of its
        checkpoints (the prompt's end is snapshotted when the request joins the batch)."""
        if self.prefix is not None and self.prefix.keeps_checkpoint(tokens, seq.prompt_len):
            hold = self.store.hold_prefix(seq.request_id, tokens)
            if hold is not None:
                self.prefix.insert(seq.request.prompt_tokens[:tokens], hold)

    def _starts_here(self, seq: Sequence, tokens: int) -> bool:
        """A chunk that may share a call: its prompt's first, into fresh caches that merge,
        read by no scorer, crossing no checkpoint boundary."""
        alloc = self.store.get(seq.request_id)
        return (self.store.batches_prefill and alloc.length == 0 and not seq.scores_prompt
                and (self.prefix is None or self.prefix.checkpoint_at(0, tokens) is None))

    def _prefill_together(self, rows: Seq[tuple[Sequence, int]]) -> None:
        """First chunks of several prompts in one call, as mlx-lm's `BatchGenerator` runs
        them: the requests' fresh caches merged, rows right-padded to the longest (the
        caches told by `prepare`, and the padding moved to the left by `finalize`), then
        each row extracted back into caches of its own."""
        allocs = [self.store.get(seq.request_id) for seq, _ in rows]
        merged = merge_caches([a.caches for a in allocs])
        lengths = [n for _, n in rows]
        width = max(lengths)
        padding = [width - n for n in lengths]
        inputs = mx.array([list(seq.request.prompt_tokens[:n]) + [0] * (width - n) for seq, n in rows])
        if any(padding):
            for c in merged:
                c.prepare(lengths=lengths, right_padding=padding)
        self.model(inputs, cache=merged)
        started = time.perf_counter()
        self.settle()  # as in `_prefill_piece`: the queued decode step's time is not the prefill's
        if any(padding):
            for c in merged:
                c.finalize()
        for i, alloc in enumerate(allocs):
            alloc.caches = [c.extract(i) for c in merged]
        mx.eval([c.state for alloc in allocs for c in alloc.caches])
        self.prefill_wait_s += time.perf_counter() - started
        for seq, n in rows:
            self.store.advance(seq.request_id, n)
            self._keep_checkpoint(seq, n)

    def _prefill_piece(self, seq: Sequence, start: int, tokens: int) -> None:
        caches = self.store.get(seq.request_id).caches
        assert caches is not None, "a request that joined the batch does not prefill"
        prompt = seq.request.prompt_tokens
        logits = self.model(mx.array(prompt[start : start + tokens])[None], cache=caches)
        started = time.perf_counter()
        # The queued decode step runs first anyway (one stream): waiting for it here
        # keeps its time out of the prefill's, which the step budget measures.
        self.settle()
        if seq.scores_prompt:  # logits at position j: the logprob of prompt token j + 1
            following = prompt[start + 1 : start + 1 + tokens]
            seq.prompt_logprobs.extend(
                score_chunk(logits[0], following, seq.request.prompt_logprobs or 0)
            )
        mx.eval([c.state for c in caches])
        self.prefill_wait_s += time.perf_counter() - started
        self.store.advance(seq.request_id, tokens)

    # ---- the batch -------------------------------------------------------------------
    def join(self, seq: Sequence) -> None:
        self.store.join(seq.request_id)
        self.seqs.append(seq)
        self.fresh.append(seq.request.prompt_tokens[-1])
        self.sampler = BatchSampler([s.request.sampling for s in self.seqs])
        self.max_batch_seen = max(self.max_batch_seen, len(self.seqs))

    def step(self) -> list[StepToken]:
        """Queue this step's forward and sampling, then read back the previous step's tokens."""
        if not self.seqs:
            return []
        current = self.pending
        n_current = 0 if current is None else current.tokens.shape[0]
        inputs = self._inputs(current)
        logits = self._forward(inputs)
        out = n_current if self.read is None else 0  # rows whose pending token is not out yet
        steps = [s.generated + (1 if i < out else 0) for i, s in enumerate(self.seqs)]
        for s in self.seqs:
            self.store.advance(s.request_id, 1)
        self.fresh = []
        feedback = self.sampler.needs_feedback  # the rows' processors see the tokens first
        tokens, handed_out = self._take(current) if current is not None and feedback else ([], False)
        if feedback:
            self.sampler.accept(tokens)
        self.pending = self._sample(logits, steps)
        self._queue(self.pending)
        if current is None:
            return []
        if not feedback:
            tokens, handed_out = self._take(current)
        return [] if handed_out else step_tokens(current, self.seqs, tokens)

    def _forward(self, inputs: mx.array) -> mx.array:
        store = self.store
        batch = store.merged_batch()
        if batch is not None:
            return self.model(inputs[:, None], cache=batch)[:, -1, :]
        rows = []
        for i, request_id in enumerate(store.rows):  # caches that cannot merge: row by row
            caches = store.get(request_id).caches
            rows.append(self.model(inputs[i : i + 1, None], cache=caches)[:, -1, :])
        return mx.concatenate(rows, axis=0)

    def _sample(self, logits: mx.array, steps: list[int]) -> SampledStep:
        step = self.sampler.sample(logits, steps)
        return step if self.agree is None else self.agree(step)

    def _queue(self, step: SampledStep) -> None:
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
        """Rows leave: their batch rows are filtered out of the merged caches."""
        if not leaving:
            return
        gone = {id(s) for s in leaving}
        n_current = 0 if self.pending is None else self.pending.tokens.shape[0]
        keep = [i for i, s in enumerate(self.seqs) if id(s) not in gone]
        keep_pending = [i for i in keep if i < n_current]
        self.fresh = [self.fresh[i - n_current] for i in keep if i >= n_current]
        self.store.leave([s.request_id for s in self.seqs if id(s) in gone])
        self.seqs = [self.seqs[i] for i in keep]
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
