"""Responses input items -> the chat conversation the template knows.

- `message` items stay messages. System and developer messages before the first turn
  join the system prompt; later ones (agents add them mid-conversation) become user
  text, since many templates refuse a system turn anywhere but first. Consecutive user
  messages are joined, for templates that insist on alternating roles.
- `function_call` and `custom_tool_call` items become the assistant's `tool_calls`
  (namespaced names flattened as the tools are), joined to the assistant turn before them;
  `function_call_output` and `custom_tool_call_output` items become `tool` messages.
- `additional_tools` items add their tools to the request's tools.
- `reasoning` items: their text (the `reasoning_text` content this server emits, else the
  summaries) joins the assistant turn that follows, as `reasoning_content` (Qwen3's and
  most thinking templates' field) and `thinking` (gpt-oss's); the template decides whether
  to render it (Qwen3 drops it before the last user query, gpt-oss keeps the analysis
  between a call and its output). Reasoning that no assistant turn follows before the next
  user or tool turn, and `encrypted_content` (this server issues none), are skipped.
- Calls of hosted tools, `item_reference` and unknown types are skipped; their type names
  are collected for the log, never their text.
- Images: this server's models take none. An image beside text is dropped; a user turn
  that is only images is refused (`ImageOnlyInput`), since the image is its point.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from server.responses.toolset import Toolset

_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")
_IMAGE_PARTS = ("input_image", "image_url", "image")


class ImageOnlyInput(ValueError):
    """The latest user turn is only images, and the model takes none."""


@dataclass
class Conversation:
    system: list[str] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    images_dropped: int = 0
    pending_reasoning: list[str] = field(default_factory=list)  # for the next assistant turn


def _parts_text(content: Any, conv: Conversation) -> tuple[str, int]:
    """(the text of a content field, how many images it held)."""
    if isinstance(content, str):
        return content, 0
    if not isinstance(content, list):
        return "", 0
    texts, images = [], 0
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in _IMAGE_PARTS:
            images += 1
        else:
            conv.ignored.append(f"content:{kind}")
    return "".join(texts), images


def _output_text(output: Any, conv: Conversation) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        text, images = _parts_text(output, conv)
        conv.images_dropped += images
        return text
    if isinstance(output, dict):  # {content, success} from older clients
        return str(output.get("content") or "")
    return "" if output is None else json.dumps(output)


def _reasoning_text(item: dict[str, Any], conv: Conversation) -> str:
    """A reasoning item's text: its `reasoning_text` content (what this server emits), else
    its summaries, one paragraph each. Empty for another server's `encrypted_content`."""
    text, _ = _parts_text(item.get("content"), conv)
    if text.strip():
        return text
    summary = item.get("summary")
    parts = summary if isinstance(summary, list) else []
    return "\n\n".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)
                       and p["text"].strip())


def _fold_reasoning(conv: Conversation, message: dict[str, Any]) -> None:
    """Give the waiting reasoning to the assistant turn it led to."""
    if conv.pending_reasoning:
        earlier = [message["reasoning_content"]] if message.get("reasoning_content") else []
        message["reasoning_content"] = "\n\n".join(earlier + conv.pending_reasoning)
        conv.pending_reasoning.clear()


def _drop_reasoning(conv: Conversation) -> None:
    """Reasoning that led to no assistant turn (an interrupted turn) belongs to no later one."""
    if conv.pending_reasoning:
        conv.ignored.append("reasoning")
        conv.pending_reasoning.clear()


def with_reasoning(message: dict[str, Any], text: str) -> None:
    """An assistant message's reasoning under the names templates read: `reasoning_content`
    (Qwen3, GLM, ...) and `thinking` (gpt-oss). gpt-oss's template refuses a call message
    with both content and thinking (it renders that content as the analysis), so there the
    message gets no `thinking`."""
    message["reasoning_content"] = text
    if not (message.get("content") and message.get("tool_calls")):
        message["thinking"] = text


def _add(conv: Conversation, role: str, text: str) -> None:
    if role != "assistant":
        _drop_reasoning(conv)
    last = conv.messages[-1] if conv.messages else None
    if role == "user" and last is not None and last["role"] == "user" and "tool_call_id" not in last:
        last["content"] = f"{last['content']}\n\n{text}" if last["content"] else text
    else:
        conv.messages.append({"role": role, "content": text})
    if role == "assistant":
        _fold_reasoning(conv, conv.messages[-1])


def _add_call(conv: Conversation, call: dict[str, Any]) -> None:
    last = conv.messages[-1] if conv.messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        conv.messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    _fold_reasoning(conv, conv.messages[-1])


def to_conversation(items: list[Any], toolset: Toolset) -> Conversation:
    conv = Conversation()
    last_user_images_only = False
    for item in items:
        if not isinstance(item, dict):
            conv.ignored.append(type(item).__name__)
            continue
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            text, images = _parts_text(item.get("content"), conv)
            conv.images_dropped += images
            if role in ("system", "developer"):
                if conv.messages:
                    _add(conv, "user", text)
                else:
                    conv.system.append(text)
            elif role in ("user", "assistant"):
                last_user_images_only = role == "user" and images > 0 and not text.strip()
                _add(conv, role, text)
            else:
                conv.ignored.append(f"message:{role}")
        elif kind in ("function_call", "custom_tool_call"):
            last_user_images_only = False
            name, namespace = str(item.get("name") or ""), item.get("namespace")
            flat = toolset.template_name(name, namespace if isinstance(namespace, str) else None)
            if kind == "function_call":
                arguments = item.get("arguments")
                arguments = arguments if isinstance(arguments, str) else json.dumps(arguments or {})
            else:
                arguments = json.dumps({"input": str(item.get("input") or "")}, ensure_ascii=False)
            _add_call(conv, {"id": str(item.get("call_id") or item.get("id") or ""), "type": "function",
                             "function": {"name": flat, "arguments": arguments}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            _drop_reasoning(conv)
            conv.messages.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                                  "content": _output_text(item.get("output"), conv)})
        elif kind == "additional_tools":
            for tool in item.get("tools") or []:
                toolset.add(tool)
        elif kind == "reasoning":
            text = _reasoning_text(item, conv)
            if text.strip():
                conv.pending_reasoning.append(text)
            else:
                conv.ignored.append("reasoning")
        else:
            conv.ignored.append(str(kind))
    _drop_reasoning(conv)
    for message in conv.messages:
        if message.get("reasoning_content"):
            with_reasoning(message, message["reasoning_content"])
    if last_user_images_only:
        raise ImageOnlyInput(
            "the last user message is only images, and this model takes no image input; "
            "send text, or serve a model that reads images")
    return conv
