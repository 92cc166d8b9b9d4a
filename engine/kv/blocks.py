"""Block bookkeeping for one segment of the KV pool: which blocks are free, and reference counts.

Pure Python, no MLX: which blocks a request or a prefix-cache entry holds, and when a
block becomes free again. A block is shared by a prefix-cache entry and every request
that hit it; it returns to the free list when its last holder lets go (vLLM's rule).

Why runs. A lone decoding row whose blocks are consecutive is attended as one slice of the
pool, by MLX's fused SDPA (engine.kv.attention.run_decode); on one H200 machine that took
C=1 serving from about 160 to 181 tok/s (docs/throughput.md; on a slower host
it lost, hence engine.slice_choice). A free list handed out in release order gave a
request after any concurrent load pieces of several earlier requests' runs, so the slice
never fired in a server that had been busy. So `allocate` takes the lowest run of free
blocks that is long enough (first fit), and only when no such run exists, the lowest free
blocks wherever they are.
"""

from __future__ import annotations

_FREE = 1
_HELD = 0


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # One byte per block, so that bytearray.find looks for a run of free blocks at C speed
        # (a pool of 70k blocks, an H200's, is searched in microseconds).
        self._is_free = bytearray([_FREE]) * num_blocks
        self._free_count = num_blocks
        self._refs: list[int] = [0] * num_blocks

    @property
    def free(self) -> int:
        return self._free_count

    @property
    def used(self) -> int:
        return self.num_blocks - self._free_count

    def allocate(self, n: int, after: int | None = None) -> list[int] | None:
        """`n` fresh blocks, each held once; None when fewer than `n` are free.

        The blocks right after block `after` if they are all free (a request extending a
        cached prefix then stays one run), else the lowest run of `n` free blocks, else the
        lowest `n` free blocks."""
        if n > self._free_count:
            return None
        if n <= 0:
            return []
        run = bytes([_FREE]) * n
        start = -1
        if after is not None and self._is_free[after + 1: after + 1 + n] == run:
            start = after + 1
        if start < 0:
            start = self._is_free.find(run)
        if start >= 0:
            out = list(range(start, start + n))
            self._is_free[start: start + n] = bytes(n)
        else:
            out = []
            at = 0
            while len(out) < n:
                at = self._is_free.find(_FREE, at)
                out.append(at)
                self._is_free[at] = _HELD
                at += 1
        self._free_count -= n
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is free; only held blocks can be shared")
            self._refs[b] += 1

    def release(self, blocks: list[int]) -> int:
        """Drop one hold on each block; returns how many became free."""
        freed = 0
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} released more often than held")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._is_free[b] = _FREE
                freed += 1
        self._free_count += freed
        return freed

    def refs(self, block: int) -> int:
        return self._refs[block]


def consecutive(blocks: list[int]) -> bool:
    """Blocks that are one run of consecutive ids: their slots are one slice of the pool."""
    return blocks == list(range(blocks[0], blocks[0] + len(blocks)))
