"""Stored responses (store=true), so that `previous_response_id` can continue them.

Bounded by count and by bytes (the JSON size of what is kept); the oldest entries go
first. Only the HTTP side's event loop touches it, so it needs no lock. Nothing is
written to disk: a restart forgets every stored response, which callers see as an
unknown `previous_response_id`.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as returned
    conversation: list[dict[str, Any]]  # chat messages up to and including this output
    nbytes: int


class ResponseStore:
    def __init__(self, *, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep it if it fits at all; evict the oldest until the bounds hold."""
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        if self.max_entries == 0 or size > self.max_bytes:
            return False
        key = response["id"]
        if key in self._entries:
            self.nbytes -= self._entries.pop(key).nbytes
        self._entries[key] = StoredResponse(response, conversation, size)
        self.nbytes += size
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
        return True

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
        return entry is not None
