"""GET /v1/models and /v1/models/{id}: one path for two APIs. A request carrying
`anthropic-version` gets Anthropic's shape (`server.model_cards`), any other
OpenAI's; with a model pool, the OpenAI list holds every model it may serve."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from server.errors import BadRequest
from server.model_cards import anthropic_card, anthropic_list
from server.model_pool import check_served_model
from server.state import ServerState, get_state

router = APIRouter()


def openai_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.started_at,
        "owned_by": "mlx-headroom",
        "context_length": state.context_length if state.ready else None,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = get_state(request)
    if "anthropic-version" in request.headers:
        return anthropic_list(state)
    pool = getattr(request.app.state, "model_pool", None)
    if pool is not None:  # loaded and loadable models, with their state
        return {"object": "list", "data": pool.cards(state.started_at)}
    return {"object": "list", "data": [openai_card(state)]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> dict[str, Any]:
    state = get_state(request)
    pool = getattr(request.app.state, "model_pool", None)
    if pool is not None and "anthropic-version" not in request.headers:
        card = pool.card(model, state.started_at)  # any model it may serve, loaded or not
        if card is not None:
            return card
    check_served_model(state, model)
    if "anthropic-version" in request.headers:
        return anthropic_card(state)
    return openai_card(state)


@router.delete("/v1/models/{model:path}")
async def delete_model(model: str, request: Request) -> dict[str, Any]:
    """Unload a model loaded on demand (an admin request when keys are set: server.auth).
    A server without a model pool has nothing loaded on demand."""
    state = get_state(request)
    pool = getattr(request.app.state, "model_pool", None)
    if pool is None:
        check_served_model(state, model)  # 404 for a model it does not serve
        raise BadRequest(f"The model '{model}' is this server's own and stays loaded; start the "
                         "server with --allowed-models to load and unload models on demand",
                         code="model_not_unloadable", param="model")
    entry = await pool.unload_on_request(model)
    return {"id": entry.id, "object": "model", "deleted": True}

