"""Values that cross the boundary between the HTTP side and the engine thread."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from engine.logits_processor import LogitsProcessor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Per-request mutable state (grammar, penalties); None costs the sampler nothing.
    # Each engine request needs its own: never share one between requests.
    processor: LogitsProcessor | None = field(default=None, compare=False)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def truncates(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0


@dataclass(frozen=True)
class EngineRequest:
    """One sequence to generate. The engine never sees text, only token ids."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    arrival: float = 0.0
    # Score the prompt (engine.prompt_scoring): None, no; N, each prompt token's logprob and
    # its N most likely alternatives.
    prompt_logprobs: int | None = None


class RequestStatus(IntEnum):
    """Ordered so that `status >= FINISHED_STOPPED` means finished."""

    WAITING = 0
    PREFILLING = 1
    RUNNING = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_REJECTED = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_REJECTED: "rejected",
}


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Speculation:
    drafted_tokens: int
    accepted_tokens: int
    decode_steps: int


@dataclass(frozen=True)
class RequestOutput:
    """What one engine step produced for one request: new tokens and, at the end, why."""

    request_id: str
    new_tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    cached_tokens: int = 0
    error: Exception | None = None
    # At the end, where speculative decoding drafted for it: drafts proposed and accepted,
    # and the decode steps its output took.
    speculation: Speculation | None = None
    # Once, when the prompt is prefilled, for a request that asked: one entry per prompt
    # token, None for the first (nothing precedes it).
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()
