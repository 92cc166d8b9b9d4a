"""OpenAI's Responses API: POST /v1/responses and its stored responses."""

from server.responses.routes import router

__all__ = ["router"]
