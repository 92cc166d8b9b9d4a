"""server.model_fit.admit_load in-process: what happens when a model cannot be sized."""

from __future__ import annotations

from pathlib import Path

import pytest

from memory import AllocatorProbe
from server.model_fit import LoadRefused, admit_load
from server.settings import Settings


def test_a_model_that_cannot_be_sized_is_refused_unless_forced(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')  # no weight files
    with pytest.raises(LoadRefused, match=r"cannot size the model.*--force-load loads it unchecked") as e:
        admit_load(Settings(model=str(tmp_path)), AllocatorProbe())
    assert e.value.exit_code == 3  # a failed start-up, not "does not fit" (4)
    assert admit_load(Settings(model=str(tmp_path), force_load=True), AllocatorProbe()) is None
    assert admit_load(Settings(model=str(tmp_path), memory_guard=False), AllocatorProbe()) is None


def test_with_the_guard_off_a_model_that_does_not_fit_is_reported_not_refused() -> None:
    settings = Settings(model="tiny", load_format="dummy", memory_guard=False,
                        memory_tier="custom", memory_ceiling_bytes=1_000_000)
    admission = admit_load(settings, AllocatorProbe())
    assert admission is not None
    assert not admission.reserve_met and not admission.checked and not admission.forced


class BrokenProbe:
    def read(self) -> object:
        raise OSError("host_statistics64 failed: -307")


def test_a_probe_that_cannot_read_refuses_the_load_unless_forced() -> None:
    with pytest.raises(LoadRefused, match=r"cannot read this machine \(host_statistics64"):
        admit_load(Settings(model="tiny", load_format="dummy"), BrokenProbe())  # type: ignore[arg-type]
    forced = Settings(model="tiny", load_format="dummy", force_load=True)
    assert admit_load(forced, BrokenProbe()) is None  # type: ignore[arg-type]
