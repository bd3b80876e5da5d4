"""Loading the same adapter over and over keeps nothing (issue 48's soak: safetensors 0.8's file
reader kept about 10 KiB of Python objects for every adapter file it read)."""

from __future__ import annotations

import gc
import tracemalloc

from tests.gpu_lora.test_peft_format import MODEL, save_adapter
from toppings.gpu_lora.peft.adapter import load_peft_adapter

NUM_LOADS = 200


def test_reloading_an_adapter_keeps_no_python_objects(tmp_path):
    save_adapter(tmp_path / "ad", r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    for _ in range(NUM_LOADS // 2):  # torch's caches, which the first hundreds of loads fill
        load_peft_adapter(tmp_path / "ad", MODEL)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(NUM_LOADS):
            load_peft_adapter(tmp_path / "ad", MODEL)
        gc.collect()
        grown = tracemalloc.take_snapshot().compare_to(before, "filename")
    finally:
        tracemalloc.stop()
    kept = sum(stat.size_diff for stat in grown)
    # About 1 KiB a load (230 KiB in all) with safetensors' file reader; 5-20 KiB without it.
    assert kept < 64 * 1024, [str(s) for s in grown[:3]]
