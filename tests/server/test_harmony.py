"""gpt-oss's Harmony output on its own: channels in any split become reasoning, answer
and calls; no marker leaks."""

from __future__ import annotations

import json

import pytest

from server.harmony import HarmonyParser, is_harmony

THINK = "<|channel|>analysis<|message|>Need the weather.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
        '<|message|>{"city": "Paris"}')
CALL_FIRST = ('<|start|>assistant to=functions.get_weather<|channel|>commentary json'
              '<|message|>{"city": "Paris"}')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"

# (output, tools in play) -> (reasoning, content, calls' arguments)
CASES = [
    (THINK + FINAL, False, "Need the weather.", "It is sunny.", []),
    (THINK + CALL, True, "Need the weather.", "", [{"city": "Paris"}]),
    (THINK + CALL_FIRST, True, "Need the weather.", "", [{"city": "Paris"}]),
    (THINK + PREAMBLE + CALL, True, "Need the weather.", "Let me check.", [{"city": "Paris"}]),
    (THINK + CALL, False, "Need the weather.", "", []),  # no tools: the call's body is dropped
    ("<|channel|>analysis<|message|>cut off here", False, "cut off here", "", []),
    ("<|channel|>final<|message|>a < b <| c", False, "", "a < b <| c", []),
]


@pytest.mark.parametrize("size", [1, 3, 8, 1000])
@pytest.mark.parametrize(("output", "tools", "reasoning", "content", "calls"), CASES)
def test_any_split_gives_the_same_channels(size, output, tools, reasoning, content, calls):
    parser = HarmonyParser(tools=tools)
    got_reasoning, got_text, got_calls, deltas = "", "", [], ""
    pieces = [parser.feed(output[i:i + size]) for i in range(0, len(output), size)]
    pieces.append(parser.finish())
    for piece in pieces:
        got_reasoning += piece.reasoning
        got_text += piece.text
        got_calls += piece.calls
        deltas += "".join(e.delta for e in piece.events if type(e).__name__ == "ArgumentsDelta")
    assert (got_reasoning, got_text) == (reasoning, content)
    assert [json.loads(c.arguments) for c in got_calls] == calls
    assert [c.name for c in got_calls] == ["get_weather"] * len(calls)
    if calls:
        assert json.loads(deltas) == calls[0]  # the arguments streamed as generated
    assert parser.reasoning == reasoning


def test_a_template_that_opened_the_final_channel_starts_in_the_answer():
    parser = HarmonyParser(tools=False, prompt_tail="<|start|>assistant<|channel|>final<|message|>")
    piece = parser.feed("Sunny.")
    piece.extend(parser.finish())
    assert (piece.reasoning, piece.text) == ("", "Sunny.")


def test_plain_text_without_a_header_is_content():
    parser = HarmonyParser(tools=False)
    text = "plain words " * 30
    piece = parser.feed(text)
    piece.extend(parser.finish())
    assert piece.text == text


class _Vocab:
    def __init__(self, tokens):
        self._tokens = tokens

    def get_vocab(self):
        return {t: i for i, t in enumerate(self._tokens)}


def test_harmony_is_recognised_by_its_markers():
    assert is_harmony(_Vocab(["<|channel|>", "<|message|>", "<|end|>", "<|start|>", "a"]))
    assert not is_harmony(_Vocab(["<think>", "</think>", "<|im_start|>"]))
