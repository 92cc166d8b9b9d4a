"""What ``--model`` names resolve to: ``default`` is Gemma 3 270M where the ``[gemma]`` extra is
installed and the tiny model where it is not; Gemma's first use logs its terms of use."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.gguf import CACHE_ENV
from engine.gguf import packaged as packaged_module
from engine.named_models import (
    DEFAULT_MODEL,
    GEMMA_MODEL,
    TINY_MODEL,
    TINY_MODEL_ID,
    default_choice,
    public_name,
    resolve_source,
)


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("MLX_HEADROOM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_default_is_gemma_when_installed_else_the_tiny_model(
        empty_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from server.settings import Settings

    assert Settings.model_fields["model"].default == DEFAULT_MODEL  # `serve` without --model
    assert packaged_module.packaged_gemma_available()  # the test extra installs it
    assert default_choice() == GEMMA_MODEL
    assert public_name(DEFAULT_MODEL) == packaged_module.GEMMA_MODEL_ID == "google/gemma-3-270m"
    monkeypatch.setattr(packaged_module, "packaged_gemma_available", lambda: False)  # not installed
    assert default_choice() == TINY_MODEL
    assert public_name(DEFAULT_MODEL) == TINY_MODEL_ID
    source, name = resolve_source(DEFAULT_MODEL, progress=lambda _: None)
    assert name == TINY_MODEL_ID and Path(source).parent == empty_cache
    assert (Path(source) / "config.json").is_file()
    assert resolve_source(TINY_MODEL, progress=lambda _: None) == (source, TINY_MODEL_ID)


def test_gemma_s_first_use_logs_its_terms_before_anything_else(empty_cache: Path) -> None:
    messages: list[str] = []

    class Stop(Exception):
        pass

    def progress(message: str) -> None:
        messages.append(message)
        if message.startswith("assembling"):
            raise Stop  # the terms came first; the conversion itself is tests/engine/test_gguf.py's

    with pytest.raises(Stop):
        resolve_source(GEMMA_MODEL, progress=progress)
    assert messages[0] == ("Gemma 3 270M (google/gemma-3-270m) is provided under and subject to the "
                           "Gemma Terms of Use: https://ai.google.dev/gemma/terms")
    assert not any((empty_cache / "gguf").iterdir())  # the assembling folder is gone


def test_a_directory_holding_one_gguf_is_that_file(empty_cache: Path, tmp_path: Path) -> None:
    from engine.gguf import GGUFError
    from engine.tiny_model import build_tiny_model
    from tests.engine.gguf_files import LLAMA3_WRITER, write_gguf

    folder = tmp_path / "downloads"
    folder.mkdir()
    write_gguf(build_tiny_model(tmp_path / "tiny"), folder / "tiny.gguf", LLAMA3_WRITER, arch="llama")
    by_file = resolve_source(str(folder / "tiny.gguf"), progress=lambda _: None)
    by_folder = resolve_source(str(folder), progress=lambda _: None)
    assert by_folder == (by_file[0], str(folder)) and Path(by_file[0]).parent == empty_cache / "gguf"
    (folder / "other.gguf").write_bytes((folder / "tiny.gguf").read_bytes())
    with pytest.raises(GGUFError, match=r"holds several GGUF files \(other.gguf, tiny.gguf\): name one"):
        resolve_source(str(folder), progress=lambda _: None)
