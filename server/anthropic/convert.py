"""Anthropic messages -> the chat messages a Hugging Face chat template renders.

The result is in the OpenAI chat shape that chat templates expect: `system`, `user`,
`assistant` (with `tool_calls` for tool_use blocks) and `tool` (one per tool_result,
with `tool_call_id`). System entries inside `messages` (Claude Code sends them) are folded
into the one system prompt, in order. Thinking blocks from earlier turns are dropped: they
are the model's scratch work, not the conversation. Images and PDFs are refused by name:
the served model reads text only.
"""

from __future__ import annotations

import json
from typing import Any

from server.anthropic.schemas import (
    DocumentBlock,
    ImageBlock,
    Message,
    PromptFields,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from server.errors import BadRequest


def _unservable(block: ImageBlock | DocumentBlock, model: str, where: str) -> BadRequest:
    what = "images" if isinstance(block, ImageBlock) else "documents other than plain text"
    return BadRequest(
        f"{where} is an {block.type} block, but the served model '{model}' reads text only "
        f"and cannot take {what}; send the content as text instead",
        code="unsupported_content", param="messages",
    )


def _document_text(block: DocumentBlock) -> str | None:
    source = block.source or {}
    if source.get("type") == "text" and isinstance(source.get("data"), str):
        title = f"{block.title}\n" if block.title else ""
        return title + source["data"]
    return None


def _block_text(block: Any, model: str, where: str) -> str:
    """The text of a text or document block; images and binary documents are refused."""
    if isinstance(block, TextBlock):
        return block.text
    if isinstance(block, DocumentBlock) and (text := _document_text(block)) is not None:
        return text
    raise _unservable(block, model, where)


def _text_of(parts: list[Any], model: str, where: str) -> str:
    return "\n".join(_block_text(p, model, f"{where}.content[{i}]") for i, p in enumerate(parts))


def _tool_result(block: ToolResultBlock, model: str, where: str) -> dict[str, Any]:
    content = block.content
    text = content if isinstance(content, str) else _text_of(content or [], model, where)
    if block.is_error:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}


def _tool_call(block: ToolUseBlock) -> dict[str, Any]:
    return {
        "id": block.id,
        "type": "function",
        "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)},
    }


def _turn(message: Message, model: str, index: int) -> list[dict[str, Any]]:
    """One user or assistant message as chat messages (tool results become `tool` turns)."""
    where = f"messages[{index}]"
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append(_tool_call(block))
        elif isinstance(block, ToolResultBlock):
            out.append(_tool_result(block, model, f"{where}.content[{i}]"))
        elif isinstance(block, ThinkingBlock | RedactedThinkingBlock):
            continue
        else:
            texts.append(_block_text(block, model, f"{where}.content[{i}]"))
    if texts or calls or not out:
        turn: dict[str, Any] = {"role": message.role, "content": "\n".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def system_text(body: PromptFields, model: str) -> str:
    """The system prompt, with any `role: system` messages folded in, in order."""
    parts: list[str] = []
    if isinstance(body.system, str):
        parts.append(body.system)
    elif body.system:
        parts.extend(block.text for block in body.system)
    for index, message in enumerate(body.messages):
        if message.role == "system":
            content = message.content
            parts.append(content if isinstance(content, str)
                         else _text_of(list(content), model, f"messages[{index}]"))
    return "\n\n".join(p for p in parts if p)


def to_chat(body: PromptFields, model: str) -> list[dict[str, Any]]:
    """The request's conversation; `model` is the served model's name, for error messages."""
    messages: list[dict[str, Any]] = []
    if system := system_text(body, model):
        messages.append({"role": "system", "content": system})
    for index, message in enumerate(body.messages):
        if message.role != "system":
            messages.extend(_turn(message, model, index))
    if len(messages) == (1 if system else 0):
        raise BadRequest("messages holds no user or assistant turn", param="messages")
    return messages
