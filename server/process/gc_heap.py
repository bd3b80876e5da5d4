"""The start-up heap out of the garbage collector's walk, once the server is built.

CPython's collection of its oldest generation stops every thread and walks every tracked
container of the process, and almost all of a server's are start-up state that lives as long
as the process: the model's modules, the tokenizer's vocabulary, the engine, the app. Such a
collection comes once enough objects have survived into that generation (requests promoted
while they ran, then ended): rarely, but each one pauses every stream for the whole walk
(docs/production.md says what it measured here). `gc.freeze()` moves what exists now into a
permanent generation that collections skip; what is allocated later is collected as before (a
cycle made by later code is still found), and frozen objects are still freed by reference
counting. vLLM (vllm-project/vllm#24008) and SGLang (sgl-project/sglang#34999) do the same
after start-up.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once (start-up's garbage is not kept), then freeze every object that is left;
    returns how many were frozen. Call it once, when the server is built and before requests."""
    started = time.perf_counter()
    gc.collect()
    took = time.perf_counter() - started
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze %d start-up objects out of the garbage collector's walk (a full collection "
             "over them took %.0f ms)", frozen, took * 1e3)  # fmt: skip
    return frozen


def thaw_heap() -> None:
    """Give the frozen objects back to the collector (at shutdown): the interpreter's last
    collection then frees the cycles start-up made, which extension modules (Triton's nanobind)
    otherwise report as leaked at exit."""
    gc.unfreeze()
