"""Where decode steps are replayed, the server times a lone row's two paths (the slice and
the traced graph) and says which it kept, with both medians, in `/v1/memory` and its log."""

from __future__ import annotations

import httpx

MODEL = "mlx-headroom/tiny-chat"


def _engine(url: str) -> dict:
    r = httpx.get(url + "/v1/memory", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["engine"]


def test_the_timed_choice_is_reported_with_its_numbers(start_server) -> None:
    srv = start_server(args=["--compile-decode", "--no-warm-up"])
    assert _engine(srv.url)["slice_choice"]["chosen"] is None  # nothing timed yet
    for i in range(12):  # lone requests until 24 clean steps of each path are in
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": f"count with me, round {i}:", "max_tokens": 64, "temperature": 0})
        assert r.status_code == 200, r.text
        if _engine(srv.url)["slice_choice"]["chosen"] is not None:
            break
    engine = _engine(srv.url)
    choice = engine["slice_choice"]
    assert choice["chosen"] in ("slice", "paged"), choice
    assert choice["slice_ms"] > 0 and choice["paged_ms"] > 0 and choice["samples"] == 24
    assert engine["sliced_steps"] >= 24 and engine["compiled_steps"] >= 24
    assert "lone-row decode path, timed on this machine" in srv.log()
    assert "count with me" not in srv.log()  # numbers in the log, never the prompt


def test_without_replayed_steps_the_slice_is_simply_on(start_server) -> None:
    srv = start_server(args=["--no-compile-decode"])
    r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "hello", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    engine = _engine(srv.url)
    assert engine["slice_choice"] is None
    assert engine["sliced_steps"] >= 1
