"""Block bookkeeping for one segment of the KV pool: a free list and reference counts.

Pure Python, no MLX: which blocks a request or a prefix-cache entry holds, and when a
block becomes free again. A block is shared by a prefix-cache entry and every request
that hit it; it returns to the free list when its last holder lets go (vLLM's rule).
"""

from __future__ import annotations


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # Lowest ids first, so a lightly used segment stays dense at its start.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs: list[int] = [0] * num_blocks

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """`n` fresh blocks, each held once; None when fewer than `n` are free."""
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
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
        # Pushed last to first, so that `allocate` hands a released run back in its order: a
        # request on consecutive blocks is attended as one slice (engine.kv.cache.DecodeTables).
        for b in reversed(blocks):
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} released more often than held")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
                freed += 1
        return freed

    def refs(self, block: int) -> int:
        return self._refs[block]
