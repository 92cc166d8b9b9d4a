"""Keeping the loaded models' weights resident on Metal: `mx.set_wired_limit`.

Without it, macOS may page a model's weights out while the server idles, and the first
token after an idle minute waits for them (mlx-lm's server sets the limit to the whole
recommended working set for the same reason). MLX keeps every Metal buffer it allocates in
a residency set and wires buffers, in no chosen order, until their sizes reach the limit
(`ResidencySet::insert` / `resize` in MLX's `backend/metal/resident.cpp`; macOS 15+). So
the limit is set to the weights' bytes right after a load, when the weights are what is
allocated, and lowered again when a model unloads and at shutdown.

The weights only: wiring the whole working set would pin KV buffers too, and near the
wired limit users of MLX have reported kernel panics. The weights are wired only when the
guard has room for them: at most `WORKING_SET_SHARE` of MLX's recommended working set and
under the guard's hard ceiling. On Linux and CUDA `mx.set_wired_limit` is a no-op, and
the recommended working set is not reported, so nothing is wired there.

One limit per process, the sum over the loaded models (`WiredWeights`); the setter and
the device's figure are injectable, so the decisions are tested without a Mac. When a model
unloads, the others' weights are wired again under the same check as at their load: the
guard's ceiling may have fallen since, and a limit above it would let MLX wire KV buffers
the guard never promised room for. `/v1/memory`, `/metrics` and `doctor` report the limit
(`reported_limit_bytes`): null where setting it is a no-op, so "0, nothing wired" on a Mac
is not confused with "cannot wire" on Linux.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("mlx_headroom.engine")

WORKING_SET_SHARE = 0.9  # mlx-lm warns above 90 % of the recommended working set too


@dataclass(frozen=True)
class WiredDecision:
    limit_bytes: int  # the wired limit to set (0: nothing wired)
    reason: str


def decide_wired_limit(weight_bytes: int, *, working_set: int | None,
                       ceiling: int | None) -> WiredDecision:
    """How much to wire for `weight_bytes` of loaded weights (pure)."""
    mib = 1 << 20
    if weight_bytes <= 0:
        return WiredDecision(0, "no weights loaded")
    if not working_set:
        return WiredDecision(0, "the device reports no recommended working set (not Metal): "
                             "nothing to wire")
    if weight_bytes > WORKING_SET_SHARE * working_set:
        return WiredDecision(0, f"weights {weight_bytes // mib} MiB exceed "
                             f"{WORKING_SET_SHARE:.0%} of the recommended working set "
                             f"({working_set // mib} MiB): not wired")
    if ceiling is not None and weight_bytes > ceiling:
        return WiredDecision(0, f"weights {weight_bytes // mib} MiB exceed the guard's ceiling "
                             f"({ceiling // mib} MiB): not wired")
    return WiredDecision(weight_bytes, f"wired the weights, {weight_bytes // mib} MiB")


def _mx_set_wired_limit(limit: int) -> int:
    import mlx.core as mx

    return int(mx.set_wired_limit(limit))


def _mx_working_set() -> int | None:
    import mlx.core as mx

    if not mx.metal.is_available():
        return None
    value = dict(mx.device_info(mx.gpu)).get("max_recommended_working_set_size")
    return int(value) if value else None


class WiredWeights:
    """The process's wired limit: the loaded models' weights, summed, when there is room."""

    def __init__(self, *, setter: Callable[[int], int] = _mx_set_wired_limit,
                 working_set: Callable[[], int | None] = _mx_working_set) -> None:
        self._setter = setter
        self._working_set = working_set
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()
        self.limit_bytes = 0  # what this process set (counted in its stats)
        self.sets = 0  # calls to the setter

    def hold(self, key: str, weight_bytes: int, *, ceiling: int | None) -> WiredDecision:
        """A model's weights are loaded: wire them with the others' when there is room."""
        with self._lock:
            self._held[key] = weight_bytes
            return self._apply(ceiling)

    def release(self, key: str, *, ceiling: int | None) -> WiredDecision:
        """A model unloads (or the server shuts down): stop wiring its weights. The models
        that stay are wired again only when there is room under `ceiling` now (the guard's
        hard ceiling; None while the guard is off), the check `hold` made at their load."""
        with self._lock:
            self._held.pop(key, None)
            return self._apply(ceiling)

    def reported_limit_bytes(self) -> int | None:
        """The wired limit this process set, for reports; None where `mx.set_wired_limit`
        is a no-op (the device reports no recommended working set: Linux, CUDA)."""
        return self.limit_bytes if self._working_set() else None

    def _apply(self, ceiling: int | None) -> WiredDecision:
        decision = decide_wired_limit(sum(self._held.values()), working_set=self._working_set(),
                                      ceiling=ceiling)
        if decision.limit_bytes != self.limit_bytes:
            try:
                self._setter(decision.limit_bytes)
            except (RuntimeError, ValueError) as exc:  # e.g. above the system's wired limit
                log.warning("mx.set_wired_limit(%d) failed: %s", decision.limit_bytes, exc)
                return WiredDecision(self.limit_bytes, f"mx.set_wired_limit failed: {exc}")
            self.sets += 1
            self.limit_bytes = decision.limit_bytes
            log.info("wired limit: %s", decision.reason,
                     extra={"wired_limit_bytes": decision.limit_bytes})
        return decision


WIRED = WiredWeights()  # one per process: MLX's wired limit is process-wide
