"""The API sees the engine through `EngineClient` (server/engine/client.py): the engine has
every member the protocol names, with the same parameters."""

from __future__ import annotations

import inspect

from toppings.server.engine.client import EngineClient
from toppings.server.engine.engine import Engine


def test_the_engine_is_an_engine_client():
    for name, member in vars(EngineClient).items():
        if name.startswith("_") or not callable(member):
            continue
        assert callable(getattr(Engine, name, None)), name
        want = list(inspect.signature(member).parameters)
        assert list(inspect.signature(getattr(Engine, name)).parameters) == want, name
    fields = set(EngineClient.__annotations__)
    assert fields == {"config", "model_name", "model_config", "max_model_len", "tokenizer"}
    source = inspect.getsource(Engine.__init__)
    assert all(f"self.{f}" in source for f in fields)
