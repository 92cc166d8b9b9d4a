"""The context a model may be served at, from its config (engine.context), table-driven.

The configs are real models' rope settings: Qwen2.5's documented yarn extension, Llama 3.1's
llama3 scaling (already stretched), Phi-3's longrope, a linear and a dynamic NTK config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.context import ContextLengthSettingError, context_limits

QWEN25_YARN = {"max_position_embeddings": 32768,
               "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
LLAMA31 = {"max_position_embeddings": 131072,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
PHI3_LONGROPE = {"max_position_embeddings": 131072,
                 "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0],
                                  "original_max_position_embeddings": 4096}}
LINEAR = {"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}}
DYNAMIC = {"max_position_embeddings": 2048, "rope_scaling": {"type": "dynamic", "factor": 4.0}}
PLAIN = {"max_position_embeddings": 8192}
MROPE = {"max_position_embeddings": 32768,
         "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}


@pytest.mark.parametrize(("config", "longest"), [
    (QWEN25_YARN, 131072),
    (LLAMA31, 131072),  # 8 x 8192 = 65536 < its own 131072
    (PHI3_LONGROPE, 131072),
    (LINEAR, 8192),  # no original: max_position_embeddings is the trained length
    (DYNAMIC, 8192),
    (PLAIN, 8192),
    (MROPE, 32768),  # multimodal sections, not a stretch
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "yarn", "factor": 1.0}}, 4096),
    ({"max_position_embeddings": 4096, "rope_scaling": None}, 4096),
])
def test_the_longest_context_a_models_rope_reaches(config: dict[str, Any], longest: int) -> None:
    limits = context_limits(config, config["max_position_embeddings"])
    assert limits.longest == longest
    assert limits.served(None, model="m") == config["max_position_embeddings"]
    assert limits.served(longest, model="m") == longest
    assert limits.served(256, model="m") == 256  # lowering: always


def test_plain_rope_refuses_any_raise_naming_its_context() -> None:
    with pytest.raises(ContextLengthSettingError) as exc:
        context_limits(PLAIN, 8192).served(8193, model="tiny")
    message = str(exc.value)
    assert "--context-length 8193 exceeds tiny's context of 8192 tokens" in message
    assert "no scaling" in message and "At most 8192." in message


def test_a_scaled_rope_refuses_beyond_factor_times_original() -> None:
    with pytest.raises(ContextLengthSettingError) as exc:
        context_limits(QWEN25_YARN, 32768).served(131073, model="qwen")
    message = str(exc.value)
    assert "its context is 32768 tokens" in message
    assert "yarn RoPE scaling (factor 4 over 32768 original positions)" in message
    assert "At most 131072." in message


def test_a_context_below_one_is_refused() -> None:
    with pytest.raises(ContextLengthSettingError, match="at least 1"):
        context_limits(PLAIN, 8192).served(0, model="tiny")


def test_a_hub_model_in_the_cache_is_refused_without_falling_back_to_the_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """read_model_spec on a hub id found in the Hugging Face cache: a context its RoPE cannot
    reach is the answer, not a reason to try the headers over HTTP (no network here)."""
    import huggingface_hub.constants

    from engine.model_spec import read_model_spec
    from engine.tiny_model import build_tiny_model

    repo = tmp_path / "hub" / "models--acme--tiny"
    build_tiny_model(repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert read_model_spec("acme/tiny", context_length=1024).context_length == 1024
    with pytest.raises(ContextLengthSettingError, match="acme/tiny's context of 8192 tokens"):
        read_model_spec("acme/tiny", context_length=8193)
