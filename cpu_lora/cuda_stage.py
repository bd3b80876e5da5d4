"""The GPU side of a CPU LoRA call: x down and the deltas up without a blocking synchronize.

Written for `--device cuda` and NOT yet run on a GPU (no device was lent to the sessions that
wrote it); the protocol it relies on (the x_seq mark, protocol.py) is exercised on the CPU.

- stage(): the I/O arena is registered as pinned memory once (cudaHostRegister), so that
  `copy_(non_blocking=True)` is a true asynchronous DMA. x is copied into the arena on the
  current stream, then the call's sequence number is copied into the arena's x_seq word on the
  same stream: stream order makes the mark land after x. The pool posts the workers at once;
  each spins until x_seq equals its job's (compute.wait_for_x), so the engine thread never waits
  for the device here, and the device keeps running the work queued before x.
- fetch(): once the workers are done (the pool waited on their semaphores), the deltas go up on
  a side stream that has nothing queued, and the compute stream waits for it on the device.
  Before the next call overwrites the arena's outputs, stage() waits on the host for that copy
  alone (cheap: it was queued behind nothing).
"""

from __future__ import annotations

import torch

from toppings.cpu_lora.protocol import IoArena


class CudaStager:
    """Pinned registration of one pool's I/O arena and the two copies of a call."""

    def __init__(self, io: IoArena, device: torch.device) -> None:
        self.device = torch.device(device)
        self._arena = io.mapping_tensor()  # uint8 [size] over the shared arena
        err = torch.cuda.cudart().cudaHostRegister(self._arena.data_ptr(), self._arena.numel(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the CPU LoRA arena failed: {err}")
        self._flag = io.x_seq_tensor()  # int64 [1]
        self._copy_stream = torch.cuda.Stream(self.device)
        self._fetched: torch.cuda.Event | None = None

    def stage(self, x: torch.Tensor, staged: torch.Tensor, seq: int) -> None:
        """Queue x [T, H_in] -> staged (arena view), then seq -> the x_seq word. No host wait."""
        if self._fetched is not None:
            self._fetched.synchronize()  # the previous deltas have left the arena
        # Convert on the device first: a DMA copies bytes, it does not change the dtype.
        staged.copy_(x.to(staged.dtype).contiguous(), non_blocking=True)
        mark = torch.full((1,), seq, dtype=torch.int64, device=self.device)
        self._flag.copy_(mark, non_blocking=True)

    def fetch(self, outs: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """{module: [T, H_out]} arena views -> new device tensors of `dtype`, in stream order."""
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            up = {m: t.to(self.device, non_blocking=True) for m, t in outs.items()}
            self._fetched = torch.cuda.Event()
            self._fetched.record(self._copy_stream)
        compute.wait_stream(self._copy_stream)
        result = {}
        for module, t in up.items():
            t.record_stream(compute)  # allocated on the copy stream, used on the compute one
            result[module] = t.to(dtype)
        return result

    def close(self) -> None:
        """Wait for the last copy and unregister the arena."""
        if self._fetched is not None:
            self._fetched.synchronize()
        torch.cuda.cudart().cudaHostUnregister(self._arena.data_ptr())
