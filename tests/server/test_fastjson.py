"""The SSE hot path's encoder: valid JSON, one line per event, whatever the client sent."""

from __future__ import annotations

import json

from server.fastjson import dumps


def test_line_break_characters_are_escaped_so_an_event_stays_one_line() -> None:
    # Found by the fuzz test: a tool schema key with U+2028 split a Responses event in two for
    # a client that splits the stream with str.splitlines().
    value = {"k": "a\u2028b\x85c\u2029d", "e": "é"}
    text = dumps(value).decode()
    assert len(text.splitlines()) == 1
    assert json.loads(text) == value
    assert "é" in text  # other non-ASCII stays raw UTF-8


def test_integers_beyond_64_bits_are_written() -> None:
    assert json.loads(dumps({"n": 2**70})) == {"n": 2**70}
