"""Small messages between the ranks, carried by MLX's own collectives (never a socket of ours).

Everything the ranks exchange outside the model's own `all_sum`s is JSON, packed into int32
words (every backend reduces int32: ring, JACCL and NCCL), because a collective moves arrays
of one fixed shape on every rank:

- `gather`: every rank contributes one row (its memory reading, its state digest, and on
  rank 0 the step plan), `all_gather`ed in one collective per step;
- `broadcast`: rank 0's message, the others contribute zeros and an `all_sum` hands every
  rank rank 0's words: used for a plan too long for a row and for each admission decision.

Each completed collective is a heartbeat for the watchdog: a collective that never
returns (a peer that hangs rather than dies) is what it exists for.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

TRACE = bool(os.environ.get("MLX_HEADROOM_TP_TRACE"))  # every message on stderr: for debugging
ROW_WORDS = 1024  # 4 KiB per rank per step: a reading, a digest and a short plan
HEADER_WORDS = 1  # the payload's length in bytes


class ChannelError(RuntimeError):
    """A message could not be carried (too long for its slot, or undecodable)."""


def _pack(obj: Any, words: int) -> mx.array:
    data = json.dumps(obj, separators=(",", ":")).encode()
    capacity = (words - HEADER_WORDS) * 4
    if len(data) > capacity:
        raise ChannelError(f"message of {len(data)} bytes does not fit {capacity}")
    buf = np.zeros(words, dtype=np.int32)
    buf[0] = len(data)
    padded = data + b"\0" * (-len(data) % 4)
    buf[HEADER_WORDS : HEADER_WORDS + len(padded) // 4] = np.frombuffer(padded, dtype=np.int32)
    return mx.array(buf)


def _unpack(words: np.ndarray) -> Any:
    n = int(words[0])
    if n < 0 or n > (len(words) - HEADER_WORDS) * 4:
        raise ChannelError(f"corrupt message header ({n} bytes)")
    data = np.ascontiguousarray(words[HEADER_WORDS:]).tobytes()[:n]
    return json.loads(data.decode())


def words_for(obj: Any) -> int:
    """Words a message needs: its JSON in 4-byte words, plus the header."""
    return HEADER_WORDS + -(-len(json.dumps(obj, separators=(",", ":")).encode()) // 4)


class Channel:
    def __init__(self, group: mx.distributed.Group, beat: Callable[[], None] = lambda: None) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self._beat = beat
        self.collectives = 0

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank (one `all_gather`)."""
        if TRACE:
            print(f"[tp {self.rank}] gather #{self.collectives} {obj}", file=sys.stderr, flush=True)
        rows = mx.distributed.all_gather(_pack(obj, ROW_WORDS), group=self.group)
        out = np.array(rows).reshape(self.size, ROW_WORDS)
        self._done()
        return [_unpack(row) for row in out]

    def broadcast(self, obj: Any, words: int) -> Any:
        """Rank 0's `obj` on every rank (`obj` is ignored elsewhere); every rank must pass
        the same `words` (rank 0 announces it first, e.g. in its gathered row)."""
        if TRACE:
            print(f"[tp {self.rank}] broadcast #{self.collectives} {obj}", file=sys.stderr, flush=True)
        mine = _pack(obj, words) if self.rank == 0 else mx.zeros((words,), dtype=mx.int32)
        total = mx.distributed.all_sum(mine, group=self.group)
        out = np.array(total)
        self._done()
        return _unpack(out)

    def _done(self) -> None:
        self.collectives += 1
        self._beat()
