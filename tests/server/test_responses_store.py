"""The stored-responses bound: count and bytes, oldest out first."""

from __future__ import annotations

from server.responses.store import ResponseStore


def entry(i: int, size: int = 10) -> dict:
    return {"id": f"resp_{i}", "pad": "x" * size}


def test_count_bound_evicts_the_oldest():
    store = ResponseStore(max_entries=2, max_bytes=1 << 20)
    for i in range(3):
        assert store.put(entry(i), [])
    assert store.get("resp_0") is None and store.get("resp_1") and store.get("resp_2")


def test_byte_bound_holds_and_an_oversized_entry_is_not_kept():
    store = ResponseStore(max_entries=100, max_bytes=200)
    for i in range(5):
        store.put(entry(i, 50), [])
    assert store.nbytes <= 200 and len(store) < 5 and store.get("resp_4")
    assert not store.put(entry(9, 500), [])
    assert store.get("resp_9") is None


def test_reading_an_entry_keeps_it_longer():
    store = ResponseStore(max_entries=2, max_bytes=1 << 20)
    store.put(entry(0), [])
    store.put(entry(1), [])
    store.get("resp_0")
    store.put(entry(2), [])
    assert store.get("resp_0") and store.get("resp_1") is None
