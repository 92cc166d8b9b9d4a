"""doctor's macOS advice and its terminal rendering, from hand-made readings (no Mac here)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from memory import Ceiling, Tier
from server.doctor import macos_view, render

GiB = 1 << 30


def ceiling(binding: str, **components: int) -> Ceiling:
    return Ceiling(components[binding], binding, MappingProxyType(components), Tier.BALANCED)


def mac_report(mac: dict[str, Any], c: Ceiling) -> dict[str, Any]:
    snapshot = {"total_bytes": 64 * GiB, "footprint_bytes": GiB, "free_bytes": 30 * GiB,
                "inactive_bytes": 4 * GiB, "active_bytes": 20 * GiB, "wired_bytes": 3 * GiB,
                "device_cap_bytes": c.components["device"]}
    return {
        "backend": {"name": "metal", "device": "Device(gpu, 0)",
                    "device_info": {"device_name": "Apple M3 Max", "memory_size": 64 * GiB}},
        "probes": {"macos": {"ok": True, "snapshot": snapshot},
                   "allocator": {"ok": False, "error": "OSError: no"}},
        "ceiling": {"probe": "auto", "tier": "balanced", "hard_bytes": c.hard_bytes,
                    "binding": c.binding, "components": dict(c.components)},
        "macos": mac, "model": None, "ok": False, "problems": ["probe 'allocator' failed: no"],
    }


def test_a_binding_default_wired_limit_gets_a_sysctl_computed_for_this_machine() -> None:
    # 64 GiB Mac, wired limit unset: MLX's recommended working set (48 GiB) binds
    c = ceiling("device", static=58 * GiB, dynamic=60 * GiB, device=48 * GiB)
    mac = macos_view(c, 0, 48 * GiB)
    assert mac["wired_limit_binds"] and mac["raise_wired_limit_mb"] == 58 * 1024
    assert mac["sysctl"] == "sudo sysctl iogpu.wired_limit_mb=59392"
    text = render(mac_report(mac, c))
    assert "iogpu.wired_limit_mb 0 (default); MLX recommended working set 48.0 GiB" in text
    assert "the wired limit binds; to raise it: sudo sysctl iogpu.wired_limit_mb=59392 (58.0 GiB)" in text
    assert "ceiling   48.0 GiB, device binds" in text
    assert "allocator FAILED: OSError: no" in text and text.endswith("not ok")


def test_no_sysctl_when_the_wired_limit_does_not_bind() -> None:
    c = ceiling("dynamic", static=58 * GiB, dynamic=40 * GiB, device=60 * GiB)
    mac = macos_view(c, 61440, 48 * GiB)
    assert not mac["wired_limit_binds"] and mac["sysctl"] is None
    text = render(mac_report(mac, c))
    assert "iogpu.wired_limit_mb 61440;" in text and "sudo sysctl" not in text


def test_doctor_says_whether_metal_is_usable(monkeypatch) -> None:
    import engine.device_report as device_report
    from server.doctor import collect
    from server.settings import Settings

    failing = device_report.DeviceReport("metal", "Device(gpu, 0)", True, False,
                                         "RuntimeError: [METAL] Command buffer execution failed")
    monkeypatch.setattr(device_report, "device_report", lambda: failing)
    report = collect(Settings(memory_probe="allocator"), model=None, max_tokens=None)
    assert report["backend"]["metal_available"] and not report["backend"]["metal_usable"]
    assert not report["ok"]
    assert any("Metal is available but not usable" in p for p in report["problems"])
    text = render(report)
    assert "Metal available but not usable (RuntimeError: [METAL]" in text.splitlines()[1]
