"""Token ids → text for one choice: streaming detokenization and stop strings.

Text that could be the beginning of a stop string is held back until it is clearly not,
so a stop string never reaches the client, streamed or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine import TokenLogprob


@dataclass
class TextDelta:
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stopped: bool = False  # a stop string was found: the request must end now


class ChoiceText:
    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self._detok = tokenizer.detokenizer
        self._stops = stops
        self._holdback = max((len(s) for s in stops), default=1) - 1
        self._pending = ""
        self._released: list[str] = []  # everything released so far, joined on read: a
        # `+=` per token would copy the whole text each time, on the event loop's thread
        self.completion_tokens = 0
        self.stopped = False
        self.matched_stop: str | None = None  # which stop string ended the text, if one did

    @property
    def text(self) -> str:
        if len(self._released) > 1:
            self._released[:] = ["".join(self._released)]
        return self._released[0] if self._released else ""

    def add(self, tokens: tuple[int, ...], logprobs: tuple[TokenLogprob, ...] = ()) -> TextDelta:
        if self.stopped:
            return TextDelta("", stopped=True)
        for token in tokens:
            self._detok.add_token(token)
        self.completion_tokens += len(tokens)
        self._pending += self._detok.last_segment
        return self._release(list(logprobs), final=False)

    def finish(self) -> TextDelta:
        if self.stopped:
            return TextDelta("", stopped=True)
        self._detok.finalize()
        self._pending += self._detok.last_segment
        return self._release([], final=True)

    def _release(self, logprobs: list[TokenLogprob], *, final: bool) -> TextDelta:
        if self._stops:
            found = [(i, s) for s in self._stops if (i := self._pending.find(s)) >= 0]
            if found:
                cut, self.matched_stop = min(found, key=lambda f: f[0])
                out = self._pending[:cut]
                self._pending = ""
                self._released.append(out)
                self.stopped = True
                return TextDelta(out, logprobs, stopped=True)
        keep = 0 if final else self._holdback
        split = max(len(self._pending) - keep, 0)
        out, self._pending = self._pending[:split], self._pending[split:]
        self._released.append(out)
        return TextDelta(out, logprobs)
