"""The process a supervisor sees: an engine that dies takes the process down with a
non-zero status (launchd's KeepAlive and systemd's Restart=on-failure restart it); SIGTERM
drains what is in flight, releases MLX state on the engine thread, and exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from tests.conftest import MODEL, ServerProcess, wait_until

MESSAGES = [{"role": "user", "content": "hello"}]

# The real CLI in a real process, with one engine bug injected: from the fifth decode step
# on, every decode step raises.
CRASHING_ENGINE = """
import sys
import engine.core as core

decode = core.EngineCore._decode
steps = [0]

def crashing_decode(self):
    if len(self.batch):
        steps[0] += 1
        if steps[0] >= 5:
            raise RuntimeError("injected engine bug")
    return decode(self)

core.EngineCore._decode = crashing_decode
from server.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_engine_death_fails_in_flight_requests_and_exits_non_zero(tiny_model_path, tmp_path):
    """A failing step fails its own request (500, with the cause) and the server serves on;
    when steps keep failing, the engine is broken: 503 and a non-zero exit."""
    proc = ServerProcess(tiny_model_path, python_args=["-c", CRASHING_ENGINE]).start(tmp_path)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 50}
    try:
        for _ in range(2):
            r = httpx.post(f"{proc.url}/v1/chat/completions", timeout=60, json=body)
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["code"] == "engine_step_failed" and "injected engine bug" in err["message"]
            assert httpx.get(f"{proc.url}/health").status_code == 200
        r = httpx.post(f"{proc.url}/v1/chat/completions", timeout=60, json=body)
        died_at = time.monotonic()
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "engine_unavailable" and "injected engine bug" in err["message"]
        assert proc.proc is not None
        rc = proc.proc.wait(15)
        assert rc == 1, proc.log()
        assert time.monotonic() - died_at < 15
        assert "the engine died" in proc.log()
    finally:
        proc.stop()


def test_sigterm_drains_concurrent_requests_and_exits_zero(start_server):
    proc = start_server()
    max_tokens = 120

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=proc.url, timeout=60) as client:
            async def plain() -> dict:
                r = await client.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens})
                assert r.status_code == 200, r.text
                return {"finish": r.json()["choices"][0]["finish_reason"],
                        "tokens": r.json()["usage"]["completion_tokens"]}

            async def streamed() -> dict:
                body = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens,
                        "stream": True, "stream_options": {"include_usage": True}}
                finish, tokens = None, None
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                                finish = chunk["choices"][0]["finish_reason"]
                            if chunk.get("usage"):
                                tokens = chunk["usage"]["completion_tokens"]
                return {"finish": finish, "tokens": tokens}

            tasks = [asyncio.create_task(plain()), asyncio.create_task(plain()),
                     asyncio.create_task(streamed())]

            def generating() -> bool:
                q = httpx.get(f"{proc.url}/v1/memory").json()["queue"]
                return q["running"] == 3

            await asyncio.to_thread(wait_until, generating)
            proc.proc.send_signal(signal.SIGTERM)
            return list(await asyncio.gather(*tasks))

    results = asyncio.run(run())
    assert results == [{"finish": "length", "tokens": max_tokens}] * 3
    assert proc.proc.wait(30) == 0, proc.log()
    log = proc.log()
    assert "engine thread ended; MLX state released" in log
    assert "Traceback" not in log and "terminate called" not in log


def test_a_model_that_cannot_load_exits_non_zero(tmp_path):
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    proc = ServerProcess(empty)
    try:
        proc.start(tmp_path, timeout=60)
    except RuntimeError as exc:
        assert "exited early" in str(exc)
    assert proc.proc is not None and proc.proc.wait(30) == 3


# The real CLI again, with the engine thread's C++ thread-local teardown made slow: a
# 100 ms usleep registered (glibc's __cxa_thread_atexit_impl) after the thread's MLX
# random key, so it runs first, and 3 million objects for finalization's GC. MLX's random
# key destructor takes the GIL; if it still holds a key when it runs, the main thread is
# finalizing by then and the process aborts ("terminate called without an active
# exception", exit 134: what SIGTERM did on CUDA). Natural timing hit it 1 run in 3 here.
SLOW_THREAD_EXIT = """
import ctypes, sys
import mlx.core as mx
import engine.core as core

libc = ctypes.CDLL(None)
libc.__cxa_thread_atexit_impl.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
run_forever = core.EngineCore.run_forever

def slow_exit_run_forever(self):
    mx.eval(mx.random.uniform(shape=(2,)))  # this thread's random key (sampling makes it too)
    libc.__cxa_thread_atexit_impl(ctypes.cast(libc.usleep, ctypes.c_void_p), 100000, None)
    return run_forever(self)

core.EngineCore.run_forever = slow_exit_run_forever
GARBAGE = [[i] for i in range(3_000_000)]
from server.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # finalizes three million objects on purpose
def test_sigterm_exits_zero_when_the_engine_threads_exit_is_slow(tiny_model_path, tmp_path):
    proc = ServerProcess(tiny_model_path, python_args=["-c", SLOW_THREAD_EXIT]).start(tmp_path)
    r = httpx.post(f"{proc.url}/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 1.0})
    assert r.status_code == 200, r.text
    assert proc.stop() == 0, proc.log()
    assert "terminate called" not in proc.log()
