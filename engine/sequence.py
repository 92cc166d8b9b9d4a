"""The engine thread's mutable state for one request."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlx_lm.models.cache import KVCache

from engine.prefix_cache import TokenKey
from engine.request import EngineRequest, RequestStatus


@dataclass(eq=False)
class Sequence:
    request: EngineRequest
    status: RequestStatus = RequestStatus.WAITING
    caches: list[KVCache] | None = None  # the request's own KV while it prefills
    processed: int = 0  # prompt tokens already in the KV cache
    cached_tokens: int = 0  # of those, how many came from the prefix cache
    prefix_key: TokenKey | None = None
    generated: int = 0
    wait_since: float | None = None  # when admission first said WAIT
    chunk_tokens: int = 0  # current prefill chunk size (shrinks under memory pressure)
    aborted: bool = field(default=False)

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

    def kv_nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches) if self.caches else 0
