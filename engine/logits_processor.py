"""Per-request logit shaping that needs state: a grammar constraint and repetition penalties.

A request that uses neither carries no processor and costs the sampler nothing. One that
does carries a `LogitsProcessor`, built on the HTTP side (grammar compilation happens
there, off the engine thread) and mutated only by the engine thread once submitted:
the decode batch hands every sampled token to `accept`, and the sampler asks for the
next token's mask and penalties.

The grammar side is library-agnostic: anything with `fill_bitmask` and `accept` (see
`TokenConstraint`) will do; `engine.grammar` provides the llguidance implementation.
The bitmask layout is llguidance's and xgrammar's: int32 words, bit `t % 32` of word
`t // 32` set when token `t` is allowed.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class TokenConstraint(Protocol):
    """The next-token mask of one request's grammar, advanced token by token."""

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the allowed-token bitmask (int32 words) for the next token into `out`."""

    def accept(self, token: int) -> None:
        """The token was sampled: advance the grammar past it."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class LogitsProcessor:
    """One request's mutable logit state: optional constraint, frequency and presence
    penalties over the tokens generated so far (OpenAI's definition: subtract
    `count * frequency_penalty + (count > 0) * presence_penalty` from each logit)."""

    __slots__ = ("accepted", "constraint", "counts", "frequency_penalty", "presence_penalty")

    def __init__(
        self,
        *,
        constraint: TokenConstraint | None = None,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
    ) -> None:
        self.constraint = constraint
        self.frequency_penalty = frequency_penalty
        self.presence_penalty = presence_penalty
        self.counts: dict[int, int] = {}
        self.accepted = 0

    @property
    def penalized(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def accept(self, token: int) -> None:
        self.accepted += 1
        if self.constraint is not None:
            self.constraint.accept(token)
        if self.penalized:
            self.counts[token] = self.counts.get(token, 0) + 1

    def penalties(self) -> tuple[list[int], list[float]]:
        """Token ids and the amounts to subtract from their logits."""
        ids = list(self.counts)
        values = [
            c * self.frequency_penalty + self.presence_penalty for c in self.counts.values()
        ]
        return ids, values

    def __repr__(self) -> str:
        return (
            f"LogitsProcessor(constraint={type(self.constraint).__name__ if self.constraint else None}, "
            f"frequency_penalty={self.frequency_penalty}, presence_penalty={self.presence_penalty}, "
            f"accepted={self.accepted})"
        )
