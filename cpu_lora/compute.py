"""The arithmetic of one job, shared by the workers and the pool's in-process fallback."""

from __future__ import annotations

import torch

from toppings.cpu_lora.protocol import IoArena, Job
from toppings.cpu_lora.repository import HostRepository
from toppings.cpu_lora.shapes import mask_modules
from toppings.cpu_lora.spin import spin_until
from toppings.gpu_lora.kernels.cpu import lora_rows

X_TIMEOUT_S = 10.0  # how long a job waits for its x (a device copy still in flight)


def wait_for_x(io: IoArena, job: Job, timeout_s: float = X_TIMEOUT_S) -> None:
    """Return once the arena holds the x of `job`'s call; RuntimeError after timeout_s.

    On a CPU the pool marks x before posting, so this returns at once; on a GPU the mark is a
    device-to-host copy queued after x's, and the job may arrive before it lands.
    """
    if not spin_until(lambda: io.x_seq() == job.x_seq, timeout_s):
        raise RuntimeError(f"x of call {job.x_seq} did not arrive in {timeout_s:g} s")


def run_job(repo: HostRepository, io: IoArena, job: Job) -> None:
    """Write rows [row_start, row_end) of every output of `job` into the I/O arena (in place).

    Semantics:
        for module in modules(job):
            out[module][row_start:row_end] = 0
            for slot, start, end in job.segments:
                A, Bt = repo.tensors(slot, job.layer, module)   # [R, H_in], [R, H_out]
                out[module][start:end] = scale(slot) * (x[start:end] @ A.T) @ Bt

    A segment whose adapter has no LoRA on (layer, module) leaves its rows at zero. The modules
    of a job share their input, so each segment's x rows are read once for all of them while
    they are in cache. Arithmetic is in the arena dtype (float32 or bfloat16), by the host's one
    LoRA kernel (`gpu_lora.kernels.cpu.lora_rows`).
    """
    modules = mask_modules(job.modules)
    h_in = repo.shapes[modules[0]][0]
    x = io.x_view(job.num_tokens, h_in)  # [T, H_in]
    outs = io.out_views(job.num_tokens, job.modules)  # {module: [T, H_out]}
    segments = sorted(job.segments, key=lambda s: s[1])
    _zero_gaps(outs, segments, job.row_start, job.row_end)
    for slot, start, end in segments:
        if end <= start:
            continue
        rank, scale, views = repo.layer_tensors(slot, job.layer)
        xs = x[start:end]  # [n, H_in]
        for module in modules:
            out = outs[module][start:end]  # [n, H_out]
            if module not in views:
                out.zero_()
                continue
            a, bt = views[module]  # [R, H_in], [R, H_out]
            lora_rows(out, xs, a, bt, scale)


def _zero_gaps(outs: dict[str, torch.Tensor], segments, row_start: int, row_end: int) -> None:
    """Zero the rows of [row_start, row_end) that no segment covers."""
    at = row_start
    for _, start, end in [*segments, (0, row_end, row_end)]:
        if start > at:
            for out in outs.values():
                out[at:start].zero_()
        at = max(at, end)
