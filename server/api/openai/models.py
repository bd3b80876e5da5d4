"""The model catalog: GET /v1/models and /v1/models/{id}, the base model and the adapters it
holds (adapter load and unload: server/api/admin/routes.py)."""

from __future__ import annotations

from flask import Flask, Response, jsonify

from toppings.server.api.context import ApiContext
from toppings.server.api.openai.response import models_response
from toppings.server.requests.errors import NOT_FOUND, unknown_adapter
from toppings.server.requests.request import RequestError


def register_models(app: Flask, ctx: ApiContext) -> None:
    """`/v1/models` and `/v1/models/{id}`: the model cards."""
    engine = ctx.engine

    @app.get("/v1/models")
    def models() -> Response:
        return jsonify(models_response(engine.model_name, engine.adapters(), ctx.started))

    @app.get("/v1/models/<path:model_id>")
    def model(model_id: str) -> Response:
        cards = models_response(engine.model_name, engine.adapters(), ctx.started)["data"]
        card = next((c for c in cards if c["id"] == model_id), None)
        if card is None:
            raise RequestError(unknown_adapter(model_id), 404, NOT_FOUND)
        return jsonify(card)
