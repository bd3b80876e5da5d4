"""The grouped reader of adapter weights (gpu_lora.peft.tensors.read_held) against the
safetensors library's reader, and the files it leaves to the library."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.gpu_lora.test_peft_format import MODEL, save_adapter
from toppings.gpu_lora.peft.adapter import AdapterError, _parse_key, load_peft_adapter
from toppings.gpu_lora.peft.config import WEIGHTS_FILE, adapter_dir, read_config_at, resolve_targets
from toppings.gpu_lora.peft.tensors import IOV_MAX, _read_into, abs_max, held, read_held
from toppings.gpu_lora.peft.tensors import read_weights as library_read


def _want(root: Path):
    """The `want` of load_peft_adapter for the adapter at `root` (every name targeted)."""
    with adapter_dir(root) as dir_fd:
        cfg = read_config_at(dir_fd, root)
    targeted, rank = resolve_targets(cfg, MODEL, "cfg"), cfg["r"]

    def want(key):
        pair, half = _parse_key(key, targeted, MODEL, root)
        in_f, out_f = MODEL.projection_shape(pair[1])
        return half, ((rank, in_f) if half == "A" else (out_f, rank))

    return want


def _grouped(root: Path, hold: torch.dtype):
    with adapter_dir(root) as dir_fd:
        return read_held(dir_fd, root, _want(root), hold)


def _library(root: Path, hold: torch.dtype):
    with adapter_dir(root) as dir_fd:
        tensors = library_read(dir_fd, root)
    want = _want(root)
    out = {}
    for key, tensor in tensors.items():
        kept = held(tensor, want(key)[0], hold)
        out[key] = (kept, abs_max(kept))
    return out


def _retyped(root: Path, dtype: torch.dtype) -> None:
    path = root / WEIGHTS_FILE
    tensors = {k: v.to(dtype) for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """An all-linear r=4 adapter: A and B of five shapes, a group each."""
    root = tmp_path_factory.mktemp("tensors") / "all"
    save_adapter(root, r=4, target_modules="all-linear")
    return root


@pytest.mark.parametrize("file_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hold", [torch.float32, torch.bfloat16])
def test_grouped_reads_what_the_library_reads(tmp_path, saved, file_dtype, hold):
    root = tmp_path / "ad"
    root.mkdir()
    for name in os.listdir(saved):
        (root / name).write_bytes((saved / name).read_bytes())
    _retyped(root, file_dtype)
    got, want = _grouped(root, hold), _library(root, hold)
    assert got is not None and set(got) == set(want)
    for key, (tensor, bound) in got.items():
        ref, ref_bound = want[key]
        assert tensor.dtype == hold and tensor.shape == ref.shape
        assert torch.equal(tensor, ref) and bound == ref_bound
        # A contiguous; B the transpose of a contiguous B^T (the pool's rows)
        assert tensor.is_contiguous() if ".lora_A." in key else tensor.T.is_contiguous()


def test_a_nan_bounds_only_its_own_tensor_and_the_library_names_it(tmp_path, saved):
    root = tmp_path / "nan"
    root.mkdir()
    for name in os.listdir(saved):
        (root / name).write_bytes((saved / name).read_bytes())
    path = root / WEIGHTS_FILE
    tensors = load_file(path)
    bad = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    tensors[bad][2, 5] = math.nan
    save_file(tensors, path)
    got = _grouped(root, torch.float32)
    assert math.isnan(got[bad][1])
    assert all(math.isfinite(b) for k, (_, b) in got.items() if k != bad)
    with pytest.raises(AdapterError, match="layers.1.self_attn.q_proj.lora_A.weight' holds NaN"):
        load_peft_adapter(root, MODEL)


def _write_raw(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _raw(tensors: dict, gap: int = 0, shape=list) -> tuple[dict, bytes]:
    """A float32 safetensors header and data of `tensors` written by hand, `gap` zero bytes
    after each tensor but the last, each shape given as `shape(tensor.shape)`."""
    header, data = {}, b""
    for key, tensor in sorted(tensors.items()):
        if data:
            data += b"\0" * gap
        raw = tensor.contiguous().numpy().tobytes()
        header[key] = {"dtype": "F32", "shape": shape(tensor.shape),
                       "data_offsets": [len(data), len(data) + len(raw)]}  # fmt: skip
        data += raw
    return header, data


def test_files_it_does_not_take_go_to_the_library(tmp_path):
    root = tmp_path / "qv"
    save_adapter(root, r=2, target_modules=["q_proj"])
    tensors = load_file(root / WEIGHTS_FILE)
    reference = load_peft_adapter(root, MODEL)
    # float64: the library reads it, the grouped reader does not take the dtype
    save_file({k: v.double() for k, v in tensors.items()}, root / WEIGHTS_FILE)
    assert _grouped(root, torch.float32) is None
    wide = load_peft_adapter(root, MODEL)
    for pair, (a, b) in reference.weights.items():
        assert torch.equal(wide.weights[pair][0], a) and torch.equal(wide.weights[pair][1], b)
    # a gap between two tensors' bytes: not a file the library reads either
    _write_raw(root / WEIGHTS_FILE, *_raw(tensors, gap=4))
    assert _grouped(root, torch.float32) is None
    with pytest.raises(AdapterError, match="not a readable safetensors file"):
        load_peft_adapter(root, MODEL)
    # a shape of floats (equal to the wanted ints in Python): left to the library, which refuses
    _write_raw(root / WEIGHTS_FILE, *_raw(tensors, shape=lambda s: [float(n) for n in s]))
    assert _grouped(root, torch.float32) is None
    with pytest.raises(AdapterError, match="not a readable safetensors file"):
        load_peft_adapter(root, MODEL)
    # a dtype that is not a name (a list): left to the library
    header, data = _raw(tensors)
    _write_raw(root / WEIGHTS_FILE, header, data)
    assert _grouped(root, torch.float32) is not None  # the control: this file is taken
    header[next(iter(header))]["dtype"] = ["F32"]
    _write_raw(root / WEIGHTS_FILE, header, data)
    assert _grouped(root, torch.float32) is None
    # metadata that is not a map of strings: left to the library
    header, data = _raw(tensors)
    _write_raw(root / WEIGHTS_FILE, {"__metadata__": {"format": 1}, **header}, data)
    assert _grouped(root, torch.float32) is None


def test_a_scatter_read_past_the_iovec_limit_fills_every_buffer(tmp_path):
    count = 3 * IOV_MAX + 5
    data = numpy.random.default_rng(0).integers(0, 256, count * 7, dtype=numpy.uint8)
    path = tmp_path / "blob"
    path.write_bytes(b"head" + data.tobytes())
    out = numpy.zeros(count * 7 + 3, dtype=numpy.uint8)
    sizes = [7] * count
    sizes[5], sizes[6] = 0, 14  # an empty buffer, and one that takes its neighbour's bytes
    buffers, at = [], 0
    for n in sizes:
        buffers.append(out[at : at + n])
        at += n
    fd = os.open(path, os.O_RDONLY)
    try:
        _read_into(fd, 4, buffers)
        with pytest.raises(AdapterError, match="ended early"):
            _read_into(fd, 4, [out])  # three bytes more than the file holds
    finally:
        os.close(fd)
    assert numpy.array_equal(out[: count * 7], data)


def test_a_plain_peft_file_never_reaches_the_library(saved, monkeypatch):
    """load_peft_adapter takes PeftModel.save_pretrained's files by the grouped reader (the
    library's path is the fallback, for what that reader does not take)."""
    import toppings.gpu_lora.peft.adapter as adapter_module

    def library(*args):
        raise AssertionError("the library's reader ran")

    monkeypatch.setattr(adapter_module, "read_weights", library)
    for hold in (torch.float32, torch.bfloat16):
        adapter = load_peft_adapter(saved, MODEL, dtype=hold)
        assert len(adapter.weights) == 2 * 7  # two layers, all seven projections
