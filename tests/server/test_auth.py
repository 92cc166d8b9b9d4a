"""API and admin keys: one middleware in front of every route; /health and the dashboard stay open."""

from __future__ import annotations

import httpx
import openai
import pytest

from server.auth import check, is_loopback, startup_problem
from server.settings import Settings
from tests import forkserver
from tests.conftest import KEYS, ROOT, free_port

MODEL = "mlx-headroom/tiny-chat"
API, ADMIN = KEYS  # keyed_server's


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_error(r: httpx.Response, status: int, type_: str, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == type_
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize(
    ("method", "path", "token", "api_key", "admin_key", "expected"),
    [
        ("GET", "/v1/models", None, None, None, None),
        ("GET", "/v1/models", None, API, None, 401),
        ("GET", "/v1/models", "wrong", API, None, 401),
        ("GET", "/v1/models", API, API, None, None),
        ("GET", "/v1/models", ADMIN, API, ADMIN, None),
        ("POST", "/v1/chat/completions", API, API, ADMIN, None),
        ("POST", "/v1/messages", API, API, ADMIN, None),
        ("POST", "/v1/messages/count_tokens", API, API, ADMIN, None),
        ("POST", "/v1/messages/batches", API, API, ADMIN, 403),
        ("POST", "/v1/responses", API, API, ADMIN, None),
        ("DELETE", "/v1/responses/resp_1", API, API, ADMIN, None),
        ("GET", "/metrics", None, API, None, 401),
        ("GET", "/v1/memory", None, API, None, 401),
        ("GET", "/openapi.json", None, API, None, 401),
        ("GET", "/health", None, API, ADMIN, None),
        ("GET", "/dashboard/", None, API, ADMIN, None),
        ("GET", "/dashboard/app.js", None, API, ADMIN, None),
        ("GET", "/dashboardx", None, API, ADMIN, 401),
        ("PUT", "/v1/memory-guard", API, API, None, None),
        ("PUT", "/v1/memory-guard", API, API, ADMIN, 403),
        ("PUT", "/v1/memory-guard", ADMIN, API, ADMIN, None),
        ("PUT", "/v1/memory-guard", None, API, ADMIN, 401),
        ("PUT", "/v1/memory-guard", None, None, ADMIN, 401),
        ("GET", "/v1/memory-guard", None, None, ADMIN, 401),
        ("DELETE", "/v1/anything-new", API, API, ADMIN, 403),
    ],
)
def test_check_table(method, path, token, api_key, admin_key, expected):
    error = check(method, path, token, api_key=api_key, admin_key=admin_key)
    assert (error.status if error else None) == expected


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("::1", True), ("localhost", True), ("127.0.0.2", True),
     ("0.0.0.0", False), ("::", False), ("192.168.1.10", False), ("example.com", False)],
)
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_startup_problem_needs_a_key_or_the_flag_off_loopback():
    assert startup_problem(Settings(host="127.0.0.1")) is None
    assert "--api-key" in startup_problem(Settings(host="0.0.0.0"))
    assert startup_problem(Settings(host="0.0.0.0", api_key="k")) is None
    assert startup_problem(Settings(host="0.0.0.0", admin_key="k")) is None
    assert startup_problem(Settings(host="0.0.0.0", allow_unauthenticated=True)) is None


def test_refuses_to_start_on_a_public_address_without_a_key(tiny_model_path, monkeypatch):
    for name in ("MLX_HEADROOM_API_KEY", "MLX_HEADROOM_ADMIN_KEY", "MLX_HEADROOM_ALLOW_UNAUTHENTICATED"):
        monkeypatch.delenv(name, raising=False)
    proc = forkserver.run(["serve", "--model", str(tiny_model_path), "--host", "0.0.0.0",
                           "--port", str(free_port())], cwd=ROOT, timeout=60)
    assert proc.returncode == 2
    assert "refusing to serve on 0.0.0.0 without an API key" in proc.stderr
    assert "--allow-unauthenticated" in proc.stderr


@pytest.fixture
def keyed(keyed_server):
    return keyed_server


@pytest.mark.parametrize("path", ["/v1/models", "/v1/memory", "/metrics", "/v1/version",
                                  "/v1/memory-guard", "/openapi.json", "/v1/nonexistent"])
def test_every_data_route_needs_the_key(keyed, path):
    r = httpx.get(keyed.url + path)
    assert_error(r, 401, "authentication_error", "invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"
    assert_error(httpx.get(keyed.url + path, headers=bearer("nope")), 401, "authentication_error")
    assert httpx.get(keyed.url + path, headers={"Authorization": API}).status_code == 401
    ok = httpx.get(keyed.url + path, headers=bearer(API))
    assert ok.status_code == (404 if path == "/v1/nonexistent" else 200), ok.text


def test_chat_with_the_key(keyed):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(keyed.url + "/v1/chat/completions", json=body)
    assert_error(r, 401, "authentication_error", "invalid_api_key")
    r = httpx.post(keyed.url + "/v1/chat/completions", json=body, headers=bearer(API), timeout=60)
    assert r.status_code == 200, r.text


def test_openai_sdk_sends_the_key(keyed):
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=API, max_retries=0)
    assert [m.id for m in good.models.list()] == [MODEL]
    bad = openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.code == "invalid_api_key"


def test_health_and_dashboard_stay_open(keyed):
    assert httpx.get(keyed.url + "/health").status_code == 200
    assert httpx.get(keyed.url + "/dashboard/").status_code != 401


def test_admin_route_needs_the_admin_key(keyed):
    url = keyed.url + "/v1/memory-guard"
    r = httpx.put(url, json={"enabled": True}, headers=bearer(API))
    err = assert_error(r, 403, "permission_error", "admin_key_required")
    assert "admin" in err["message"]
    assert_error(httpx.put(url, json={"enabled": True}), 401, "authentication_error")
    r = httpx.put(url, json={"enabled": True}, headers=bearer(ADMIN))
    assert r.status_code == 200 and r.json()["enabled"] is True
    # reading the guard's state is not admin; the admin key also covers the plain routes
    assert httpx.get(url, headers=bearer(API)).status_code == 200
    assert httpx.get(keyed.url + "/v1/models", headers=bearer(ADMIN)).status_code == 200


def test_the_api_key_covers_admin_when_no_admin_key_is_set(start_server):
    proc = start_server(env={"MLX_HEADROOM_API_KEY": API})
    r = httpx.put(proc.url + "/v1/memory-guard", json={"enabled": True}, headers=bearer(API))
    assert r.status_code == 200, r.text
    assert httpx.put(proc.url + "/v1/memory-guard", json={"enabled": True}).status_code == 401
