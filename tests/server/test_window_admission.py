"""A sliding-window model through a real server: load admission counts its window layers
at their rings in the paged store, and GET /v1/memory's KV figures for a long request are
what the store holds for it, far below what the same request would hold if every layer
kept every token.

The model is tests/engine/window_model.py's (gemma3_text: 2 full layers, 4 with a
64-token window); usage is MLX's own allocator count.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import MODEL, ServerProcess, wait_until
from tests.engine import window_model

STEP = 32
RESERVE = 4096
BPL = window_model.BYTES_PER_TOKEN_LAYER


@pytest.fixture(scope="module")
def window_server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[ServerProcess]:
    path = window_model.save_window_model(tmp_path_factory.mktemp("models") / "window", tiny_model_path)
    proc = ServerProcess(
        path, env={"MLX_HEADROOM_PREFIX_CACHE_BYTES": "0"},
        args=["--memory-probe", "allocator", "--reserve-context-tokens", str(RESERVE),
              "--prefill-step-size", str(STEP)],
    ).start(tmp_path_factory.mktemp("logs"))
    yield proc
    proc.stop()


def memory(url: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/v1/memory", timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_load_admission_counts_window_layers_at_their_window(window_server: ServerProcess) -> None:
    check = memory(window_server.url)["model"]["load_check"]
    assert check["reserve_context_tokens"] == RESERVE
    # from the config: the 2 full layers' 256 blocks of 16 tokens, and the 2 groups of 2
    # window layers a ring of 6 blocks each (63 + 32 positions), at 128 bytes per token per
    # layer, with room for two copies of the rings (24 blocks): 292 blocks, in a default
    # segment (2,048 tokens of all 6 layers: 384 blocks of 2 layers)
    reserved = window_model.paged_reserved_kv_bytes(RESERVE, STEP)
    assert reserved == (RESERVE // 16 + 2 * 6) * 16 * 2 * BPL
    assert reserved + window_model.snapshot_spare_bytes() < window_model.cpu_segment_bytes()
    assert check["reserve_kv_bytes"] == window_model.cpu_segment_bytes()
    assert reserved < window_model.all_full_kv_bytes(RESERVE) / 2
    assert f"KV for {RESERVE} reserved tokens" in check["message"]


def test_a_long_requests_kv_figures_are_what_its_caches_hold(window_server: ServerProcess) -> None:
    url = window_server.url
    prompt, max_tokens = "w" * 900, 600  # 900 byte tokens: 14 windows, in 29 chunks
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "logit_bias": {"258": -100}}  # no end of text: it decodes all its tokens
    usage: dict[str, int] = {}
    first = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    usage.update(chunk.get("usage") or {})
                    first.set()
        first.set()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    assert first.wait(120)
    seen: dict[str, Any] = {}

    def decoding() -> bool:
        view = memory(url)
        seen.update(view)
        return bool(view["queue"]["running"] == 1 and view["kv"]["pool_bytes"])

    wait_until(decoding)
    thread.join(300)
    assert usage["completion_tokens"] == max_tokens
    total = usage["prompt_tokens"] + max_tokens
    kv = seen["kv"]
    assert kv["layer_groups"] == [{"layers": 2, "window": None, "ring_blocks": None},
                                  {"layers": 2, "window": 64, "ring_blocks": 6},
                                  {"layers": 2, "window": 64, "ring_blocks": 6}]
    # reserved: the full layers' blocks and the window layers' rings, from the config
    assert kv["reserved_bytes"] == window_model.paged_reserved_kv_bytes(total, STEP)
    assert kv["reserved_bytes"] < window_model.all_full_kv_bytes(total) / 2
    # held: the one default segment the request lives in
    held = kv["pool_bytes"]
    assert held == window_model.cpu_segment_bytes() > kv["reserved_bytes"]
    assert seen["kv_bytes"] == held
    wait_until(lambda: memory(url)["kv"]["reserved_bytes"] == 0)
