"""The GIL's switch interval (`--gil-switch-interval-ms`, default 1 ms): the engine thread
and the event loop share one GIL, and a thread that wants it back waits up to this long
before the holder is made to let go. The engine sets it when it starts and logs the value
it reads back, so the log says what the process really runs with."""

from __future__ import annotations

import json

import httpx
import pytest


def _logged_interval_ms(log: str) -> list[float]:
    found = []
    for line in log.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "gil_switch_interval_ms" in record:
            found.append(record["gil_switch_interval_ms"])
    return found


def test_the_server_runs_with_the_interval_it_was_given(start_server) -> None:  # type: ignore[no-untyped-def]
    proc = start_server(args=["--gil-switch-interval-ms", "0.7"])
    assert _logged_interval_ms(proc.log()) == [0.7]
    r = httpx.post(f"{proc.url}/v1/completions",
                   json={"model": "mlx-headroom/tiny-chat", "prompt": "hi", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200, r.text


def test_the_default_is_one_millisecond_and_the_environment_sets_it_too(server, start_server) -> None:  # type: ignore[no-untyped-def]
    assert _logged_interval_ms(server.log()) == [1.0]  # the shared server runs on the defaults
    from_env = start_server(env={"MLX_HEADROOM_GIL_SWITCH_INTERVAL_MS": "2.5"})
    assert _logged_interval_ms(from_env.log()) == [2.5]


@pytest.mark.parametrize("value", ["0", "-1", "500"])
def test_an_interval_out_of_range_is_refused_before_loading(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    from server.cli import main

    assert main(["serve", "--gil-switch-interval-ms", value]) == 2
    assert "gil_switch_interval_ms" in capsys.readouterr().err
