from __future__ import annotations

import math
import threading

import pytest

from memory import TransientTracker


def test_empty_tracker_uses_static_estimate_with_margin() -> None:
    t = TransientTracker(margin=1.2)
    assert t.ewma_bytes_per_token is None
    assert t.predict(100, 1000) == 1200
    assert (t.observations, t.outliers) == (0, 0)


def test_ewma_math() -> None:
    t = TransientTracker(alpha=0.5, margin=1.0)
    t.observe(10, 1000)  # 100 B/token: the first value seeds the average
    assert t.ewma_bytes_per_token == 100
    t.observe(10, 2000)  # 200: 0.5·200 + 0.5·100
    assert t.ewma_bytes_per_token == 150
    t.observe(20, 1000)  # 50: 0.5·50 + 0.5·150
    assert t.ewma_bytes_per_token == 100
    assert t.observations == 3


def test_predict_takes_max_of_static_latest_and_ewma_times_margin() -> None:
    t = TransientTracker(alpha=0.5, margin=1.5)
    t.observe(10, 1000)  # 100
    t.observe(10, 3000)  # latest 300, ewma 200
    assert t.predict(10, 0) == math.ceil(300 * 10 * 1.5)  # latest wins
    assert t.predict(10, 10_000) == 15_000  # static wins
    t.observe(10, 500)  # latest 50, ewma 125
    assert t.predict(10, 0) == math.ceil(125 * 10 * 1.5)  # ewma wins


def test_outliers_rejected_after_warmup() -> None:
    t = TransientTracker(alpha=0.3, outlier_factor=4.0)
    t.observe(1, 100)
    t.observe(1, 1000)  # within warmup: accepted even though 10×
    t.observe(1, 100)
    assert (t.observations, t.outliers) == (3, 0)
    ewma = t.ewma_bytes_per_token
    assert ewma is not None
    t.observe(1, int(ewma * 4) + 10)  # > 4 × EWMA: rejected
    assert (t.observations, t.outliers) == (3, 1)
    assert t.ewma_bytes_per_token == ewma
    t.observe(1, int(ewma * 3))  # within the factor: accepted
    assert (t.observations, t.outliers) == (4, 1)


def test_ignores_empty_chunks_and_reset() -> None:
    t = TransientTracker()
    t.observe(0, 100)
    assert t.observations == 0
    t.observe(4, 400)
    t.reset()
    assert (t.observations, t.outliers, t.ewma_bytes_per_token) == (0, 0, None)


@pytest.mark.parametrize("kwargs", [{"alpha": 0.0}, {"alpha": 1.5}, {"margin": 0.9}, {"outlier_factor": 1.0}])
def test_rejects_bad_parameters(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        TransientTracker(**kwargs)


def test_thread_safety_smoke() -> None:
    t = TransientTracker(alpha=0.1)

    def work() -> None:
        for _ in range(1000):
            t.observe(10, 1000)
            t.predict(10, 0)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert t.observations == 4000
    assert t.ewma_bytes_per_token == pytest.approx(100)
