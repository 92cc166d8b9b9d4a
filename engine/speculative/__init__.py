"""Speculative decoding, exact: drafts from the row's own text (prompt lookup) or from a
smaller model (draft model), verified as one chunk per row through the prefill path inside
continuous batching."""

from engine.speculative.draft import DraftModel, DraftModelError, load_draft
from engine.speculative.lookup import NgramIndex
from engine.speculative.speculator import METHODS, SpeculativeConfig, Speculator, default_max_rows
from engine.speculative.verify import ChunkRow, Verified, accepted_length, verify

__all__ = [
    "METHODS",
    "ChunkRow",
    "DraftModel",
    "DraftModelError",
    "NgramIndex",
    "SpeculativeConfig",
    "Speculator",
    "Verified",
    "accepted_length",
    "default_max_rows",
    "load_draft",
    "verify",
]
