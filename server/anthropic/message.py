"""A generation as Anthropic's `message` object, and its usage and stop reason."""

from __future__ import annotations

from typing import Any

from server.anthropic.blocks import BlockStream, whole_content
from server.generation import Generation
from server.reasoning import TextParser

STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


def usage(generation: Generation) -> dict[str, Any]:
    """Anthropic counts prompt tokens read from a cache apart from `input_tokens`; ours are
    the prefix cache's hits. Nothing is ever billed for writing it, so creation is 0."""
    choice = generation.choices[0]
    prompt = len(generation.prepared.prompt_tokens)
    return {
        "input_tokens": prompt - choice.cached_tokens,
        "output_tokens": choice.text.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": choice.cached_tokens,
        **generation.prepared.usage_note(),
        **{k: v for k, v in generation.speculation_usage().items() if k == "speculative"},
    }


def stop_fields(generation: Generation, *, tool_use: bool) -> dict[str, Any]:
    choice = generation.choices[0]
    matched = choice.text.matched_stop
    if matched is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": matched}
    finish = choice.finish_reason or "stop"
    if tool_use and finish == "stop":
        return {"stop_reason": "tool_use", "stop_sequence": None}
    return {"stop_reason": STOP_REASONS.get(finish, "end_turn"), "stop_sequence": None}


def message_shell(generation: Generation, model: str) -> dict[str, Any]:
    """The message before any content: what `message_start` carries."""
    return {
        "id": f"msg_{generation.id}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage(generation),
    }


def message_body(generation: Generation, model: str, parser: TextParser | None, *,
                 thinking: bool = False) -> dict[str, Any]:
    blocks = BlockStream(parser, thinking)
    content = whole_content(blocks.feed(generation.choices[0].text.text, final=True))
    return {
        **message_shell(generation, model),
        "content": content,
        **stop_fields(generation, tool_use=blocks.calls > 0),
    }
