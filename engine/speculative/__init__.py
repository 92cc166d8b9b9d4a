"""Speculative decoding, exact: drafts from the row's own text (prompt lookup), verified as
one chunk per row through the prefill path inside continuous batching."""

from engine.speculative.lookup import NgramIndex
from engine.speculative.speculator import METHODS, SpeculativeConfig, Speculator, default_max_rows
from engine.speculative.verify import ChunkRow, Verified, accepted_length, verify

__all__ = [
    "METHODS",
    "ChunkRow",
    "NgramIndex",
    "SpeculativeConfig",
    "Speculator",
    "Verified",
    "accepted_length",
    "default_max_rows",
    "verify",
]
