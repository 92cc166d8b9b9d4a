"""How the prefix cache names a block: the digest of its chain (its parent's digest and its
own tokens). Both the cache in memory and the disk tier key their blocks by it."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence as Seq

import numpy as np

ChainKey = bytes  # the digest of a block chain: names a prefix of whole and partial blocks

ROOT: ChainKey = b""


def chain_digest(parent: ChainKey, tokens: Seq[int]) -> ChainKey:
    """The key of a block whose tokens are `tokens`, after the chain `parent`. Stable
    across processes (the disk tier names its files by it)."""
    data = np.asarray(tokens, dtype="<i8").tobytes()
    return hashlib.blake2b(parent + data, digest_size=16).digest()
