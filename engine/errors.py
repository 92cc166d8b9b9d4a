"""Errors the engine reports to its callers.

    EngineError
    ├── EngineDeadError          fatal: the engine thread is gone; nothing will be served
    ├── EngineStepError          a step raised: its requests fail (HTTP 500), the rest go on
    ├── QueueFullError           recoverable: too many requests waiting; retry later
    ├── ContextLengthError       the prompt plus max_tokens does not fit the model's context
    ├── InsufficientMemoryError  the memory guard refused the request (HTTP 507)
    └── MemoryProbeUnavailableError  recoverable: no memory reading to admit on (HTTP 503)
"""

from __future__ import annotations

from typing import Any


class EngineError(Exception):
    pass


class EngineDeadError(EngineError):
    pass


class EngineStepError(EngineError):
    """A prefill or decode step raised something other than a device out-of-memory. The
    requests of that step fail with the cause; the engine keeps serving the others."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(
            f"the engine failed while running this request ({type(cause).__name__}: {cause}); "
            "other requests are unaffected"
        )
        self.cause = cause


class QueueFullError(EngineError):
    def __init__(self, waiting: int, limit: int) -> None:
        super().__init__(f"the waiting queue is full ({waiting} of {limit}); retry shortly")
        self.waiting = waiting
        self.limit = limit


class ContextLengthError(EngineError):
    def __init__(self, requested: int, limit: int) -> None:
        super().__init__(
            f"this model's maximum context length is {limit} tokens, but {requested} were "
            "requested (prompt plus max_tokens); shorten the prompt or lower max_tokens"
        )
        self.requested = requested
        self.limit = limit


class InsufficientMemoryError(EngineError):
    """Carries the memory guard's decision so the server can explain the refusal exactly.

    `retryable` is True when the request could fit once other work finishes (the wait
    timed out), False when it can never fit under the current ceiling.
    """

    def __init__(
        self,
        message: str,
        *,
        code: str,
        estimated_bytes: int,
        limit_bytes: int,
        binding: str,
        retryable: bool,
        retry_after_s: int = 5,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.estimated_bytes = estimated_bytes
        self.limit_bytes = limit_bytes
        self.binding = binding
        self.retryable = retryable
        self.retry_after_s = retry_after_s

    def details(self) -> dict[str, Any]:
        return {
            "estimated_bytes": self.estimated_bytes,
            "limit_bytes": self.limit_bytes,
            "binding": self.binding,
        }


class MemoryProbeUnavailableError(EngineError):
    """The memory probe has failed past its grace period, so nothing can be admitted
    safely. Temporary by nature: the client retries after ``retry_after_s``."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
