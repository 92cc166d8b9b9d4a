"""GGUF file -> mlx-lm model directory, written atomically into the conversion cache.

The directory is keyed by the file's sha256 and the weights' dtype:
``<cache>/<sha256[:16]>-<dtype>/`` holds ``config.json``, ``model*.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``. It is built in a
temporary sibling and renamed into place, so a crash or a refused file leaves nothing a later
start would take for a finished conversion. A conversion made by an older converter
(``converter_version`` in ``mlx_headroom_gguf.json``) is not taken either: it may hold what a
later fix changed (a tokenizer, a config field), so it is converted again and replaced.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from engine.gguf.archs import architecture_of
from engine.gguf.reader import GGUFError, GGUFFile, open_gguf
from engine.gguf.tokenizer import build_tokenizer, tokenizer_config

log = logging.getLogger("mlx_headroom.engine")

CONVERTER_VERSION = 2  # raise it when a conversion's output changes: older ones are redone
SHARD_BYTES = 2 * 2**30
CACHE_ENV = "MLX_HEADROOM_GGUF_CACHE"
_DTYPES = ("float32", "bfloat16", "float16")


def gguf_cache_dir() -> Path:
    """``$MLX_HEADROOM_GGUF_CACHE``, else ``gguf/`` under the project's cache directory."""
    from engine.tiny_model import default_cache_dir

    override = os.environ.get(CACHE_ENV)
    return Path(override) if override else default_cache_dir() / "gguf"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(8 * 2**20):
            digest.update(block)
    return digest.hexdigest()


def _memo_path() -> Path:
    return gguf_cache_dir() / "hashes.json"


def remembered_sha256(path: Path) -> str | None:
    """The sha256 of a file converted before, if it has not changed since (size, mtime)."""
    try:
        memo = json.loads(_memo_path().read_text())
        size, mtime, sha256 = memo[str(path.resolve())]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    st = path.stat()
    return str(sha256) if (size, mtime) == (st.st_size, st.st_mtime_ns) else None


def _remember_sha256(path: Path, sha256: str) -> None:
    """Note a converted file's hash, so the next start finds its conversion without hashing."""
    memo_path = _memo_path()
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    st = path.stat()
    memo[str(path.resolve())] = [st.st_size, st.st_mtime_ns, sha256]
    tmp = memo_path.with_name(f".{memo_path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(memo, indent=1))
    os.replace(tmp, memo_path)


def gguf_sha256(path: Path, progress: Callable[[str], None] = log.info) -> str:
    sha256 = remembered_sha256(path)
    if sha256 is None:
        progress(f"hashing {path}")
        sha256 = file_sha256(path)
    return sha256


def converted_dir(sha256: str, dtype: str) -> Path:
    return gguf_cache_dir() / f"{sha256[:16]}-{dtype}"


def is_converted(path: Path) -> bool:
    """``path`` holds a complete conversion made by this converter version."""
    try:
        marker = json.loads((path / "mlx_headroom_gguf.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("converter_version") == CONVERTER_VERSION


def _replace(target: Path, new: Path) -> None:
    """Rename ``new`` to ``target``, moving an older conversion there out of the way first."""
    stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
    if target.exists() and not is_converted(target):
        with contextlib.suppress(FileNotFoundError):  # another process moved it already
            target.rename(stale)
    new.rename(target)
    shutil.rmtree(stale, ignore_errors=True)


def find_gguf(model: str) -> Path | None:
    """The GGUF file ``model`` names: a ``.gguf`` file, or a directory holding exactly one."""
    path = Path(model)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise GGUFError(f"{path} holds several GGUF files ({', '.join(f.name for f in found)}): "
                            "name one")
        return found[0] if found else None
    return None


def ensure_converted(gguf_path: Path, *, dtype: str, sha256: str | None = None,
                     progress: Callable[[str], None] = log.info) -> Path:
    """The converted directory of ``gguf_path``, converting it first if it is not cached."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r}: one of {', '.join(_DTYPES)}")
    remember = sha256 is None
    if sha256 is None:
        sha256 = gguf_sha256(gguf_path, progress)
    target = converted_dir(sha256, dtype)
    if is_converted(target):
        if remember:
            _remember_sha256(gguf_path, sha256)
        return target
    progress(f"converting {gguf_path} to an MLX model in {target} (first use only)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        convert_gguf(open_gguf(gguf_path), tmp, dtype=dtype, sha256=sha256)
        tmp.chmod(0o755)  # mkdtemp made it private
        try:
            _replace(target, tmp)
        except OSError:  # another process finished first
            if not is_converted(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if remember:
        _remember_sha256(gguf_path, sha256)
    return target


def mlx_config(g: GGUFFile, dtype: str) -> dict[str, Any]:
    """``config.json`` for the file, with no tensor read (load admission sizes from this)."""
    arch = architecture_of(g)
    g.check_types()
    config = arch.config(g)
    _, eos_ids = tokenizer_config(g, arch.chat_template, arch.extra_eos, config["max_position_embeddings"])
    bos = g.metadata.get("tokenizer.ggml.bos_token_id")
    return config | {"torch_dtype": dtype, "bos_token_id": bos, "eos_token_id": eos_ids}


def weight_names(g: GGUFFile) -> dict[str, str]:
    """GGUF tensor name -> mlx-lm weight name, for every tensor the model keeps."""
    arch = architecture_of(g)
    if "rope_freqs.weight" in g.tensors and "rope_freqs.weight" not in arch.skip:
        raise GGUFError(f"{g.path}: RoPE frequency factors (rope_freqs.weight) are not supported "
                        f"for {g.architecture} by the converter")
    return {name: arch.hf_name(name) for name in g.tensors if name not in arch.skip}


def convert_gguf(g: GGUFFile, out: Path, *, dtype: str, sha256: str) -> None:
    """Write the mlx-lm model directory for ``g`` into ``out`` (which exists and is empty)."""
    import mlx.core as mx

    arch = architecture_of(g)
    config = mlx_config(g, dtype)
    names = weight_names(g)
    tok = build_tokenizer(g)  # before the weights: a bad vocabulary fails fast
    target = getattr(mx, dtype)
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for gguf_name, hf_name in names.items():
        array = arch.fix(g, gguf_name, g.tensor(gguf_name))
        if not np.all(np.isfinite(array)):
            raise GGUFError(f"{g.path}: tensor {gguf_name} holds non-finite values (corrupted?)")
        if size and size + array.size * target.size > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][hf_name] = mx.array(array).astype(target)
        mx.eval(shards[-1][hf_name])
        size += array.size * target.size
    index: dict[str, str] = {}
    for i, shard in enumerate(shards):
        name = ("model.safetensors" if len(shards) == 1
                else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        mx.save_safetensors(str(out / name), shard, metadata={"format": "mlx"})
        index |= dict.fromkeys(shard, name)
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}, indent=1))
    tok.save(str(out / "tokenizer.json"))
    tok_config, eos_ids = tokenizer_config(g, arch.chat_template, arch.extra_eos,
                                           config["max_position_embeddings"])
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": eos_ids}, indent=2))
    (out / "mlx_headroom_gguf.json").write_text(json.dumps({  # written last: marks it complete
        "converter_version": CONVERTER_VERSION, "source": str(g.path), "sha256": sha256,
        "architecture": g.architecture, "name": g.metadata.get("general.name"), "dtype": dtype,
    }, indent=2))
