"""Run MLX work that builds arrays on a thread of its own, released before it ends.

MLX keeps each thread's random key in a C++ thread-local whose destructor takes the GIL.
Building a model (its layers' random initialisers) on a pooled worker thread leaves that
key behind; the worker is joined at exit, but its thread-locals are destroyed after
`join()` returns, so the destructor can race the interpreter's finalization and abort the
process ("terminate called without an active exception", exit 134). A short-lived thread
that calls `mx.clear_streams()` before it ends leaves nothing behind, and the caller's own
streams (the engine thread's, the event loop's) are never touched."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import mlx.core as mx

T = TypeVar("T")


def run_released(fn: Callable[[], T]) -> T:
    """``fn()`` on a new thread whose MLX state is dropped before it ends."""
    result: list[T] = []
    error: list[BaseException] = []

    def main() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # handed to the caller as it is
            error.append(exc)
        finally:
            mx.clear_streams()

    thread = threading.Thread(target=main, name="mlx-headroom-probe")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
