"""Where a prompt's prefill leaves a resume point for later prompts that share its head.

A cache whose state cannot be cut back to an earlier position (recurrent state, a sliding
window's ring) can resume a later prompt only where a copy of it was taken. Copies are
kept at the boundaries k · `every` tokens with k a power of two, and at the two last
boundaries before the prompt's end (where a shared system prompt or an agent's earlier
turns end): an N-token prompt leaves about log2(N / every) + 2 of them, and a prompt that
parts from it after d tokens resumes from at least d / 2 of them, or from the nearest
boundary when it parts within the last two. `engine.dense.prefix` snapshots mlx-lm's
caches there; the paged store copies its window rings there (`KVStore.hold_prefix`).
"""

from __future__ import annotations


def keeps_checkpoint(tokens: int, prompt_len: int, every: int) -> bool:
    """Whether the boundary at `tokens` of a prompt of `prompt_len` tokens is kept."""
    if every <= 0 or tokens <= 0 or tokens % every or tokens >= prompt_len - 1:
        return False
    k, last = tokens // every, (prompt_len - 2) // every
    return k & (k - 1) == 0 or k >= last - 1


def checkpoints_between(start: int, end: int, prompt_len: int, every: int) -> list[int]:
    """The kept boundaries in (start, end]: those a chunk from `start` to `end` passes."""
    if every <= 0:
        return []
    first = (start // every + 1) * every
    return [b for b in range(first, end + 1, every) if keeps_checkpoint(b, prompt_len, every)]
