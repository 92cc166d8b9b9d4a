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

Reading. A hit reads its blocks a run at a time (`read_blocks`): each file's safetensors
header is parsed and checked here, its tensors' bytes are copied straight into one host
buffer for the whole run, and the run becomes one array on the device, which the store
writes with one update per layer (`KVStore.load_blocks`). Loading each file with `mx.load`
and writing it block by block made every block 2 × layers arrays and as many updates (and,
on a GPU, as many small copies to the device): on a 2-core CPU VM, 256 blocks of an 8B
model's shape (537 MB, on a RAM disk) took 1.8-2.1 s to read back that way, and 1.2 s a run
at a time, where reading the files' bytes alone took 0.35-0.41 s.

Both sides of that decision are measured on the machine. Reading: at start, a few files
of the tier's own block shape are written and read back as a hit reads them, which counts
each file's own cost as well as its bytes; then the reads the hits make. Prefilling: the
engine's fitted cost line. A restarted process has measured neither yet, so the folder
keeps both in `calibration.json` at shutdown, and the next process starts from them.

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
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.kv.store import KVStore
from engine.prefix.keys import ChainKey

log = logging.getLogger("mlx_headroom.engine")

FORMAT = "mlx-headroom-prefix/1"
SUFFIX = ".safetensors"
PROBE_BYTES = 8 << 20  # real reads of at least this much replace the start-up measurement
PROBE_FILES = 4
CALIBRATION = "calibration.json"
# A store row's dtype as safetensors names it, and the numpy type its bytes are copied as
# (numpy has no bfloat16: its bytes travel as uint16 and are viewed as bfloat16 on arrival).
_FILE_DTYPES: dict[mx.Dtype, tuple[str, Any]] = {
    mx.bfloat16: ("BF16", np.uint16), mx.float16: ("F16", np.float16),
    mx.float32: ("F32", np.float32), mx.uint32: ("U32", np.uint32),
}
MAX_HEADER_BYTES = 1 << 20
IOV_MAX = 1024  # buffers one preadv takes (Linux's and macOS's limit)
# One block of a run: its chain key, its parent's, and its tokens.
DiskBlock = tuple[ChainKey, ChainKey, Seq[int]]


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
        # a block file's tensors: each layer's keys, then each layer's values
        self._names = [f"{kv}.{i}" for kv in "kv" for i in range(num_layers)]
        self._name_set = frozenset(self._names)
        self.block_bytes = 2 * num_layers * block_size * heads * width * self.dtype.size
        self._files: OrderedDict[ChainKey, int] = OrderedDict()  # key -> file size, least recent first
        self._bytes = 0
        self.written = self.hits = self.rejected = 0
        self._read_s = 0.0
        self._read_bytes = 0
        self._buffer: np.ndarray | None = None  # the host buffer runs are read into
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
        shape, written here, then read back as one run (a stand-in until real reads are
        timed: a file just written may come from the page cache, as the spilled files of a
        restart may too)."""
        block = [mx.zeros(self.shape, self.dtype) for _ in range(2 * self.num_layers)]
        probes = [self.dir / f"read-probe-{i}.tmp{SUFFIX}" for i in range(PROBE_FILES)]
        metas = [self._metadata(f"probe-{i}".encode(), b"", ()) for i in range(PROBE_FILES)]
        try:
            for p, meta in zip(probes, metas, strict=True):
                mx.save_safetensors(str(p), dict(zip(self._names, block, strict=True)), metadata=meta)
            started = time.perf_counter()
            kv = self._read_run(list(zip(probes, metas, strict=True)))[0]
            mx.eval(kv)
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
        metadata = self._metadata(key, parent, tokens)
        final = self.path(key)
        tmp = final.with_name(f"{key.hex()}.tmp{SUFFIX}")  # MLX keeps the suffix it needs
        try:
            mx.save_safetensors(str(tmp), dict(zip(self._names, arrays, strict=True)), metadata=metadata)
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
    def read_blocks(self, blocks: Seq[DiskBlock]) -> mx.array | None:
        """The leading blocks of `blocks` whose files pass their checks, as one evaluated
        array [2 × layers, n × block_size, heads, width] (each layer's keys, then values);
        None when the first fails. Reading stops at the first file that is missing,
        damaged, or not that block of this model: it is removed, and the caller prefills
        from there."""
        started = time.perf_counter()
        kv, n = self._read_run([(self.path(k), self._metadata(k, p, t)) for k, p, t in blocks])
        if n < len(blocks):
            self.rejected += 1
            self.remove(blocks[n][0])
        if kv is None:
            return None
        mx.eval(kv)
        self._read_s += time.perf_counter() - started
        self._read_bytes += n * self.block_bytes
        self.hits += n
        for key, _, _ in blocks[:n]:
            self._files.move_to_end(key)
            os.utime(self.path(key))  # recency survives a restart
        return kv

    def _read_run(self, files: list[tuple[Path, dict[str, str]]]) -> tuple[mx.array | None, int]:
        """Files of consecutive blocks, with the metadata each must carry, read into one
        host buffer and then copied to one array; the count read stops at the first bad file."""
        code, np_type = _FILE_DTYPES[self.dtype]
        rows, elements = 2 * self.num_layers, int(np.prod(self.shape))
        if self._buffer is None or self._buffer.shape[1] < len(files):
            # Kept between runs (`release_buffer` ends that): a fresh buffer pays a page
            # fault per 4 KiB on first touch, about as slow as the read on a VM.
            self._buffer = np.empty((rows, len(files), elements), dtype=np_type)
        buffer = self._buffer[:, : len(files)]
        n = 0
        for path, expected in files:
            try:
                self._read_file(path, expected, code, buffer[:, n])
            except Exception as exc:  # a damaged or foreign file of any kind: never used
                log.warning("prefix cache: ignoring and removing %s: %s", path.name, exc)
                break
            n += 1
        if n == 0:
            return None, 0
        heads, width = self.shape[1:]
        kv = mx.array(np.ascontiguousarray(buffer[:, :n]).reshape(rows, n * self.block_size, heads, width))
        return (kv.view(self.dtype) if kv.dtype != self.dtype else kv), n

    def release_buffer(self) -> None:
        """Give back the host buffer that runs are read into (a hit's read-back ends)."""
        self._buffer = None

    def _read_file(self, path: Path, expected: dict[str, str], code: str, out: np.ndarray) -> None:
        """Check one block file's header and metadata, and read each tensor's bytes straight
        into its row of `out` ([2 × layers, elements]); raises on anything unexpected."""
        fd = os.open(path, os.O_RDONLY)
        try:
            (header_len,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            if header_len > MAX_HEADER_BYTES:
                raise ValueError("not a block file's header")
            header = json.loads(os.pread(fd, header_len, 8))
            meta = header.pop("__metadata__", None) or {}
            if any(meta.get(k) != v for k, v in expected.items()):
                raise ValueError("not this block of this model")
            if header.keys() != self._name_set:
                raise ValueError("not the store's layers")
            size = out.shape[1] * out.itemsize
            spans = []
            for row, name in enumerate(self._names):
                t = header[name]
                begin, end = t["data_offsets"]
                if t["dtype"] != code or t["shape"] != list(self.shape) or end - begin != size:
                    raise ValueError("shapes or dtype differ from the store's")
                spans.append((begin, row))
            spans.sort()
            if [begin for begin, _ in spans] != [i * size for i in range(len(spans))]:
                raise ValueError("tensors do not tile the data")
            # one scatter read: each tensor's bytes land in its own row, in file order
            views = [memoryview(out[row]).cast("B") for _, row in spans]
            for at in range(0, len(views), IOV_MAX):
                part = views[at : at + IOV_MAX]
                if os.preadv(fd, part, 8 + header_len + at * size) != len(part) * size:
                    raise ValueError("the file ends early")
        finally:
            os.close(fd)

    def _metadata(self, key: ChainKey, parent: ChainKey, tokens: Seq[int]) -> dict[str, str]:
        return {"format": FORMAT, "model": self.identity, "key": key.hex(), "parent": parent.hex(),
                "tokens": json.dumps(list(tokens))}

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
