"""The models ``--model`` names rather than points at, and GGUF files, resolved to directories.

- ``tiny``: the embedded tiny model (random weights, built on first use; tests use it);
- ``gemma-3-270m``: Gemma 3 270M from the ``[gemma]`` extra, converted from GGUF on first use;
- ``default`` (what ``serve`` loads without ``--model``): Gemma 3 270M when the ``[gemma]``
  extra is installed, else the tiny model;
- a ``.gguf`` file, or a directory holding one: converted once, cached by its hash
  (``engine.gguf``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("mlx_headroom.engine")

DEFAULT_MODEL = "default"
TINY_MODEL = "tiny"
GEMMA_MODEL = "gemma-3-270m"
TINY_MODEL_ID = "mlx-headroom/tiny-chat"


def default_choice() -> str:
    """What ``default`` means on this installation: Gemma 3 270M if installed, else tiny."""
    from engine.gguf.packaged import packaged_gemma_available

    return GEMMA_MODEL if packaged_gemma_available() else TINY_MODEL


def public_name(model: str) -> str:
    """The name a model is served under when no ``--served-model-name`` is given."""
    from engine.gguf.packaged import GEMMA_MODEL_ID

    named = default_choice() if model == DEFAULT_MODEL else model
    return {TINY_MODEL: TINY_MODEL_ID, GEMMA_MODEL: GEMMA_MODEL_ID}.get(named, model)


def gguf_dtype() -> str:
    """The dtype GGUF weights are converted to: float32 on the CPU (no bf16 BLAS), else bf16."""
    import mlx.core as mx

    return "float32" if mx.default_device() == mx.cpu else "bfloat16"


def resolve_source(model: str, *, progress: Callable[[str], None] = log.info) -> tuple[str, str]:
    """``(what mlx_lm.load reads, the public name)`` for a ``--model`` value."""
    if model == DEFAULT_MODEL:
        return resolve_source(default_choice(), progress=progress)
    if model == TINY_MODEL:
        from engine.tiny_model import ensure_default_model

        progress("building the embedded tiny model (first use only)")
        return str(ensure_default_model()), TINY_MODEL_ID
    if model == GEMMA_MODEL:
        from engine.gguf.packaged import GEMMA_MODEL_ID, ensure_packaged_gemma

        return str(ensure_packaged_gemma(gguf_dtype(), progress=progress)), GEMMA_MODEL_ID
    from engine.gguf import ensure_converted, find_gguf

    gguf = find_gguf(model)
    if gguf is not None:
        return str(ensure_converted(gguf, dtype=gguf_dtype(), progress=progress)), model
    return model, model


def local_directory(model: str) -> Path | None:
    """The directory ``model`` loads from if it is ready without building or converting."""
    from engine.gguf import converted_dir, find_gguf, is_converted
    from engine.gguf.convert import gguf_sha256

    if model == DEFAULT_MODEL:
        return local_directory(default_choice())
    if model == TINY_MODEL:
        from engine.tiny_model import ensure_default_model

        return ensure_default_model()  # cheap: a few hundred kilobytes, built in well under a second
    if model == GEMMA_MODEL:
        from engine.gguf.packaged import packaged_gemma_dir

        path = packaged_gemma_dir(gguf_dtype())
        return path if is_converted(path) else None
    gguf = find_gguf(model)
    if gguf is not None:
        path = converted_dir(gguf_sha256(gguf, lambda _: None), gguf_dtype())
        return path if is_converted(path) else None
    return None


def gguf_header(model: str) -> Path | None:
    """A file holding the GGUF header of ``model`` (not yet converted), or None if not GGUF."""
    if model == DEFAULT_MODEL:
        return gguf_header(default_choice())
    if model == GEMMA_MODEL:
        from engine.gguf.packaged import packaged_gemma_header

        return packaged_gemma_header()
    if model == TINY_MODEL:
        return None
    from engine.gguf import find_gguf

    return find_gguf(model)
