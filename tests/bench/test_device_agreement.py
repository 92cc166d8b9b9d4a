"""The device-agreement benchmark's arithmetic, on recorded nvidia-smi lines and samples."""

from __future__ import annotations

from bench.device_agreement import driver_bytes_for, parse_compute_apps, summarise

MiB = 1 << 20


def test_parses_nvidia_smi_compute_apps() -> None:
    text = "4242, 138000 MiB\n777, 512 MiB\n9, [N/A]\n\n"
    assert parse_compute_apps(text) == {4242: 138000 * MiB, 777: 512 * MiB}


def test_matches_our_pid_or_the_only_app() -> None:
    assert driver_bytes_for({4242: 5, 777: 6}, 4242) == (5, "pid")
    assert driver_bytes_for({99_001: 7}, 4242) == (7, "only_app")  # a container's host pid
    assert driver_bytes_for({1: 1, 2: 2}, 4242) == (None, "not_found")
    assert driver_bytes_for({}, 4242) == (None, "no_apps")


def test_summary_reports_peak_against_ceiling_and_agreement() -> None:
    samples = [
        {"phase": "c64", "usage_bytes": 100, "ceiling_bytes": 200, "driver_bytes": 102},
        {"phase": "c64", "usage_bytes": 150, "ceiling_bytes": 200, "driver_bytes": 180},
        {"phase": "c64", "usage_bytes": 90, "ceiling_bytes": 200},  # no driver reading
    ]
    s = summarise(samples)
    assert s["peak_usage_bytes"] == 150 and s["peak_driver_bytes"] == 180
    assert s["driver_peak_under_ceiling"] is True and s["samples_driver_over_ceiling"] == 0
    assert s["agreement_samples"] == 2
    assert s["agreement_max_rel_err"] == round(30 / 180, 4)
    assert s["agreement_within_goal"] == 0.5
    assert "peak_driver_bytes" not in summarise(samples[2:])
