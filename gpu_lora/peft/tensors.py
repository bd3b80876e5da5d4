"""adapter_model.safetensors as the tensors an adapter holds: read once, checked per group.

The format: an 8-byte little-endian header length, a JSON header (per tensor its dtype, shape
and [start, end) byte offsets into the data that follows), then the data. An adapter holds A
[R, in] contiguous and B [out, R] as the transpose of a contiguous B^T [R, out] (the layout of
the pool's rows), at the engine's dtype, each with its largest magnitude (the finiteness and
overflow checks read it).

Two readers give the same tensors:
- `read_weights`, the safetensors library's: the file's bytes, parsed into one tensor per name,
  then each converted (`held`) and bounded (`abs_max`) one by one: three copies of B, two of A,
  and a few torch calls for each of an adapter's hundreds of tensors;
- `read_held`, for a file whose header is exactly what the library accepts and whose tensors
  are all at float32, bfloat16 or float16: tensors of one (half, shape, dtype) are a group with
  one store [n, ...]; one scatter read of the whole data (`os.preadv`, IOV_MAX buffers a call)
  puts each tensor straight into its slot (A: the store the adapter keeps where the dtypes
  agree; B: a scratch [n, out, R] that one copy a group transposes into the kept [n, R, out]),
  and each tensor is bounded by one whole-tensor reduction, read back once a group. A
  resolution on first use reads on the request path beside the engine on a machine whose other
  cores serve HTTP (issue 64): this reader moves each byte once or twice and makes a few torch
  calls per tensor and group, not a dozen per tensor.
The library stays the oracle: tests read every supported layout both ways; `read_held` returns
None for anything else (its caller reads with the library, which raises the library's error).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors.torch import load

from toppings.gpu_lora.peft.config import (
    MAX_WEIGHTS_BYTES,
    PICKLE_FILE,
    WEIGHTS_FILE,
    AdapterError,
)
from toppings.gpu_lora.peft.directory import UnsafeFile, file_size, has_file, open_file

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
IOV_MAX = 1024  # buffers per preadv call (Linux's UIO_MAXIOV)


def read_header(dir_fd: int, root: Path) -> dict:
    """The JSON header of adapter_model.safetensors in the directory `dir_fd`: the name, dtype
    and shape of each tensor, read from the opened file without reading any tensor data."""
    with _opened(dir_fd, root) as f:
        header, _ = _header(f, file_size(f), root / WEIGHTS_FILE)
    header.pop("__metadata__", None)
    return header


def read_weights(dir_fd: int, root: Path) -> dict[str, torch.Tensor]:
    """The tensors of adapter_model.safetensors in the directory `dir_fd` (`root` names it), by
    the safetensors library, by name."""
    weights_path = root / WEIGHTS_FILE
    with _opened(dir_fd, root) as f:
        try:
            # From bytes, not load_file(path): safetensors 0.8's file reader keeps about 10 KiB
            # of Python objects per file read, never freed (the soak's loads, issue 48). By
            # name, as load_file gives them (the first bad tensor named is layer 0's).
            return dict(sorted(load(f.read()).items()))
        except Exception as exc:  # the Rust reader raises its own type for corrupt files
            message = f"{weights_path} is not a readable safetensors file: {exc}"
            raise AdapterError(message) from exc


def held(tensor: torch.Tensor, half: str, dtype: torch.dtype) -> torch.Tensor:
    """A read tensor at `dtype`: A contiguous (the read's own buffer where it is so already), B
    as the transpose of a contiguous B^T [R, out], the layout of the pool's rows."""
    if half == "A":
        return tensor.to(dtype).contiguous()
    return torch.empty(tensor.shape[::-1], dtype=dtype).copy_(tensor.T).T


def abs_max(tensor: torch.Tensor) -> float:
    """The largest magnitude in a float tensor: NaN where it holds a NaN, inf where an inf.
    One reduction (`aminmax`) and no boolean mask per tensor: an adapter has hundreds of small
    tensors, and `isfinite(t).all()` on each was the largest part of reading one; the bound
    also serves the overflow check (gpu_lora.validate). A held B (the transpose of a contiguous
    B^T) is reduced as B^T, in memory order: the same values, about 10x faster than strided."""
    if tensor.dim() == 2 and not tensor.is_contiguous() and tensor.T.is_contiguous():
        tensor = tensor.T
    low, high = torch.aminmax(tensor)
    low, high = low.item(), high.item()
    return high if math.isnan(high) else max(-low, high)


def is_all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of a float tensor is finite."""
    return math.isfinite(abs_max(tensor))


def read_held(
    dir_fd: int,
    root: Path,
    want: Callable[[str], tuple[str, tuple[int, int]] | None],
    hold: torch.dtype,
) -> dict[str, tuple[torch.Tensor, float]] | None:
    """Every tensor of the weights file, held at `hold` (A contiguous, B a transposed view),
    with its largest magnitude (NaN or inf where it holds one), by name; None where the file
    is not one this reader takes (see the module docstring) or a name is not wanted.

    want: per tensor name, its half ("A" or "B") and the shape it must have, None for a name
    that must not be there (the caller's checks then name it through the library's reader)."""
    with _opened(dir_fd, root) as f:
        size = file_size(f)
        header, data_start = _header(f, size, root / WEIGHTS_FILE)
        layout = _layout(header, size - data_start, want)
        if layout is None:
            return None
        groups, order = layout
        stores = {g: torch.empty((len(names), *g[1]), dtype=g[2]) for g, names in groups.items()}
        slots = {}
        for g, names in groups.items():
            flat = stores[g].view(len(names), -1).view(torch.uint8).numpy()  # [n, bytes]
            slots.update((name, flat[i]) for i, name in enumerate(names))
        _read_into(f.fileno(), data_start, [slots[name] for name in order])
    held = {}
    for group, names in groups.items():
        half = group[0]
        kept = _kept(stores[group], half, hold)  # [n, R, in] or [n, R, out]
        bounds = _bounds(kept)
        for i, name in enumerate(names):
            held[name] = (kept[i] if half == "A" else kept[i].T, bounds[i])
    return held


def _bounds(kept: torch.Tensor) -> list[float]:
    """The largest magnitude of each member of a group's store [n, ...] (NaN where one holds a
    NaN): one whole-tensor `aminmax` a member, its values read back once. Not one reduction
    along dim 1: torch's CPU `aminmax(dim=)` is about 7x slower than the loop (bf16 [120, 64,
    576]: 7.7 ms against 1.0), `amin` and `amax` along it 2.6x."""
    lows, highs = zip(*(torch.aminmax(member) for member in kept))
    return torch.maximum(-torch.stack(lows), torch.stack(highs)).float().tolist()


def _kept(store: torch.Tensor, half: str, hold: torch.dtype) -> torch.Tensor:
    """A group's tensors as kept: A [n, R, in] at `hold` (the store itself where the dtypes
    agree), B^T [n, R, out] contiguous from the store's B [n, out, R]."""
    if half == "A":
        return store.to(hold)
    n, out_f, rank = store.shape
    return torch.empty(n, rank, out_f, dtype=hold).copy_(store.transpose(1, 2))


def _layout(header: dict, data_len: int, want) -> tuple[dict, list[str]] | None:
    """The groups {(half, shape, dtype): names} and the names in file order, or None unless
    the tensors tile the data exactly (the library's rule) at the dtypes this reader takes and
    each name is wanted at its shape."""
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        return None
    spans, groups = [], {}
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            return None
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        dtype = DTYPES.get(dtype) if isinstance(dtype, str) else None
        if not (isinstance(shape, list) and all(type(x) is int for x in shape)):
            return None  # the library takes integers only (not 4.0, not true)
        wanted = want(name)
        if dtype is None or wanted is None or shape != list(wanted[1]):
            return None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(x) is int for x in offsets)):  # fmt: skip
            return None
        start, end = offsets
        if end - start != math.prod(shape) * dtype.itemsize:
            return None
        spans.append((start, end, name))
        groups.setdefault((wanted[0], tuple(shape), dtype), []).append(name)
    spans.sort()
    position = 0
    for start, end, _ in spans:
        if start != position:
            return None
        position = end
    if position != data_len:
        return None
    return groups, [name for _, _, name in spans]


def _read_into(fd: int, offset: int, buffers: list) -> None:
    """Fill `buffers` (writable byte arrays, in file order, together the bytes at `offset`)
    from the file, a scatter read of up to IOV_MAX of them at a time."""
    views = [memoryview(b) for b in buffers if len(b)]
    while views:
        done = os.preadv(fd, views[:IOV_MAX], offset)
        if done <= 0:
            raise AdapterError("the weights file ended early (changed while read)")
        offset += done
        while views and done >= len(views[0]):
            done -= len(views.pop(0))
        if done:
            views[0] = views[0][done:]


def _header(f, size: int, weights_path: Path) -> tuple[dict, int]:
    """The header of the opened file (a JSON object) and where its data starts."""
    try:
        prefix = f.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < length <= size - 8:
            raise AdapterError(f"{weights_path} is not a readable safetensors file")
        header = json.loads(f.read(length))
    except (ValueError, UnicodeDecodeError) as exc:  # not JSON
        raise AdapterError(f"{weights_path} is not a readable safetensors file: {exc}") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{weights_path} is not a readable safetensors file")
    return header, 8 + length


@contextlib.contextmanager
def _opened(dir_fd: int, root: Path) -> Iterator[BinaryIO]:
    """The weights file opened in the directory `dir_fd` (within MAX_WEIGHTS_BYTES, without
    following a link), its errors and those of reading it as AdapterError."""
    weights_path = root / WEIGHTS_FILE
    if not has_file(dir_fd, WEIGHTS_FILE) and has_file(dir_fd, PICKLE_FILE):
        raise AdapterError(
            f"{str(root)!r} has only {PICKLE_FILE} (a pickle); safetensors only: save the "
            f"adapter with safe_serialization=True to get {WEIGHTS_FILE}"
        )
    try:
        with open_file(dir_fd, WEIGHTS_FILE, MAX_WEIGHTS_BYTES) as f:
            yield f
    except FileNotFoundError:
        raise AdapterError(f"{WEIGHTS_FILE} missing in {str(root)!r}") from None
    except UnsafeFile as exc:
        raise AdapterError(f"{root}: {exc}") from None
    except OSError as exc:
        raise AdapterError(f"{weights_path} cannot be read: {exc}") from exc
