"""Anthropic's Messages API, for Claude Code and the anthropic SDKs.

Tool calling, forced calls and their grammars are the shared ones of server/tools.py and
server/chat_plan.py; this package only speaks Anthropic's shapes.

    schemas.py   request bodies, tolerant of what we do not know
    convert.py   Anthropic messages -> chat-template messages
    blocks.py    generated text -> text and tool_use blocks, whole or streamed
    message.py   a generation as Anthropic's message object
    stream.py    ... and as Anthropic's server-sent events
    routes.py    /v1/messages, /v1/messages/count_tokens
    errors.py    errors in Anthropic's shape and statuses
"""

from server.anthropic.errors import render
from server.anthropic.routes import router

__all__ = ["render", "router"]
