"""Host and Origin checks against DNS rebinding and cross-site requests, through a real server."""

from __future__ import annotations

import httpx
import pytest

from server.host_guard import HostPolicy, split_host
from tests.conftest import ServerProcess

MODEL = "mlx-headroom/tiny-chat"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
EVIL_HOST = "attacker.example"


@pytest.fixture(scope="module")
def guarded(tiny_model_path, tmp_path_factory):
    proc = ServerProcess(tiny_model_path, args=[
        "--allowed-host", "myhost.lan", "--allowed-host", "proxy.example:8443",
        "--cors-origin", "http://app.example",
    ]).start(tmp_path_factory.mktemp("host_guard"))
    yield proc
    proc.stop()


def guard_state(url: str) -> dict:
    r = httpx.get(url + "/v1/memory-guard")
    assert r.status_code == 200, r.text
    return r.json()


def assert_forbidden(r: httpx.Response, code: str, setting: str) -> None:
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "permission_error" and err["code"] == code
    assert f"MLX_HEADROOM_{setting.upper()}" in err["message"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [("localhost", ("localhost", None)), ("LocalHost:8000", ("localhost", 8000)),
     ("127.0.0.1:80", ("127.0.0.1", 80)), ("[::1]", ("::1", None)), ("[::1]:8000", ("::1", 8000)),
     ("[0:0:0:0:0:0:0:1]:1", ("::1", 1)), ("localhost.", ("localhost", None)),
     ("evil.example:x", ("evil.example:x", None)), ("[::1]junk", ("[::1]junk", None))],
)
def test_split_host(value, expected):
    assert split_host(value) == expected


def test_allowed_hosts_setting_takes_a_list_or_commas(monkeypatch):
    from server.settings import Settings

    monkeypatch.setenv("MLX_HEADROOM_ALLOWED_HOSTS", "myhost.lan, proxy.example")
    assert Settings().allowed_hosts == ["myhost.lan", "proxy.example"]
    monkeypatch.setenv("MLX_HEADROOM_ALLOWED_HOSTS", '["*"]')
    assert Settings().allowed_hosts == ["*"]


def test_policy_table():
    p = HostPolicy.build(bind_host="0.0.0.0", allowed_hosts=["myhost.lan"], cors_origins=[])
    assert all(p.host_allowed(h) for h in ("localhost", "127.0.0.1:9", "[::1]", "0.0.0.0", "MYHOST.LAN"))
    assert not any(p.host_allowed(h) for h in ("evil.example", "localhost.evil.example", "127.0.0.2",
                                               "myhost.lan.evil", ""))
    assert HostPolicy.build(bind_host="127.0.0.1", allowed_hosts=["*"], cors_origins=[]).host_allowed("x.y")
    assert p.origin_allowed("http://localhost:8000", "localhost:8000")
    assert p.origin_allowed("http://localhost", "localhost:80")
    assert p.origin_allowed("https://myhost.lan", "myhost.lan")  # a TLS proxy forwarding Host
    assert p.origin_allowed("https://myhost.lan", "127.0.0.1:8000")  # a proxy sending its own Host
    assert not p.origin_allowed("http://evil.lan", "127.0.0.1:8000")
    assert not p.origin_allowed("http://localhost:3000", "localhost:8000")  # another local app
    assert not p.origin_allowed("null", "localhost:8000")
    assert not p.origin_allowed("http://evil.example", "localhost:8000")
    cors = HostPolicy.build(bind_host="127.0.0.1", allowed_hosts=[], cors_origins=["https://app.example/"])
    assert cors.origin_allowed("https://app.example", "127.0.0.1:8000")
    assert not cors.origin_allowed("http://app.example", "127.0.0.1:8000")


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [("PUT", "/v1/memory-guard", {"enabled": False}), ("POST", "/v1/chat/completions", CHAT),
     ("GET", "/v1/memory", None), ("GET", "/dashboard/", None), ("GET", "/health", None)],
)
def test_a_foreign_host_is_refused_everywhere(guarded, method, path, body):
    before = guard_state(guarded.url)
    generated = httpx.get(guarded.url + "/v1/memory").json()["engine"]["generated_tokens"]
    for host in (EVIL_HOST, f"{EVIL_HOST}:{guarded.port}", "localhost.attacker.example", "127.0.0.2"):
        r = httpx.request(method, guarded.url + path, json=body, headers={"Host": host}, timeout=30)
        assert_forbidden(r, "host_not_allowed", "allowed_hosts")
        assert host in r.json()["error"]["message"] and "--allowed-host" in r.json()["error"]["message"]
    assert guard_state(guarded.url) == before
    assert httpx.get(guarded.url + "/v1/memory").json()["engine"]["generated_tokens"] == generated


def test_every_allowed_host_form_is_served(guarded):
    port = guarded.port
    for name in ("localhost", "127.0.0.1", "[::1]", "myhost.lan", "MyHost.LAN", "proxy.example"):
        for host in (name, f"{name}:{port}"):
            for path in ("/v1/memory-guard", "/dashboard/"):
                r = httpx.get(guarded.url + path, headers={"Host": host})
                assert r.status_code == 200, (host, path, r.text)


def test_a_foreign_origin_cannot_change_anything(guarded):
    before = guard_state(guarded.url)
    for origin in ("http://evil.example", "null", f"http://localhost:{guarded.port + 1}"):
        r = httpx.put(guarded.url + "/v1/memory-guard", json={"enabled": False},
                      headers={"Origin": origin})
        assert_forbidden(r, "origin_not_allowed", "cors_origins")
        assert "--cors-origin" in r.json()["error"]["message"]
        r = httpx.post(guarded.url + "/v1/chat/completions", json=CHAT, headers={"Origin": origin})
        assert_forbidden(r, "origin_not_allowed", "cors_origins")
    assert guard_state(guarded.url) == before
    # reading is not refused by Origin (and without CORS the browser cannot read the answer)
    assert httpx.get(guarded.url + "/v1/memory-guard", headers={"Origin": "http://evil.example"}
                     ).status_code == 200


def test_own_and_configured_origins_and_no_origin_may_change_things(guarded):
    url = guarded.url + "/v1/memory-guard"
    own = {"Origin": f"http://127.0.0.1:{guarded.port}"}
    try:
        assert httpx.put(url, json={"enabled": False}, headers=own).json()["enabled"] is False
        r = httpx.put(url, json={"enabled": True}, headers={"Origin": "http://app.example"})
        assert r.status_code == 200 and r.json()["enabled"] is True
        assert r.headers["access-control-allow-origin"] == "http://app.example"
        lan = {"Host": f"myhost.lan:{guarded.port}", "Origin": f"http://myhost.lan:{guarded.port}"}
        assert httpx.put(url, json={"tier": "safe"}, headers=lan).json()["tier"] == "safe"
        assert httpx.put(url, json={"tier": "balanced"}).json()["tier"] == "balanced"  # curl, SDKs
        r = httpx.post(guarded.url + "/v1/chat/completions", json=CHAT, headers=own, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        httpx.put(url, json={"enabled": True, "tier": "balanced"})


@pytest.mark.parametrize(
    ("content_type", "content"),
    [("text/plain", '{"enabled": false}'), ("application/x-www-form-urlencoded", "enabled=false"),
     ("multipart/form-data; boundary=x", '--x\r\nContent-Disposition: form-data; name="enabled"'
                                         '\r\n\r\nfalse\r\n--x--\r\n')],
)
def test_simple_cross_site_bodies_are_not_json(guarded, content_type, content):
    """What a page can send without a preflight never reaches a route as JSON."""
    before = guard_state(guarded.url)
    for method, path in (("PUT", "/v1/memory-guard"), ("POST", "/v1/chat/completions")):
        r = httpx.request(method, guarded.url + path, content=content.encode(),
                          headers={"Content-Type": content_type}, timeout=30)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert guard_state(guarded.url) == before


def test_no_cors_unless_configured(server):
    before = guard_state(server.url)
    for method in ("GET", "OPTIONS"):
        r = httpx.request(method, server.url + "/v1/models", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "PUT"})
        assert "access-control-allow-origin" not in r.headers
    r = httpx.put(server.url + "/v1/memory-guard", json={"enabled": False},
                  headers={"Origin": "http://evil.example"})
    assert_forbidden(r, "origin_not_allowed", "cors_origins")
    assert guard_state(server.url) == before
