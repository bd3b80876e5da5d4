"""The model and adapter routes: the catalog, adapter load/unload, and adapter files for peers.

GET  /v1/models, /v1/models/{id}        the base model and the adapters it holds
POST /v1/load_lora_adapter               from a local path (server.api.lifecycle), or, with
                                         `peers`, fetched from them (server.api.peer_fetch;
                                         403 unless the server has an adapter store)
POST /v1/unload_lora_adapter
GET  /v1/adapters/NAME/files[/FILE]      the PEFT files of a held adapter
                                         (server.api.adapter_files)
"""

from __future__ import annotations

from flask import Flask, Response, jsonify

from toppings.server.api.adapter_files import FILES, manifest, read_chunks
from toppings.server.api.context import ApiContext, json_body
from toppings.server.api.peer_fetch import held_adapter_dir
from toppings.server.api.response import models_response
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


def register_adapters(app: Flask, ctx: ApiContext) -> None:
    """Adapter load and unload, and the files of a held adapter for a peer to fetch."""

    @app.post("/v1/load_lora_adapter")
    def load_lora_adapter() -> Response:
        body = json_body()
        if "peers" not in body:
            return jsonify(ctx.admin.load(body))
        if ctx.fetcher is None:
            raise RequestError("fetching adapters from peers is disabled: start the server with "
                               "--adapter-store", 403, "permission_denied")  # fmt: skip
        return jsonify(ctx.fetcher.load(body))

    @app.get("/v1/adapters/<path:name>/files")
    def adapter_file_list(name: str) -> Response:
        return jsonify(manifest(name, held_adapter_dir(ctx.engine, name)))

    @app.get("/v1/adapters/<path:name>/files/<file_name>")
    def adapter_file(name: str, file_name: str) -> Response:
        directory = held_adapter_dir(ctx.engine, name)
        if file_name not in FILES:
            raise RequestError(f"{file_name!r} is not an adapter file", 404, NOT_FOUND)
        return Response(read_chunks(directory, file_name), content_type="application/octet-stream")

    @app.post("/v1/unload_lora_adapter")
    def unload_lora_adapter() -> Response:
        return jsonify(ctx.admin.unload(json_body()))
