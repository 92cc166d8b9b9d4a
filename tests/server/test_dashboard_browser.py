"""The dashboard in a real browser (Debian's chromium through Playwright) against real servers.

Every change made on the page is confirmed through the API, and every state the page shows
is one the server reported. Set MLX_HEADROOM_SCREENSHOTS=docs to refresh the README's
screenshots; otherwise they go to a temporary directory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, Request, expect, sync_playwright

from tests.conftest import KEYS, ServerProcess, wait_until

CHROMIUM = "/usr/bin/chromium"
MODEL = "mlx-headroom/tiny-chat"
GiB = 1 << 30
API, ADMIN = KEYS  # keyed_server's
TIMEOUT_MS = 10_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    # CI preloads OpenBLAS for MLX (.ci/run); inside Playwright's node driver and chromium it
    # breaks thread creation and the GPU process, so they start without it (the servers
    # started later keep it).
    preload = os.environ.pop("LD_PRELOAD", None)
    try:
        p = sync_playwright().start()
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload
    yield b
    b.close()
    p.stop()


@pytest.fixture(scope="module")
def open_server(tiny_model_path, tmp_path_factory) -> Iterator[ServerProcess]:
    """No keys; the allocator probe, so that a custom ceiling a little above the model's
    own few MiB forces a refusal."""
    proc = ServerProcess(tiny_model_path, args=["--memory-probe", "allocator"]).start(
        tmp_path_factory.mktemp("dash_open"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    where = os.environ.get("MLX_HEADROOM_SCREENSHOTS")
    path = Path(where) if where else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


class Tab:
    """A page with its console errors and the guard changes it sent."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.errors: list[str] = []
        self.puts: list[Request] = []
        page.on("console", self._console)
        page.on("pageerror", lambda exc: self.errors.append(f"page error: {exc}"))
        page.on("request", lambda r: self.puts.append(r) if r.method == "PUT" else None)

    def _console(self, msg: ConsoleMessage) -> None:
        if msg.type == "error":
            self.errors.append(msg.text)


@pytest.fixture
def open_tab(browser: Browser) -> Iterator[Callable[..., Tab]]:
    contexts = []

    def open_(url: str, *, width: int = 1280, height: int = 900, dark: bool = False) -> Tab:
        context = browser.new_context(viewport={"width": width, "height": height},
                                      color_scheme="dark" if dark else "light")
        contexts.append(context)
        tab = Tab(context.new_page())
        tab.page.set_default_timeout(TIMEOUT_MS)
        tab.page.goto(url + "/dashboard/")
        return tab

    yield open_
    for context in contexts:
        context.close()


def guard(url: str, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(url + "/v1/memory-guard", headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def chat(url: str, content: str, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens})


def reset(url: str) -> None:
    r = httpx.put(url + "/v1/memory-guard", json={"enabled": True, "tier": "balanced"})
    assert r.status_code == 200, r.text


def apply_ceiling(page: Page, gib: str) -> None:
    page.select_option("#g-tier", "custom")
    page.fill("#g-ceiling", gib)
    page.click("#g-apply")


def test_guard_controls_change_the_server(open_server, open_tab):
    url = open_server.url
    reset(url)
    tab = open_tab(url)
    page = tab.page
    expect(page.locator("#guard-state")).to_contain_text("Server state: on · tier balanced")
    expect(page.locator("#g-enabled")).to_be_enabled()

    page.click("#g-enabled")
    wait_until(lambda: guard(url)["enabled"] is False, timeout=10)
    expect(page.locator("#guard-state")).to_contain_text("off · nothing is refused")
    expect(page.locator("#components li.binding")).to_have_count(0)  # guard off: nothing binds
    page.click("#g-enabled")
    wait_until(lambda: guard(url)["enabled"] is True, timeout=10)

    page.select_option("#g-tier", "safe")
    wait_until(lambda: guard(url)["tier"] == "safe", timeout=10)
    expect(page.locator("#guard-state")).to_contain_text("tier safe")

    # "custom" without a ceiling sends nothing and the card keeps showing the server's state...
    expect(page.locator("#g-ceiling")).to_have_value("")
    page.select_option("#g-tier", "custom")
    expect(page.locator("#guard-note")).to_contain_text("stays on tier safe")
    expect(page.locator("#guard-state")).to_contain_text("tier safe")
    # ...and a change made elsewhere shows within a poll or two, dropping the unapplied choice.
    assert httpx.put(url + "/v1/memory-guard", json={"tier": "aggressive"}).status_code == 200
    expect(page.locator("#guard-state")).to_contain_text("tier aggressive", timeout=4000)
    expect(page.locator("#g-tier")).to_have_value("aggressive", timeout=4000)

    for gib, expected in (("2", 2 * GiB), ("0.2", round(0.2 * GiB)), ("1.5", 3 * GiB // 2)):
        apply_ceiling(page, gib)
        wait_until(lambda expected=expected: guard(url) == {
            "enabled": True, "tier": "custom", "ceiling_bytes": expected}, timeout=10)
        expect(page.locator("#guard-state")).to_contain_text("custom ceiling")
        expect(page.locator("#guard-error")).to_be_hidden()

    # The value the page fills in itself is accepted as it stands.
    expect(page.locator("#g-ceiling")).to_have_value("1.5")
    page.click("#g-apply")
    expect(page.locator("#guard-note")).to_contain_text("Saved")
    assert guard(url)["ceiling_bytes"] == 3 * GiB // 2

    page.fill("#g-ceiling", "0")
    page.click("#g-apply")
    expect(page.locator("#guard-error")).to_contain_text("positive number")
    assert guard(url)["ceiling_bytes"] == 3 * GiB // 2

    apply_ceiling(page, "100000")  # 97.7 TiB: accepted, but not without a word
    expect(page.locator("#guard-warn")).to_contain_text("above this machine's")
    assert guard(url)["ceiling_bytes"] == 100000 * GiB

    page.select_option("#g-tier", "balanced")
    wait_until(lambda: guard(url) == {"enabled": True, "tier": "balanced", "ceiling_bytes": None}, timeout=10)
    expect(page.locator("#guard-warn")).to_be_hidden()

    # #14: the page's own changes carry its Origin, which the Origin check lets through.
    assert tab.puts and all(r.all_headers().get("origin") == url for r in tab.puts)
    assert tab.errors == []


def test_a_refusal_shows_in_the_banner_and_the_counters(open_server, open_tab, shots):
    url = open_server.url
    reset(url)
    usage = httpx.get(url + "/v1/memory").json()["usage_bytes"]
    ceiling = usage + (256 << 10)  # a little above what the model itself holds
    r = httpx.put(url + "/v1/memory-guard", json={"tier": "custom", "ceiling_bytes": ceiling})
    assert r.status_code == 200, r.text
    tab = open_tab(url)
    page = tab.page
    expect(page.locator("#banner")).to_be_hidden()
    try:
        for _ in range(2):
            r = chat(url, "tell me a long story " * 100)
            assert r.status_code == 507, r.text
        banner = page.locator("#banner")
        expect(banner).to_be_visible()
        expect(banner).to_contain_text("2 requests refused in the last minute")
        expect(banner).to_contain_text("custom ceiling is")
        expect(banner).to_contain_text("short")
        counts = page.locator("#refusal-counts")
        expect(counts.locator("dd").first).to_have_text("2")
        expect(counts.locator("dd.bad")).to_have_count(1)
        expect(page.locator("#refusals li .badge.reject")).to_have_count(2)
        # usage just under the ceiling is amber; over it, red
        expect(page.locator("#usage-pct")).to_have_class(re.compile(r"\bwarn\b"))
        page.screenshot(path=str(shots / "dashboard-refusal.png"))
        usage = httpx.get(url + "/v1/memory").json()["usage_bytes"]
        httpx.put(url + "/v1/memory-guard", json={"ceiling_bytes": usage * 99 // 100})
        expect(page.locator("#usage-pct")).to_have_class(re.compile(r"\bbad\b"))
        expect(page.locator("#bar")).to_have_class(re.compile(r"\bbad\b"))
        # Admits that follow (one per prefill chunk) leave the refusals in their list.
        reset(url)
        admits = [d for d in httpx.get(url + "/v1/memory").json()["decisions"] if d["outcome"] == "admit"]
        for _ in range(3):
            assert chat(url, "hello").status_code == 200
        page.wait_for_function(
            "n => view.memory.decisions.filter(d => d.outcome === 'admit').length >= n", arg=len(admits) + 3)
        expect(page.locator("#refusals li .badge.reject")).to_have_count(2)
        expect(page.locator("#perf")).to_contain_text("tok/s")
    finally:
        reset(url)
    assert tab.errors == []


def test_history_survives_a_reload(open_server, open_tab):
    tab = open_tab(open_server.url)
    page = tab.page
    page.wait_for_function("() => view.history.at.length >= 3")
    page.reload()
    # the first answer brings the server's ring: more than the one sample a fresh page would have
    page.wait_for_function("() => view.history.at.length > 0")
    assert page.evaluate("() => view.history.at.length") >= 3
    expect(page.locator("#chart")).to_be_visible()
    assert tab.errors == []


def test_phone_width_and_dark_mode(open_server, open_tab, shots):
    url = open_server.url
    for _ in range(3):
        assert chat(url, "hello there, how are you today? " * 3, max_tokens=8).status_code == 200
    desktop = open_tab(url)
    expect(desktop.page.locator("#decisions tr td.reason").first).to_be_visible()
    expect(desktop.page.locator("#chunks tr").first).to_be_visible()
    desktop.page.screenshot(path=str(shots / "dashboard-desktop.png"), full_page=True)

    phone = open_tab(url, width=400, height=860, dark=True)
    page = phone.page
    expect(page.locator("#decisions tr td.reason").first).to_be_visible()
    assert page.evaluate("document.documentElement.scrollWidth") <= 400
    widths = page.evaluate(
        "[...document.querySelectorAll('.card')].map(c => c.getBoundingClientRect().right)")
    assert widths and max(widths) <= 400
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert background == "rgb(15, 18, 23)"  # the dark palette
    page.screenshot(path=str(shots / "dashboard-phone.png"))
    assert desktop.errors == [] and phone.errors == []


def test_auth_with_and_without_keys(keyed_server, open_tab):
    url = keyed_server.url
    tab = open_tab(url)
    page = tab.page
    # No key: the page says so, shows no made-up guard state and offers no controls.
    expect(page.locator("#alert")).to_contain_text("401")
    expect(page.locator("#guard-state")).to_contain_text("unknown")
    expect(page.locator("#guard-form")).to_be_hidden()
    for control in ("#g-enabled", "#g-tier", "#g-ceiling", "#g-apply"):
        expect(page.locator(control)).to_be_disabled()
    expect(page.locator("#usage")).to_have_text("—")
    expect(page.locator("#refusals")).to_have_text("—")

    # The admin key alone reads too, and the old 401 goes away.
    page.fill("#admin-key", ADMIN)
    page.click("#key-form button[type=submit]")
    expect(page.locator("#alert")).to_be_hidden()
    expect(page.locator("#guard-state")).to_contain_text("Server state: on")
    expect(page.locator("#usage")).not_to_have_text("—")
    assert page.evaluate("sessionStorage.getItem('mlx-headroom.adminKey')") == ADMIN
    assert page.evaluate("localStorage.length") == 0
    page.click("#g-enabled")
    wait_until(lambda: guard(url, API)["enabled"] is False, timeout=10)
    page.click("#g-enabled")
    wait_until(lambda: guard(url, API)["enabled"] is True, timeout=10)

    # The API key alone reads, but cannot change the guard: 403, and the card stays true.
    page.fill("#admin-key", "")
    page.fill("#api-key", API)
    page.click("#key-form button[type=submit]")
    page.click("#g-enabled")
    expect(page.locator("#guard-error")).to_contain_text("403")
    expect(page.locator("#g-enabled")).to_be_checked()
    assert guard(url, API)["enabled"] is True

    # Saving the right key clears the stale 403; "remember" keeps the keys across tabs.
    page.fill("#admin-key", ADMIN)
    page.check("#remember")
    page.click("#key-form button[type=submit]")
    expect(page.locator("#guard-error")).to_be_hidden()
    assert page.evaluate("localStorage.getItem('mlx-headroom.adminKey')") == ADMIN
    assert page.evaluate("sessionStorage.length") == 0
    # A wrong key is reported, not shown as a state.
    page.fill("#admin-key", "wrong")
    page.fill("#api-key", "")
    page.click("#key-form button[type=submit]")
    expect(page.locator("#alert")).to_contain_text("401")
    expect(page.locator("#g-apply")).to_be_disabled()
    expect(page.locator("#guard-form")).to_be_hidden()
    # The only console errors are the browser's own notes of the refused requests.
    assert tab.errors and all("status of 401" in e or "status of 403" in e for e in tab.errors), tab.errors
