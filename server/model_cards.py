"""The models list and a model's card in Anthropic's shape, for requests carrying
`anthropic-version`. `server.models_routes` serves both APIs' shapes on one path, so this
lives beside it rather than in the Anthropic package: no API family imports another."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from server.state import ServerState


def anthropic_card(state: ServerState) -> dict[str, Any]:
    """GET /v1/models/{id} as Anthropic answers it."""
    created = datetime.fromtimestamp(state.started_at, timezone.utc).isoformat().replace("+00:00", "Z")
    return {
        "type": "model",
        "id": state.model_name,
        "display_name": state.model_name,
        "created_at": created,
        "max_input_tokens": state.context_length if state.ready else None,
    }


def anthropic_list(state: ServerState) -> dict[str, Any]:
    """GET /v1/models as Anthropic answers it."""
    card = anthropic_card(state)
    return {"data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]}
