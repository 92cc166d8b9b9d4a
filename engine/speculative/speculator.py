"""Which rows draft, how many tokens, and the counters: the runner asks, runs the
verification (`engine.speculative.verify`), and reports back what was accepted."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sequence import Sequence
from engine.speculative.draft import DraftModel
from engine.speculative.lookup import MAX_NGRAM, MIN_NGRAM, NgramIndex

METHODS = ("off", "prompt-lookup", "draft-model")
DEFAULT_TOKENS = 4
# Above this many rows decoding is compute-bound and verifying k extra tokens per row costs
# more than the steps it saves: speculation turns itself off. CUDA: vLLM's rule of thumb;
# the CPU: measured (docs/throughput.md, speculative decoding); Metal: unmeasured.
MAX_ROWS = {"cuda": 8, "cpu": 2, "metal": 4}
# A row whose drafts were all rejected n verifications in a row drafts again only after
# min(2^n - 1, MAX_BACKOFF) steps: a failed verification cost 1.3x an ordinary step at
# batch 1 on the H200 (docs/speculative-decoding.md), so text that does not echo stops paying it.
MAX_BACKOFF = 15


def default_max_rows(backend: str) -> int:
    return MAX_ROWS.get(backend, 4)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "off"  # off | prompt-lookup | draft-model
    num_tokens: int = DEFAULT_TOKENS  # drafts per row and step, at most
    max_rows: int | None = None  # speculate only while the batch has at most this many rows; None: by backend
    min_ngram: int = MIN_NGRAM
    max_ngram: int = MAX_NGRAM
    draft_model: str | None = None  # the draft-model method's model: a path, a hub id or a name
    draft_dtype: str | None = None  # a dummy draft's dtype (--load-format dummy), as the target's

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r}: one of {', '.join(METHODS)}")
        if (self.method == "draft-model") != (self.draft_model is not None):
            raise ValueError("--draft-model and --speculative draft-model go together")
        if self.num_tokens < 1:
            raise ValueError("--num-speculative-tokens must be at least 1")

    @property
    def on(self) -> bool:
        return self.method != "off"


@dataclass
class _Row:
    index: NgramIndex
    seen: int = 0  # of the sequence's outputs, how many the index holds
    misses: int = 0  # verifications in a row that accepted nothing
    wait: int = 0  # steps to go before it drafts again


class Speculator:
    def __init__(self, config: SpeculativeConfig, backend: str, draft: DraftModel | None = None) -> None:
        if (config.method == "draft-model") != (draft is not None):
            raise ValueError("the draft-model method drafts from a loaded draft model, and only it")
        self.config = config
        self.draft = draft
        self.max_rows = config.max_rows if config.max_rows is not None else default_max_rows(backend)
        self._rows: dict[str, _Row] = {}
        self.steps = 0  # decode steps that verified drafts
        self.rows = 0  # rows verified in them (a row with drafts, one step)
        self.drafted = 0
        self.accepted = 0
        self.skipped_steps = 0  # steps with few enough rows where no row found a draft
        self.backed_off = 0  # row steps without a draft because the row's last ones failed

    def active(self, rows: int) -> bool:
        return rows <= self.max_rows

    def propose(self, seq: Sequence, last: int | None, room: int) -> tuple[int, ...]:
        """Drafts for `seq`, whose text is its prompt, its outputs, then `last` (its next
        input, when it is not the prompt's last token); at most `room` of them. Rows with a
        logits processor (grammar, penalties) never draft: it must see every token first."""
        k = min(self.config.num_tokens, room)
        if k <= 0 or seq.request.sampling.processor is not None:
            return ()
        row = self._rows.get(seq.request_id)
        if row is None:
            row = _Row(NgramIndex(seq.request.prompt_tokens, min_ngram=self.config.min_ngram,
                                  max_ngram=self.config.max_ngram))
            self._rows[seq.request_id] = row
        if row.seen < len(seq.outputs):
            row.index.extend(seq.outputs[row.seen :])
            row.seen = len(seq.outputs)
        if row.wait:
            row.wait -= 1
            self.backed_off += 1
            return ()
        if self.draft is not None:
            text = row.index.tokens + ([last] if last is not None else [])
            return self.draft.propose(seq.request_id, text, k)
        return row.index.propose(k, last)

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        self.rows += 1
        self.drafted += drafted
        self.accepted += accepted
        seq.drafted += drafted
        seq.accepted += accepted
        row = self._rows[seq.request_id]
        row.misses = 0 if accepted else row.misses + 1
        row.wait = min((1 << row.misses) - 1, MAX_BACKOFF)

    def forget(self, seq: Sequence) -> None:
        self._rows.pop(seq.request_id, None)
        if self.draft is not None:
            self.draft.forget(seq.request_id)

    def report(self) -> dict[str, object]:
        return {
            "method": self.config.method,
            "num_tokens": self.config.num_tokens,
            "max_rows": self.max_rows,
            "steps": self.steps,
            "rows_verified": self.rows,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "backed_off_row_steps": self.backed_off,
            **({"draft_model": self.draft.model_id, "draft_cache_bytes": self.draft.cache_bytes()}
               if self.draft is not None else {}),
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
            # tokens a verified row emitted in its step: the accepted drafts and the target's own
            "tokens_per_verified_row": (
                round((self.accepted + self.rows) / self.rows, 4) if self.rows else None
            ),
        }
