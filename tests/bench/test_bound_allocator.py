"""bench.run measures the bound on the allocator our server will run on (`bound_allocator`):
the bare step is host-paced, and jemalloc moves it (docs/throughput.md, the bound)."""

from __future__ import annotations

import pytest

from bench.run import bound_allocator

LIB = "/opt/lib/libjemalloc.so.2"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MLX_HEADROOM_MALLOC", "MLX_HEADROOM_MALLOC_CHOSEN", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)


def test_where_the_server_will_pick_jemalloc_the_bound_runs_on_it_too():
    env, name = bound_allocator({"LD_PRELOAD": "libopenblas.so.0", "X": "1"}, [], {}, library=LIB)
    assert name == "jemalloc"
    assert env == {"LD_PRELOAD": f"{LIB} libopenblas.so.0", "X": "1"}


def test_a_server_told_to_use_the_system_allocator_leaves_the_bound_on_it():
    for args, ours_env in ((["--malloc=system"], {}), (["--malloc", "system"], {}),
                           ([], {"MLX_HEADROOM_MALLOC": "system"})):
        env, name = bound_allocator({"X": "1"}, args, ours_env, library=LIB)
        assert (env, name) == ({"X": "1"}, "system")


def test_a_preload_given_to_our_server_is_given_to_the_bound(monkeypatch: pytest.MonkeyPatch):
    env, name = bound_allocator({}, ["--malloc=system"], {"LD_PRELOAD": "/tmp/libjemalloc.so.2"},
                                library=LIB)
    assert (env, name) == ({"LD_PRELOAD": "/tmp/libjemalloc.so.2"}, "jemalloc")
    monkeypatch.setenv("LD_PRELOAD", "/tmp/libjemalloc.so.2")  # the whole bench under it
    assert bound_allocator({}, [], {}, library=LIB) == ({"LD_PRELOAD": "/tmp/libjemalloc.so.2"},
                                                        "jemalloc")
