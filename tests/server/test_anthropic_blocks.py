"""Generated text -> Anthropic blocks, streamed in any split, without a server."""

from __future__ import annotations

import json

import pytest

from server.anthropic.blocks import BlockStream, whole_content
from server.tools import FunctionTool, ToolCallParser, ToolSyntax

HERMES = ToolSyntax.for_tokenizer(object())  # Hermes <tool_call> JSON, as the tiny model writes
TOOLS = [FunctionTool("f", parameters={"type": "object"})]
ARGS_1 = '{"path": "a}b", "n": [1, {"x": "}"}]}'
ARGS_2 = '{"y":2}'
OUTPUT = (f'Let me look.\n<tool_call>\n{{"name": "f", "arguments": {ARGS_1}}}\n</tool_call>\n'
          f'<tool_call>\n{{"name":"f","arguments":{ARGS_2}}}\n</tool_call>')


def run(text: str, size: int) -> list[tuple[str, dict]]:
    stream = BlockStream(ToolCallParser(HERMES, TOOLS))
    chunks = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    events = []
    for i, chunk in enumerate(chunks):
        events += stream.feed(chunk, final=i == len(chunks) - 1)
    return events


def blocks_of(events: list[tuple[str, dict]]) -> list[dict]:
    """Accumulate events the way the SDKs do (input from the joined partial JSON)."""
    blocks: list[dict] = []
    raw: dict[int, str] = {}
    open_now = None
    for name, data in events:
        if name == "content_block_start":
            assert open_now is None and data["index"] == len(blocks)
            open_now = data["index"]
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            assert data["index"] == open_now
            delta = data["delta"]
            if delta["type"] == "text_delta":
                blocks[open_now]["text"] += delta["text"]
            else:
                raw[open_now] = raw.get(open_now, "") + delta["partial_json"]
        else:
            assert data["index"] == open_now
            open_now = None
    assert open_now is None
    for index, text in raw.items():
        blocks[index]["input"] = json.loads(text)
    return blocks


@pytest.mark.parametrize("size", [1, 2, 5, 13, len(OUTPUT)])
def test_any_split_gives_the_whole_messages_blocks(size):
    events = run(OUTPUT, size)
    blocks = blocks_of(events)
    assert [b["type"] for b in blocks] == ["text", "tool_use", "tool_use"]
    assert blocks[0]["text"] == "Let me look."
    assert blocks[1]["input"] == json.loads(ARGS_1) and blocks[2]["input"] == json.loads(ARGS_2)
    fragments = "".join(d["delta"]["partial_json"] for n, d in events
                        if n == "content_block_delta" and d["index"] == 1)
    assert fragments == ARGS_1  # the arguments exactly as written
    assert blocks[1]["id"].startswith("toolu_") and blocks[1]["id"] != blocks[2]["id"]
    whole = whole_content(BlockStream(ToolCallParser(HERMES, TOOLS)).feed(OUTPUT, final=True))
    assert [{k: v for k, v in b.items() if k != "id"} for b in whole] == \
        [{k: v for k, v in b.items() if k != "id"} for b in blocks]


def test_text_after_a_call_keeps_its_place():
    text = f'<tool_call>\n{{"name": "f", "arguments": {ARGS_2}}}\n</tool_call>\nDone.'
    for size in (1, 3, len(text)):
        assert [b["type"] for b in blocks_of(run(text, size))] == ["tool_use", "text"]


def test_a_call_cut_off_by_max_tokens_keeps_its_start():
    text = '<tool_call>\n{"name": "f", "arguments": {"n": 3, "path": "abc'
    whole = whole_content(BlockStream(ToolCallParser(HERMES, TOOLS)).feed(text, final=True))
    assert [(b["type"], b.get("name"), b.get("input")) for b in whole] == [("tool_use", "f", {"n": 3})]


def test_arguments_stream_before_the_call_ends():
    events = run(OUTPUT, 1)
    fragments = [d["delta"]["partial_json"] for n, d in events
                 if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert len(fragments) > len(ARGS_1) // 2


@pytest.mark.parametrize(("text", "types"), [
    ("", ["text"]),
    ("just words", ["text"]),
    (f'<tool_call>\n{{"name": "f", "arguments": {ARGS_2}}}\n</tool_call>', ["tool_use"]),
])
def test_blocks_open_as_content_arrives(text, types):
    for size in (1, 4, max(len(text), 1)):
        assert [b["type"] for b in blocks_of(run(text, size))] == types


def test_without_tools_all_is_text():
    stream = BlockStream(None)
    events = stream.feed("a <tool_call> b") + stream.feed("", final=True)
    assert blocks_of(events) == [{"type": "text", "text": "a <tool_call> b"}]
    assert whole_content(BlockStream(None).feed("", final=True)) == [{"type": "text", "text": ""}]
