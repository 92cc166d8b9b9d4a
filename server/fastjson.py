"""JSON encoding on the streaming hot path: one call per SSE chunk, per token, per stream.

`orjson` encodes straight to UTF-8 bytes, several times faster than `json.dumps` plus
`.encode()`, and it runs on the asyncio thread, which shares the GIL with the engine
thread: every microsecond here is one the engine's step cannot use. Output is compact
JSON with non-ASCII characters as UTF-8 (valid JSON either way). Non-finite floats
(a logprob of -inf for a token a grammar forbids) become null, where `json.dumps` would
write the invalid `-Infinity`. Where orjson is not installed (a hand-staged machine), the
standard library's encoder stands in, compact; it also writes what orjson refuses (an
integer beyond 64 bits that a client sent and a response echoes).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is a dependency; this keeps a bare box serving
    orjson = None  # type: ignore[assignment]


# Characters that JSON allows raw but that `str.splitlines()` (and so many SSE clients that
# split a stream with it) takes for line ends: written escaped, an event stays one line.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def dumps(obj: Any) -> bytes:
    out = None
    if orjson is not None:
        # an integer beyond 64 bits echoed from a request is a TypeError: json can write it
        with contextlib.suppress(TypeError):
            out = orjson.dumps(obj)
    if out is None:
        out = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    for raw, escaped in _LINE_BREAKS:
        if raw in out:
            out = out.replace(raw, escaped)
    return out
