"""The engine's chunk size and concurrency cap default per MLX backend (`server.settings.
backend_defaults`), and every consumer reads the same resolved values: the engine's config
and load admission's mirror of it (`server.model_fit.engine_params`), the step's token
budget included."""

from __future__ import annotations

import pytest

from server.engine_config import engine_config
from server.model_fit import engine_params
from server.settings import Settings


@pytest.mark.parametrize(("backend", "chunk", "cap", "step"),
                         [("cuda", 2048, 64, 8192), ("metal", 512, 32, 512), ("cpu", 512, 32, 512)])
def test_defaults_follow_the_backend(monkeypatch: pytest.MonkeyPatch, backend: str, chunk: int,
                                     cap: int, step: int) -> None:
    monkeypatch.setattr("engine.loader.backend_name", lambda: backend)
    settings = Settings()
    resolved = (settings.prefill_step_size, settings.max_concurrency, settings.max_step_tokens)
    assert resolved == (chunk, cap, step)
    config = engine_config(settings)
    assert (config.prefill_step_size, config.max_concurrency, config.max_step_tokens) == (chunk, cap, step)
    params = engine_params(settings, backend, kv_bytes_per_token=4096, device_bytes=141 << 30)
    assert (params.chunk_tokens, params.step_tokens) == (chunk, step)


def test_an_explicit_setting_beats_the_backend_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("engine.loader.backend_name", lambda: "cuda")
    monkeypatch.setenv("MLX_HEADROOM_MAX_CONCURRENCY", "8")
    settings = Settings(prefill_step_size=512)
    assert (settings.prefill_step_size, settings.max_concurrency) == (512, 8)


def test_the_step_budget_follows_an_explicit_chunk_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four chunks per step on CUDA, whatever the chunk; an explicit budget stands."""
    monkeypatch.setattr("engine.loader.backend_name", lambda: "cuda")
    assert Settings(prefill_step_size=512).max_step_tokens == 2048
    assert Settings(prefill_step_size=512, max_step_tokens=600).max_step_tokens == 600
    monkeypatch.setattr("engine.loader.backend_name", lambda: "cpu")
    assert Settings(prefill_step_size=256).max_step_tokens == 256


@pytest.mark.parametrize(("backend", "stall_ms"), [("cuda", 100.0), ("metal", 100.0), ("cpu", 250.0)])
def test_the_decode_stall_target_follows_the_backend(monkeypatch: pytest.MonkeyPatch, backend: str,
                                                     stall_ms: float) -> None:
    """The engine gets it in seconds; 0 turns the bound off (only the token budget cuts)."""
    monkeypatch.setattr("engine.loader.backend_name", lambda: backend)
    assert Settings().max_decode_stall_ms == stall_ms
    assert engine_config(Settings()).max_decode_stall_s == stall_ms / 1000
    assert engine_config(Settings(max_decode_stall_ms=40)).max_decode_stall_s == 0.04
    assert engine_config(Settings(max_decode_stall_ms=0)).max_decode_stall_s is None


def test_the_decode_stall_target_is_a_serve_flag() -> None:
    from server.cli import _parser, settings_from_args

    args = _parser().parse_args(["serve", "--max-decode-stall-ms", "60"])
    assert engine_config(settings_from_args(args)).max_decode_stall_s == 0.06
