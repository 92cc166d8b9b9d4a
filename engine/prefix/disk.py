"""The prefix cache's disk tier: blocks evicted from memory, kept in a directory.

A full block that leaves memory (admission or the ceiling evicted it, or the server shuts
down) is written as one safetensors file, named by its chain key (the hash of its block
chain, `engine.prefix.keys.chain_digest`), under a folder named by the model's identity:

    <dir>/<identity>/<chain key hex>.safetensors
        k.<layer>, v.<layer>: the block's rows of each layer, as the store holds them
        metadata: format, model identity, key, parent key, the block's tokens

A later lookup that runs out of cached blocks in memory goes on through the files, and a
hit reads them back into the request's own blocks, when reading is faster than
prefilling them (`worth_reading`). The files survive restarts.

Both sides of that decision are measured on the machine. Reading: at start, a few files
of the tier's own block shape are written and read back as a hit reads them (`mx.load`,
evaluated), which counts each file's own cost as well as its bytes; then the reads the
hits make. Prefilling: the engine's fitted cost line. A restarted process has measured
neither yet, so the folder keeps both in `calibration.json` at shutdown, and the next
process starts from them.

Trust. The identity hashes the format version, the model's config, its weight files'
names, sizes and modification times, and the KV layout (layers, heads, dims, dtype,
quantization, block size): a file from another model or layout sits in another folder,
and a file moved into the wrong folder fails the metadata check. A file is written to a
temporary name and renamed, so a crash leaves no torn file under a real name. A file that
cannot be parsed, or whose metadata, tokens or shapes do not match what the lookup
expects, is removed and never loaded; the request prefills those tokens instead. The
tensors' bytes are not checksummed: a bit flipped inside the data would go unnoticed.

Size. The folder is capped (`max_bytes`); the least recently used files go first (a file
read back is touched).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.kv.store import KVStore
from engine.prefix.keys import ChainKey

log = logging.getLogger("mlx_headroom.engine")

FORMAT = "mlx-headroom-prefix/1"
SUFFIX = ".safetensors"
PROBE_BYTES = 8 << 20  # real reads of at least this much replace the start-up measurement
PROBE_FILES = 4
CALIBRATION = "calibration.json"


def model_identity(model_path: str, layout: dict[str, Any]) -> str:
    """A model's identity for the disk tier: the format, its config, its weight files'
    names, sizes and mtimes (hashing gigabytes of weights at every start would cost more
    than it protects), and the KV layout. Another model, other weights or another layout
    give another identity."""
    h = hashlib.sha256(FORMAT.encode())
    h.update(json.dumps(layout, sort_keys=True).encode())
    path = Path(model_path)
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    for f in files:
        if f.is_file() and (f.name == "config.json" or f.suffix in (".safetensors", ".gguf", ".npz")):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
            if f.name == "config.json":
                h.update(f.read_bytes())
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class DiskStats:
    bytes: int
    blocks: int
    max_bytes: int
    written: int
    hits: int  # blocks read back
    rejected: int  # files found damaged or foreign, removed
    read_bytes_per_s: float
    prefill_tokens_per_s: float | None


class DiskTier:
    def __init__(self, root: str | os.PathLike[str], identity: str, *, max_bytes: int,
                 block_size: int, row_shape: tuple[tuple[int, int], mx.Dtype], num_layers: int) -> None:
        self.identity = identity
        self.dir = Path(root) / identity
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.block_size = block_size
        (heads, width), self.dtype = row_shape
        self.shape = (block_size, heads, width)
        self.num_layers = num_layers
        self.block_bytes = 2 * num_layers * block_size * heads * width * self.dtype.size
        self._files: OrderedDict[ChainKey, int] = OrderedDict()  # key -> file size, least recent first
        self._bytes = 0
        self.written = self.hits = self.rejected = 0
        self._read_s = 0.0
        self._read_bytes = 0
        self._scan()
        self.calibration = self._load_calibration()
        saved = self.calibration.get("read_bytes_per_s")
        self.read_bytes_per_s = float(saved) if saved else self._measure_read()

    # ---- what is there ---------------------------------------------------------------
    def _scan(self) -> None:
        found = []
        for f in self.dir.iterdir():
            if f.name == CALIBRATION:
                continue
            if f.suffix != SUFFIX:
                f.unlink(missing_ok=True)  # a write that never finished, or a stray file
                continue
            try:
                key = bytes.fromhex(f.stem)
                st = f.stat()
            except (ValueError, OSError):
                f.unlink(missing_ok=True)
                continue
            found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self._files[key] = size
            self._bytes += size
        self._enforce_cap()

    def _measure_read(self) -> float:
        """Bytes per second reading blocks as a hit reads them: files of this tier's block
        shape, written here, then loaded and evaluated (a stand-in until real reads are
        timed: a file just written may come from the page cache, as the spilled files of a
        restart may too)."""
        names = [f"{kv}.{i}" for kv in "kv" for i in range(self.num_layers)]
        block = {n: mx.zeros(self.shape, self.dtype) for n in names}
        probes = [self.dir / f"read-probe-{i}.tmp{SUFFIX}" for i in range(PROBE_FILES)]
        try:
            for p in probes:
                mx.save_safetensors(str(p), block)
            started = time.perf_counter()
            for p in probes:
                mx.eval(list(mx.load(str(p)).values()))
            return PROBE_FILES * self.block_bytes / max(time.perf_counter() - started, 1e-6)
        finally:
            for p in probes:
                p.unlink(missing_ok=True)

    # ---- what the next process starts from -------------------------------------------
    def _load_calibration(self) -> dict[str, Any]:
        path = self.dir / CALIBRATION
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT or data.get("model") != self.identity:
                raise ValueError("not this tier's")
            rate, prefill = data.get("read_bytes_per_s"), data.get("prefill")
            if not (isinstance(rate, (int, float)) and rate > 0) or not isinstance(prefill, dict | None):
                raise ValueError("not a read rate and a cost line")
            return data
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("prefix cache: ignoring and removing %s: %s", path, exc)
            path.unlink(missing_ok=True)
            return {}

    def save_calibration(self, prefill: dict[str, float] | None) -> None:
        """Keep what this process measured for the next: the read rate of its real reads
        (or the one it started from) and the prefill cost line's state."""
        data: dict[str, Any] = {"format": FORMAT, "model": self.identity,
                                "read_bytes_per_s": self.bytes_per_s,
                                "prefill": prefill or self.calibration.get("prefill")}
        path = self.dir / CALIBRATION
        tmp = path.with_name(CALIBRATION + ".tmp")
        try:
            tmp.write_text(json.dumps(data))
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            log.warning("prefix cache: could not write %s: %s", path, exc)

    def __contains__(self, key: object) -> bool:
        return key in self._files

    @property
    def nbytes(self) -> int:
        return self._bytes

    def path(self, key: ChainKey) -> Path:
        return self.dir / f"{key.hex()}{SUFFIX}"

    # ---- the decision ----------------------------------------------------------------
    def worth_reading(self, blocks: int, prefill_s: float | None) -> bool:
        """Is reading `blocks` blocks faster than prefilling their tokens, which the caller
        predicts takes `prefill_s` (it knows the context they attend)? Reading speed is what
        reads took so far (the start-up probe before any). With no prefill measured yet
        (None), reading wins."""
        if blocks <= 0:
            return False
        if prefill_s is None:
            return True
        return blocks * self.block_bytes / self.bytes_per_s < prefill_s

    @property
    def bytes_per_s(self) -> float:
        if self._read_bytes >= PROBE_BYTES:
            return self._read_bytes / max(self._read_s, 1e-9)
        return self.read_bytes_per_s

    # ---- writing ---------------------------------------------------------------------
    def write(self, key: ChainKey, parent: ChainKey, tokens: Seq[int], arrays: list[mx.array]) -> None:
        """Keep one full block: `arrays` holds each layer's keys, then each layer's values."""
        if key in self._files:
            self._files.move_to_end(key)
            return
        if len(tokens) != self.block_size or self.block_bytes > self.max_bytes:
            return
        names = [f"k.{i}" for i in range(self.num_layers)] + [f"v.{i}" for i in range(self.num_layers)]
        metadata = {"format": FORMAT, "model": self.identity, "key": key.hex(), "parent": parent.hex(),
                    "tokens": json.dumps(list(tokens))}
        final = self.path(key)
        tmp = final.with_name(f"{key.hex()}.tmp{SUFFIX}")  # MLX keeps the suffix it needs
        try:
            mx.save_safetensors(str(tmp), dict(zip(names, arrays, strict=True)), metadata=metadata)
            os.replace(tmp, final)
            size = final.stat().st_size
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            log.warning("prefix cache: could not write %s: %s", final, exc)
            return
        self._files[key] = size
        self._bytes += size
        self.written += 1
        self._enforce_cap()

    # ---- reading ---------------------------------------------------------------------
    def read(self, key: ChainKey, parent: ChainKey, tokens: Seq[int]) -> list[mx.array] | None:
        """The block's arrays (each layer's keys, then values), evaluated; None when the file
        is missing, damaged, or not this block of this model: such a file is removed."""
        path = self.path(key)
        started = time.perf_counter()
        try:
            loaded, meta = mx.load(str(path), return_metadata=True)  # type: ignore[misc]
            expected = {"format": FORMAT, "model": self.identity, "key": key.hex(),
                        "parent": parent.hex(), "tokens": json.dumps(list(tokens))}
            if any(meta.get(k) != v for k, v in expected.items()):
                raise ValueError("not this block of this model")
            arrays = [loaded[f"{kv}.{i}"] for kv in "kv" for i in range(self.num_layers)]
            if any(a.shape != self.shape or a.dtype != self.dtype for a in arrays):
                raise ValueError("shapes or dtype differ from the store's")
            mx.eval(arrays)
        except Exception as exc:  # a damaged or foreign file of any kind: never used
            self.rejected += 1
            log.warning("prefix cache: ignoring and removing %s: %s", path.name, exc)
            self.remove(key)
            return None
        self._read_s += time.perf_counter() - started
        self._read_bytes += self.block_bytes
        self.hits += 1
        self._files.move_to_end(key)
        os.utime(path)  # recency survives a restart
        return arrays

    def freshen(self, key: ChainKey) -> None:
        """Make a file the most recently used, here and in its time (which a restart reads)."""
        if key in self._files:
            self._files.move_to_end(key)
            os.utime(self.path(key))

    def remove(self, key: ChainKey) -> None:
        self._bytes -= self._files.pop(key, 0)
        self.path(key).unlink(missing_ok=True)

    def stats(self, prefill_tokens_per_s: float | None) -> DiskStats:
        return DiskStats(self._bytes, len(self._files), self.max_bytes, self.written, self.hits,
                         self.rejected, round(self.bytes_per_s, 1), prefill_tokens_per_s)

    def _enforce_cap(self) -> None:
        while self._files and self._bytes > self.max_bytes:
            self.remove(next(iter(self._files)))



def open_disk_tier(root: str, max_bytes: int, model_path: str, store: KVStore) -> DiskTier:
    """The disk tier of `store`'s blocks for the model at `model_path`, in `root`."""
    geo = store.geometry
    (heads, width), dtype = geo.row_shape
    layout = {"layers": geo.num_layers, "kv_heads": geo.num_kv_heads, "head_dim": geo.head_dim,
              "dtype": str(geo.dtype), "kv_bits": geo.kv_bits, "kv_group_size": geo.kv_group_size,
              "row": [heads, width, str(dtype)], "block_size": store.block_size}
    disk = DiskTier(root, model_identity(model_path, layout), max_bytes=max_bytes,
                    block_size=store.block_size, row_shape=geo.row_shape, num_layers=geo.num_layers)
    log.info("prefix cache disk tier %s: %d blocks (%d bytes, at most %d); reading at %.0f MB/s",
             disk.dir, len(disk._files), disk.nbytes, max_bytes, disk.read_bytes_per_s / 1e6)
    return disk
