"""`serve` turns off MLX's CUDA cache-thrashing abort unless the operator sets it
(server.mlx_env): the lifetime miss count behind it is crossed by any long-lived server
that sees many prompt shapes. Real servers on the tiny model report what they run with."""

from __future__ import annotations

import httpx

from server.mlx_env import DEFAULTS, apply_defaults


def test_defaults_fill_only_what_the_environment_leaves_unset() -> None:
    env = {"PATH": "/bin"}
    apply_defaults(env)
    assert env == {"PATH": "/bin", "MLX_ENABLE_CACHE_THRASHING_CHECK": "0"}
    own = {"MLX_ENABLE_CACHE_THRASHING_CHECK": "1"}
    apply_defaults(own)
    assert own == {"MLX_ENABLE_CACHE_THRASHING_CHECK": "1"}


def test_the_server_runs_with_the_check_off(server) -> None:
    assert httpx.get(server.url + "/v1/version").json()["mlx_env"] == DEFAULTS


def test_the_operators_own_setting_is_kept(start_server) -> None:
    srv = start_server(env={"MLX_ENABLE_CACHE_THRASHING_CHECK": "1"})
    assert httpx.get(srv.url + "/v1/version").json()["mlx_env"] == {"MLX_ENABLE_CACHE_THRASHING_CHECK": "1"}
