"""/openapi.json as clients meet the server: the error responses it really sends.

FastAPI documents a 422 for every route with a body, but validation errors are answered
as 400 OpenAI error objects (server.errors). This replaces the 422 with the statuses
the error hierarchy defines, each with the error object's schema.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_STATUSES: dict[str, str] = {
    "400": "Invalid request: a field is wrong, unsupported, or the prompt is too long",
    "401": "Missing or wrong API key",
    "403": "The key is not the admin key",
    "404": "Unknown model, route or stored object",
    "413": "Request body too large",
    "429": "The waiting queue is full (Retry-After)",
    "503": "The engine is not running",
    "504": "The request ran past the server's deadline",
    "507": "The memory guard refused: the request does not fit in memory (with its numbers)",
}

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "additionalProperties": True,
        }
    },
}


# Anthropic's routes answer in Anthropic's shape (server/anthropic/errors.py).
ANTHROPIC_PREFIX = "/v1/messages"
ANTHROPIC_ERROR_STATUSES: dict[str, str] = {
    **{k: v for k, v in ERROR_STATUSES.items() if k != "503"},
    "529": "Overloaded: the request waited for memory and timed out; retry (Retry-After)",
}
ANTHROPIC_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            "additionalProperties": True,
        },
    },
}


def install_openapi_errors(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["ErrorResponse"] = ERROR_SCHEMA
        components["AnthropicErrorResponse"] = ANTHROPIC_ERROR_SCHEMA
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        anthropic = {"application/json": {"schema": {
            "$ref": "#/components/schemas/AnthropicErrorResponse"}}}
        for route, path in schema.get("paths", {}).items():
            ours = route.startswith(ANTHROPIC_PREFIX)
            statuses = ANTHROPIC_ERROR_STATUSES if ours else ERROR_STATUSES
            for operation in path.values():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                for status, description in statuses.items():
                    responses.setdefault(status, {"description": description,
                                                  "content": anthropic if ours else error})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
