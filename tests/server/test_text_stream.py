"""`server.text_stream.ChoiceText`: the text it has released, read at any point, is every
delta it returned so far, joined, and a stop string never reaches it."""

from __future__ import annotations

from server.text_stream import ChoiceText


class _Letters:
    """A detokenizer whose token t decodes to three copies of a letter."""

    last_segment = ""

    def add_token(self, token: int) -> None:
        self.last_segment = chr(ord("a") + token % 26) * 3

    def finalize(self) -> None:
        self.last_segment = "."


class _Tokenizer:
    @property
    def detokenizer(self) -> _Letters:
        return _Letters()


def test_the_text_is_every_delta_joined_whenever_it_is_read() -> None:
    text = ChoiceText(_Tokenizer(), [])
    deltas = []
    for token in range(2000):
        deltas.append(text.add((token,)).text)
        if token in (0, 1, 999):
            assert text.text == "".join(deltas)
    deltas.append(text.finish().text)
    assert text.text == "".join(deltas)
    assert len(text.text) == 2000 * 3 + 1
    assert text.completion_tokens == 2000


def test_a_stop_string_ends_the_text_before_it() -> None:
    text = ChoiceText(_Tokenizer(), ["ccc"])
    deltas = [text.add((t,)).text for t in range(5)]
    assert text.stopped and text.matched_stop == "ccc"
    assert text.text == "".join(deltas) == "aaabbb"
