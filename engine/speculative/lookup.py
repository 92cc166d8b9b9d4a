"""Prompt lookup: drafts taken from a row's own text, with no model of their own.

A row's last n tokens (n from `max_ngram` down to `min_ngram`) are looked up among the
earlier n-grams of its prompt and output; the tokens that followed the latest earlier
occurrence are the draft. Editors and agents that echo code or text back hit often.

The index is incremental: per n, a dict from each n-gram to the position right after its
latest occurrence that has a continuation. Appending a token is one dict write per n; a
lookup is one dict read per n.
"""

from __future__ import annotations

from collections.abc import Iterable

MIN_NGRAM = 2
MAX_NGRAM = 4


class NgramIndex:
    def __init__(
        self, tokens: Iterable[int], *, min_ngram: int = MIN_NGRAM, max_ngram: int = MAX_NGRAM
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes {min_ngram}..{max_ngram}: need 1 <= min <= max")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        toks, after = self.tokens, self._after
        for t in tokens:
            p = len(toks)
            for n, index in after.items():
                if p >= n:
                    index[tuple(toks[p - n : p])] = p
            toks.append(t)

    def propose(self, k: int, last: int | None = None) -> tuple[int, ...]:
        """Up to `k` draft tokens to follow the indexed text, then `last` when given (a
        token known but not yet indexed: the row's next input). Empty when no n-gram of
        the tail occurred before."""
        if k <= 0:
            return ()
        toks = self.tokens
        keep = self.max_ngram - (last is not None)
        tail = toks[max(len(toks) - keep, 0):] + ([last] if last is not None else [])
        end = len(toks) + (last is not None)
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            key = tuple(tail[-n:])
            start = self._after[n].get(key)
            if start is None:
                continue
            # What followed runs to the end of the text, next input included: the text repeats
            # with that period (a loop, a list), so the draft goes on around it.
            period = toks[start:] + ([last] if last is not None else [])
            if start + k <= len(toks):
                return tuple(toks[start : start + k])
            return tuple(period[i % len(period)] for i in range(k))
        return ()
