"""The last line of defence: a catchable device out-of-memory (CUDA) becomes a 507.

Admission should prevent it; when it happens anyway, the server frees the request's
memory, refuses it, and keeps serving. The CPU backend never raises one, so the model
is wrapped to raise CUDA's error exactly where the test says.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from engine import LoadedModel, load_model
from server.app import create_app
from server.settings import Settings
from tests.conftest import free_port, wait_until
from tests.engine.test_device_errors import OUT_OF_MEMORY

MODEL = "mlx-headroom/tiny-chat"
CUDA_OOM = "[cudaMallocAsync] cudaMallocAsync(&data, size, stream) failed: out of memory"


class FlakyModel:
    """Forwards to the real model; raises CUDA's OOM on the next prefill or decode call."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.fail_prefill = 0
        self.oom_message = CUDA_OOM
        self.fail_decode = 0
        self.crash = 0  # the next `crash` calls raise an engine bug (not a memory error)
        self.failed_in: list[list[str]] = []  # the engine functions on the stack at each failure

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if self.crash:
            self.crash -= 1
            raise ValueError("[broadcast_shapes] an engine bug, not a memory error")
        if inputs.shape[1] > 1 and self.fail_prefill:
            self.fail_prefill -= 1
            raise RuntimeError(self.oom_message)
        if inputs.shape[1] == 1 and self.fail_decode:
            self.fail_decode -= 1
            self.failed_in.append([f.function for f in inspect.stack()])
            raise RuntimeError(CUDA_OOM)
        return self._model(inputs, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


@pytest.fixture
def flaky_server(tiny_model_path: Path) -> Iterator[tuple[str, FlakyModel]]:
    holder: dict[str, FlakyModel] = {}

    def load() -> LoadedModel:
        loaded = load_model(str(tiny_model_path), model_id=MODEL)
        holder["model"] = FlakyModel(loaded.model)
        return LoadedModel(**{**loaded.__dict__, "model": holder["model"]})

    port = free_port()
    app = create_app(Settings(model=str(tiny_model_path), served_model_name=MODEL), load=load)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)  # polling for readiness
    assert server.started
    yield f"http://127.0.0.1:{port}", holder["model"]
    server.should_exit = True
    thread.join(30)


def chat(url: str, **extra: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 8, **extra})


def test_prefill_oom_is_507_and_the_server_keeps_serving(flaky_server):
    url, model = flaky_server
    model.fail_prefill = 1
    r = chat(url)
    assert r.status_code == 507, r.text
    err = r.json()["error"]
    assert err["code"] == "device_out_of_memory" and err["type"] == "insufficient_memory"
    assert r.headers["x-should-retry"] == "true"
    assert chat(url).status_code == 200
    memory = httpx.get(f"{url}/v1/memory").json()
    assert memory["kv_bytes"] == 0 and memory["committed_bytes"] == 0


@pytest.mark.parametrize("message", OUT_OF_MEMORY)
def test_every_backends_oom_message_is_507_not_a_dead_engine(flaky_server, message):
    url, model = flaky_server
    model.oom_message = message
    model.fail_prefill = 1
    r = chat(url)
    assert r.status_code == 507, r.text
    assert r.json()["error"]["code"] == "device_out_of_memory"
    assert chat(url).status_code == 200


def test_decode_oom_refuses_the_batch_and_the_server_keeps_serving(flaky_server):
    url, model = flaky_server
    model.fail_decode = 1
    r = chat(url)
    assert r.status_code == 507, r.text
    assert r.json()["error"]["code"] == "device_out_of_memory"
    # it failed inside the batch's decode step (the old one-row join forward ran in prefill)
    stack = model.failed_in[-1]
    assert "_decode" in stack and "_prefill" not in stack, stack
    ok = chat(url)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
    assert httpx.get(f"{url}/health").status_code == 200


def test_a_failing_step_is_500_with_its_cause_and_the_engine_serves_on(flaky_server):
    url, model = flaky_server
    model.crash = 1
    r = chat(url)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "engine_step_failed" and err["type"] == "server_error"
    assert "broadcast_shapes" in err["message"]
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and "engine_error" not in health.json()  # it serves on
    ok = chat(url)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
    memory = httpx.get(f"{url}/v1/memory").json()
    assert memory["kv_bytes"] == 0 and memory["engine"]["step_failures"] == 1


def test_an_engine_whose_steps_keep_failing_dies_and_answers_503(flaky_server):
    url, model = flaky_server
    model.crash = 1000
    codes = [chat(url).status_code for _ in range(2)]
    assert codes == [500, 500]
    r = chat(url)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "engine_unavailable" and "broadcast_shapes" in err["message"]
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503
    body = health.json()
    assert body["engine_alive"] is False and body["status"] == "unavailable"
    # why it died, as the 503s say it: the exception's type and message (no prompt text)
    assert body["engine_error"] == "ValueError: [broadcast_shapes] an engine bug, not a memory error"
    # nothing is mistaken for bad input once the model is gone: a token-id prompt is 503
    again = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4})
    assert again.status_code == 503 and again.json()["error"]["type"] == "service_unavailable"


def test_decode_oom_with_two_rows_refuses_both_and_frees_their_kv(flaky_server):
    url, model = flaky_server

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400}
            tasks = [asyncio.create_task(client.post("/v1/chat/completions", json=body)) for _ in range(2)]
            await asyncio.to_thread(
                wait_until, lambda: httpx.get(f"{url}/v1/memory").json()["queue"]["running"] == 2)
            model.fail_decode = 1
            return list(await asyncio.gather(*tasks))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [507, 507], [r.text for r in responses]
    assert "_decode" in model.failed_in[-1]
    memory = httpx.get(f"{url}/v1/memory").json()
    assert memory["engine"]["oom_recoveries"] >= 1
    assert memory["kv"]["reserved_bytes"] == 0 and memory["kv_bytes"] == 0
    assert chat(url).status_code == 200
