"""The dashboard: static, offline-only assets, and the JSON it reads matches the real server."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboard"
JS = "\n".join((DASHBOARD / f).read_text() for f in ("util.js", "chart.js", "guard.js", "app.js"))
CSS = (DASHBOARD / "style.css").read_text()
MODEL = "mlx-headroom/tiny-chat"

CONTENT_TYPES = {".js": "javascript", ".css": "text/css", ".html": "text/html", ".png": "image/png",
                 ".svg": "image/svg+xml", ".ico": "image/"}


class _Refs(HTMLParser):
    """Every script src and link href, and the tier select's options."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []
        self.options: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "script" and a.get("src"):
            self.refs.append(a["src"])
        if tag == "link" and a.get("href"):
            self.refs.append(a["href"])
        if tag == "option" and a.get("value"):
            self.options.append(a["value"])


def parse_index() -> _Refs:
    parser = _Refs()
    parser.feed((DASHBOARD / "index.html").read_text())
    return parser


def dig(obj: dict, dotted: str):
    for part in dotted.split("."):
        assert isinstance(obj, dict) and part in obj, f"{dotted!r}: no {part!r} in {obj!r}"
        obj = obj[part]
    return obj


def test_index_is_served_as_html(server):
    r = httpx.get(f"{server.url}/dashboard/")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "<title>mlx-headroom dashboard</title>" in r.text


@pytest.mark.parametrize("path", sorted(p.name for p in DASHBOARD.iterdir() if p.is_file()))
def test_no_external_urls_in_dashboard_files(path):
    # an SVG's namespace is a name, never fetched
    text = (DASHBOARD / path).read_text(errors="replace").replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert not re.search(r"https?://", text, re.I), "absolute URL"
    assert not re.search(r"""["'(=]\s*//\w""", text), "protocol-relative URL"
    assert "//cdn" not in text.lower()
    assert "@import" not in text and "@font-face" not in text


def test_every_referenced_asset_is_local_and_served(server):
    refs = parse_index().refs
    assert sorted(refs) == ["app.js", "chart.js", "favicon.svg", "guard.js", "models.js", "style.css",
                            "util.js"]
    base = f"{server.url}/dashboard/"
    for ref in refs:
        assert not ref.startswith(("/", "http:", "https:", "data:")), ref
        r = httpx.get(urljoin(base, ref))
        assert r.status_code == 200, ref
        expected = CONTENT_TYPES[Path(ref).suffix]
        assert expected in r.headers["content-type"], (ref, r.headers["content-type"])
        assert r.text == (DASHBOARD / ref).read_text()


def test_js_uses_the_endpoints_with_auth_and_put():
    for endpoint in ("/v1/memory", "/v1/stats", "/v1/memory-guard", "/v1/version", "/health"):
        assert re.search(rf"""["'](\.\.)?{re.escape(endpoint)}["']""", JS), endpoint
    assert re.search(r"""method:\s*"PUT".*API\.guard|API\.guard.*method:\s*"PUT\"""", JS)
    assert '"Bearer "' in JS and "Authorization" in JS and "sessionStorage" in JS
    assert "error.message" in JS  # OpenAI error objects are shown to the user
    assert "SLOW_MS = 5000" in JS  # back off on 401/403


def test_relative_endpoints_resolve_to_the_api(server):
    base = f"{server.url}/dashboard/"
    for rel in re.findall(r"""["'](\.\./[\w/-]+)["']""", JS):
        assert httpx.get(urljoin(base, rel)).status_code == 200, rel


MEMORY_FIELDS = [
    "usage_bytes", "committed_bytes", "ceiling.hard_bytes", "ceiling.binding", "ceiling.components",
    "prefix_cache.bytes", "prefix_cache.entries", "prefix_cache.hits", "prefix_cache.misses",
    "prefix_cache.evictions", "prefix_cache.evictions_by_cause", "prefix_cache.budget_bytes",
    "prefix_cache.hit_tokens", "queue.waiting", "queue.prefilling", "queue.running",
    "engine.generated_tokens", "engine.max_batch", "decisions",
]
DECISION_FIELDS = ["at", "request_id", "outcome", "reason", "needed_bytes", "limit_bytes", "binding"]


def test_memory_fields_read_by_the_js_exist(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    memory = httpx.get(f"{server.url}/v1/memory").json()
    for field in MEMORY_FIELDS:
        dig(memory, field)
        if field.startswith("engine."):
            assert "m.engine" in JS  # every engine counter is listed, whatever its name
        else:
            assert f".{field.split('.')[-1]}" in JS, field
    components = memory["ceiling"]["components"]
    assert memory["ceiling"]["binding"] in components
    assert all(isinstance(v, int) for v in components.values())
    assert memory["decisions"], "a completion should have left an admission decision"
    for decision in memory["decisions"]:
        for field in DECISION_FIELDS:
            assert field in decision, field
            assert f"d.{field}" in JS, field
        assert f".badge.{decision['outcome']}" in CSS


def test_outcomes_and_tiers_match_the_server():
    from memory import Tier
    from memory.decision import Outcome

    assert {o.value for o in Outcome} == {"admit", "evict", "wait", "reject"}
    for outcome in Outcome:
        assert f".badge.{outcome.value}" in CSS
    assert parse_index().options == [t.value for t in Tier]


def test_header_and_guard_fields_exist(server):
    version = httpx.get(f"{server.url}/v1/version").json()
    for field in ("version", "mlx", "mlx_lm", "backend"):
        assert field in version and f"v.{field}" in JS
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    guard = httpx.get(f"{server.url}/v1/memory-guard").json()
    for field in ("enabled", "tier", "ceiling_bytes"):
        assert field in guard and f"g.{field}" in JS


def test_the_guard_changes_the_js_sends(small_machine):
    """The three PUT bodies the page sends are accepted, and a bad one gives error.message."""
    url = small_machine.url + "/v1/memory-guard"
    r = httpx.put(url, json={"enabled": False})
    assert r.status_code == 200 and r.json()["enabled"] is False
    r = httpx.put(url, json={"tier": "safe"})
    assert r.status_code == 200 and r.json() == {"enabled": False, "tier": "safe", "ceiling_bytes": None}
    r = httpx.put(url, json={"tier": "custom", "ceiling_bytes": 3 << 30})
    assert r.status_code == 200 and r.json()["ceiling_bytes"] == 3 << 30
    r = httpx.put(url, json={"tier": "custom", "ceiling_bytes": 0})
    assert r.status_code >= 400
    assert r.json()["error"]["message"]
