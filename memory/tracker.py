"""Learns how many transient bytes per token a prefill chunk really takes.

The static estimate is a bound derived from shapes; the tracker corrects it with what the
engine measures (``mx.get_peak_memory()`` delta per chunk). An exponentially weighted
average smooths noise; one wild measurement (another thread allocating, a cache flush) is
rejected as an outlier once the average has settled, so it cannot poison predictions.
"""

from __future__ import annotations

import math
import threading

DEFAULT_MARGIN = 1.2  # predictions are the best estimate × this; memory/fit.py uses it too


class TransientTracker:
    """Thread-safe EWMA of measured bytes per prefill token."""

    WARMUP = 3  # observations accepted unconditionally before outlier rejection starts

    def __init__(
        self, alpha: float = 0.3, margin: float = DEFAULT_MARGIN, outlier_factor: float = 4.0
    ) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        if margin < 1.0:
            raise ValueError("margin must be >= 1")
        if outlier_factor <= 1.0:
            raise ValueError("outlier_factor must be > 1")
        self._alpha = alpha
        self._margin = margin
        self._outlier_factor = outlier_factor
        self._lock = threading.Lock()
        self._ewma: float | None = None
        self._latest: float | None = None
        self._observations = 0
        self._outliers = 0

    def observe(self, chunk_tokens: int, measured_bytes: int) -> None:
        """Record one chunk's measured peak delta. Non-positive chunks are ignored."""
        if chunk_tokens <= 0:
            return
        per_token = max(0, measured_bytes) / chunk_tokens
        with self._lock:
            if (
                self._ewma is not None
                and self._observations >= self.WARMUP
                and per_token > self._outlier_factor * self._ewma
            ):
                self._outliers += 1
                return
            if self._ewma is None:
                self._ewma = per_token
            else:
                self._ewma = self._alpha * per_token + (1.0 - self._alpha) * self._ewma
            self._latest = per_token
            self._observations += 1

    def predict(self, chunk_tokens: int, static_estimate_bytes: int) -> int:
        """max(static estimate, latest per-token × C, EWMA × C) × margin, rounded up."""
        with self._lock:
            latest, ewma = self._latest, self._ewma
        best = float(static_estimate_bytes)
        if latest is not None:
            best = max(best, latest * chunk_tokens)
        if ewma is not None:
            best = max(best, ewma * chunk_tokens)
        return math.ceil(best * self._margin)

    def reset(self) -> None:
        """Forget everything (e.g. after the model changes)."""
        with self._lock:
            self._ewma = None
            self._latest = None
            self._observations = 0
            self._outliers = 0

    @property
    def ewma_bytes_per_token(self) -> float | None:
        with self._lock:
            return self._ewma

    @property
    def latest_bytes_per_token(self) -> float | None:
        with self._lock:
            return self._latest

    @property
    def observations(self) -> int:
        """Accepted observations (outliers excluded)."""
        with self._lock:
            return self._observations

    @property
    def outliers(self) -> int:
        with self._lock:
            return self._outliers
