"""The engine thread's mutable state for one request."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv import SharedPrefix
from engine.prefix import ChainKey
from engine.request import EngineRequest, RequestStatus, TokenLogprob


@dataclass(eq=False)
class Sequence:
    request: EngineRequest
    status: RequestStatus = RequestStatus.WAITING
    looked_up: bool = False  # the prefix cache was asked (once per admission attempt)
    shared: SharedPrefix | None = None  # blocks a prefix-cache hit lends this request
    has_kv: bool = False  # holds a reservation in the engine's KV store
    processed: int = 0  # prompt tokens already in the KV cache
    cached_tokens: int = 0  # of those, how many came from the prefix cache
    prefix_key: ChainKey | None = None  # the prefix-cache block its hit ends in
    chain: list[ChainKey] = field(default_factory=list)  # its prompt's block digests, as looked up
    disk_blocks: tuple[tuple[ChainKey, ChainKey, tuple[int, ...]], ...] = ()  # a hit's, to read back
    generated: int = 0
    decode_steps: int = 0  # decode steps it took part in; a verified step counts once
    drafted: int = 0  # speculative drafts proposed for it, and accepted of those
    accepted: int = 0
    outputs: list[int] = field(default_factory=list)  # the tokens generated
    wait_since: float | None = None  # when admission first said WAIT
    chunk_tokens: int = 0  # current prefill chunk size (shrinks under memory pressure)
    passed_over: int = 0  # steps in which others prefilled and it did not (engine.step_budget.prefill_order)
    aborted: bool = field(default=False)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # scored so far

    @property
    def scores_prompt(self) -> bool:
        return self.request.prompt_logprobs is not None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_tokens)

    @property
    def final_len(self) -> int:
        """Tokens the KV cache holds when this request ends, at most."""
        return self.prompt_len + self.request.max_tokens

    @property
    def remaining_prefill(self) -> int:
        """Prompt tokens still to run before the last one (which starts decoding)."""
        return max(self.prompt_len - 1 - self.processed, 0)
