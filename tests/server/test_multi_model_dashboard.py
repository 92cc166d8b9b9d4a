"""The dashboard's models card in a real browser, against a server with several models."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
from playwright.sync_api import expect

from tests.server.test_dashboard_browser import Tab, browser, open_tab  # noqa: F401 (fixtures)
from tests.server.test_multi_model import complete, models_dir, start  # noqa: F401 (fixture)


def test_the_models_card_shows_each_models_state(models_dir: Path, tmp_path: Path,  # noqa: F811
                                                 open_tab: Callable[..., Tab]) -> None:  # noqa: F811
    proc = start(models_dir, tmp_path)
    try:
        assert complete(proc, "beta").status_code == 200
        tab = open_tab(proc.url)
        page = tab.page
        expect(page.locator("#models-card")).to_be_visible()
        expect(page.locator('#models tr[data-model="beta"] td.state')).to_have_text("loaded")
        expect(page.locator('#models tr[data-model="gamma"] td.state')).to_have_text("unloaded")
        beta = next(m for m in httpx.get(proc.url + "/v1/memory").json()["models"]["models"]
                    if m["id"] == "beta")
        assert beta["weight_bytes"] > 0
        expect(page.locator('#models tr[data-model="beta"] td').nth(2)).to_have_text(
            f"{beta['weight_bytes'] / 2**20:.2f} MiB")
        assert tab.errors == []
    finally:
        proc.stop()
