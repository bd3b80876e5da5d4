"""The adapter admin routes: load and unload at run time, and the files of a held adapter for a
peer to fetch.

POST /v1/load_lora_adapter               from a local path (server.api.admin.lifecycle), or, with
                                         `peers`, fetched from them (server.api.admin.peer_fetch;
                                         403 unless the server has an adapter store)
POST /v1/unload_lora_adapter
GET  /v1/adapters/NAME/files[/FILE]      the PEFT files of a held adapter
                                         (server.api.admin.files)
"""

from __future__ import annotations

from flask import Flask, Response, jsonify

from toppings.server.api.admin.files import FILES, manifest, read_chunks
from toppings.server.api.admin.peer_fetch import held_adapter_dir
from toppings.server.api.context import ApiContext, json_body
from toppings.server.requests.errors import NOT_FOUND
from toppings.server.requests.request import RequestError


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
