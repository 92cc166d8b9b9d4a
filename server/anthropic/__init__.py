"""Anthropic's Messages API, for Claude Code and the anthropic SDKs.

    schemas.py   request bodies, tolerant of what we do not know
    convert.py   Anthropic messages -> chat-template messages
    message.py   a generation as Anthropic's message object
    stream.py    ... and as Anthropic's server-sent events
    routes.py    /v1/messages, /v1/messages/count_tokens, the models list's shape
    errors.py    errors in Anthropic's shape and statuses
"""

from server.anthropic.errors import render
from server.anthropic.routes import model_card, model_list, router

__all__ = ["model_card", "model_list", "render", "router"]
