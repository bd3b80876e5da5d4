"""The job protocol between the pool and its workers: one I/O arena in POSIX shared memory.

No pickling and no sockets on the hot path: the pool writes a job into a worker's fixed slot
and posts the worker's semaphore; the worker writes its rows of the outputs and a reply, then
posts its done semaphore. Layout (little endian; offsets in bytes from the arena start):

    0          header   HEADER_FMT: magic b"TOPIO002", version, dtype code, num_workers,
                        max_tokens, max_segments, x_width, out_width, job_bytes, job offset,
                        x offset, out offset; padded to 120
    120        x_seq    u64: the call whose x is in the x buffer (written after x itself: by
                        the pool on a CPU, by a D2H copy queued after x's on a GPU stream)
    job_off    jobs     num_workers slots of job_bytes (64-aligned), slot i for worker i:
               +0         REQUEST_FMT (pool writes): seq, op (1 run, 2 stop), layer, modules
                          bitmask, T (tokens of the call), row_start, row_end, num_segments,
                          x_seq (the worker reads x once the header's x_seq equals it)
               +64        REPLY_FMT (worker writes): done_seq, status (0 ok, 1 error),
                          compute_ns (the worker's own compute time for the job)
               +96        WORKER_FMT (worker writes once, on start): pid
               +128       num_segments x SEGMENT_FMT: adapter slot, token start, token end
    x_off      x        [max_tokens * x_width] of the arena dtype; a call's input x [T, H_in]
                        is the first T * H_in elements
    out_off    outputs  [max_tokens * out_width]; for each module in the bitmask (LORA_TARGETS
                        order) one [T, H_out] matrix, each following the previous

A worker owns rows [row_start, row_end) of every output of its job and writes all of them: the
rows of its segments get `scale * x @ A.T @ B^T`, every other row gets zeros. Segments are
absolute token ranges inside the worker's rows.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from toppings.cpu_lora import shm
from toppings.cpu_lora.arena_header import ArenaHeader, align
from toppings.cpu_lora.shapes import mask_modules

MAGIC = b"TOPIO002"
VERSION = 2
HEADER_FMT = "<8sIIIIIIIIQQQ"
HEADER = ArenaHeader(HEADER_FMT, MAGIC, VERSION, "CPU LoRA I/O arena")
HEADER_BYTES = 128
REQUEST_FMT = "<QIIIIIIIQ"
X_SEQ_FMT, X_SEQ_AT = "<Q", 120
REPLY_FMT, REPLY_AT = "<QIIQ", 64
WORKER_FMT, WORKER_AT = "<Q", 96
SEGMENT_FMT, SEGMENTS_AT = "<iII", 128
SEGMENT_BYTES = struct.calcsize(SEGMENT_FMT)
OP_RUN, OP_STOP = 1, 2
STATUS_OK, STATUS_ERROR = 0, 1


@dataclass(frozen=True)
class Job:
    """One worker's share of a layer call, as read back from its job slot."""

    seq: int
    op: int
    layer: int
    modules: int  # bitmask over LORA_TARGETS
    num_tokens: int  # T
    row_start: int
    row_end: int
    segments: tuple[tuple[int, int, int], ...]  # (adapter slot, start, end)
    x_seq: int = 0  # the call whose x this job reads (see IoArena.x_seq)


class IoArena:
    """Job slots plus the shared x and output buffers of one pool."""

    def __init__(self, name: str, mapping, shapes: dict[str, tuple[int, int]]) -> None:
        self.name, self._mm, self.shapes = name, mapping, shapes
        self.dtype, fields = HEADER.read(mapping, name)
        self.num_workers, self.max_tokens, self.max_segments = fields[0:3]
        self.x_width, self.out_width, self._job_bytes = fields[3:6]
        self._job_offset, x_offset, out_offset = fields[6:9]
        item = torch.empty((), dtype=self.dtype).element_size()
        self._x = torch.frombuffer(
            mapping, dtype=self.dtype, offset=x_offset, count=self.max_tokens * self.x_width
        )
        self._out = torch.frombuffer(
            mapping, dtype=self.dtype, offset=out_offset, count=(len(mapping) - out_offset) // item
        )
        self._views: dict[tuple, torch.Tensor | dict] = {}

    @classmethod
    def create(
        cls,
        num_workers: int,
        max_tokens: int,
        max_segments: int,
        shapes: dict[str, tuple[int, int]],
        modules: tuple[str, ...],
        dtype: torch.dtype,
    ) -> IoArena:
        """Size the buffers for `max_tokens` tokens of any subset of `modules` sharing an input."""
        x_width = max(shapes[m][0] for m in modules)
        out_width = max(
            sum(shapes[m][1] for m in modules if shapes[m][0] == shapes[k][0]) for k in modules
        )
        job_bytes = align(SEGMENTS_AT + max_segments * SEGMENT_BYTES)
        item = torch.empty((), dtype=dtype).element_size()
        job_offset = HEADER_BYTES
        x_offset = align(job_offset + num_workers * job_bytes, 4096)
        out_offset = align(x_offset + max_tokens * x_width * item, 4096)
        size = out_offset + max_tokens * out_width * item
        name = shm.new_name("io")
        mapping = shm.create_shm(name, size)
        HEADER.write(
            mapping,
            dtype,
            num_workers,
            max_tokens,
            max_segments,
            x_width,
            out_width,
            job_bytes,
            job_offset,
            x_offset,
            out_offset,
        )
        return cls(name, mapping, shapes)

    @classmethod
    def attach(cls, name: str, shapes: dict[str, tuple[int, int]]) -> IoArena:
        return cls(name, shm.attach_shm(name), shapes)

    def _slot(self, worker: int) -> int:
        if not 0 <= worker < self.num_workers:
            raise IndexError(f"worker {worker} out of range [0, {self.num_workers})")
        return self._job_offset + worker * self._job_bytes

    def write_job(self, worker: int, job: Job) -> None:
        """Fill a worker's job slot (the pool side); post the worker's semaphore afterwards."""
        if len(job.segments) > self.max_segments:
            raise ValueError(f"{len(job.segments)} segments; the arena holds {self.max_segments}")
        at = self._slot(worker)
        for i, seg in enumerate(job.segments):
            struct.pack_into(SEGMENT_FMT, self._mm, at + SEGMENTS_AT + i * SEGMENT_BYTES, *seg)
        struct.pack_into(
            REQUEST_FMT,
            self._mm,
            at,
            job.seq,
            job.op,
            job.layer,
            job.modules,
            job.num_tokens,
            job.row_start,
            job.row_end,
            len(job.segments),
            job.x_seq,
        )

    def read_job(self, worker: int) -> Job:
        at = self._slot(worker)
        seq, op, layer, modules, tokens, lo, hi, n, x_seq = struct.unpack_from(
            REQUEST_FMT, self._mm, at
        )
        segs = tuple(
            struct.unpack_from(SEGMENT_FMT, self._mm, at + SEGMENTS_AT + i * SEGMENT_BYTES)
            for i in range(n)
        )
        return Job(seq, op, layer, modules, tokens, lo, hi, segs, x_seq)

    def x_seq(self) -> int:
        """The call whose input x is complete in the x buffer."""
        return struct.unpack_from(X_SEQ_FMT, self._mm, X_SEQ_AT)[0]

    def set_x_seq(self, seq: int) -> None:
        """Mark x as complete for call `seq` (after writing x)."""
        struct.pack_into(X_SEQ_FMT, self._mm, X_SEQ_AT, seq)

    def x_seq_tensor(self) -> torch.Tensor:
        """The x_seq word as an int64 [1] tensor over the arena, for a device copy to write."""
        return torch.frombuffer(self._mm, dtype=torch.int64, offset=X_SEQ_AT, count=1)

    def mapping_tensor(self) -> torch.Tensor:
        """The whole arena as uint8 [size] (to register it as pinned memory)."""
        return torch.frombuffer(self._mm, dtype=torch.uint8)

    def write_reply(self, worker: int, seq: int, status: int, compute_ns: int) -> None:
        struct.pack_into(
            REPLY_FMT, self._mm, self._slot(worker) + REPLY_AT, seq, status, 0, compute_ns
        )

    def read_reply(self, worker: int) -> tuple[int, int, int]:
        """(done_seq, status, compute_ns) of a worker's last finished job."""
        seq, status, _, ns = struct.unpack_from(REPLY_FMT, self._mm, self._slot(worker) + REPLY_AT)
        return seq, status, ns

    def set_worker_pid(self, worker: int, pid: int) -> None:
        struct.pack_into(WORKER_FMT, self._mm, self._slot(worker) + WORKER_AT, pid)

    def worker_pid(self, worker: int) -> int:
        return struct.unpack_from(WORKER_FMT, self._mm, self._slot(worker) + WORKER_AT)[0]

    def x_view(self, num_tokens: int, width: int) -> torch.Tensor:
        """The shared input x [T, H_in]."""
        if num_tokens > self.max_tokens or width > self.x_width:
            raise ValueError(
                f"x [{num_tokens}, {width}] exceeds the arena's [{self.max_tokens}, {self.x_width}]"
            )
        key = ("x", num_tokens, width)
        if key not in self._views:
            self._cache(key, self._x[: num_tokens * width].view(num_tokens, width))
        return self._views[key]

    def _cache(self, key: tuple, value) -> None:
        """Keep views per shape: building them costs more than the rest of a small call."""
        if len(self._views) >= 1024:
            self._views.clear()
        self._views[key] = value

    def out_flat(self, num_tokens: int, modules: int) -> torch.Tensor:
        """All outputs of a modules bitmask as one flat view of the arena (layout order)."""
        size = sum(num_tokens * self.shapes[m][1] for m in mask_modules(modules))
        if size > self.max_tokens * self.out_width:
            raise ValueError(f"outputs of {num_tokens} tokens exceed the I/O arena")
        return self._out[:size]

    def out_views(
        self, num_tokens: int, modules: int, flat: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """{module: [T, H_out]} views of `flat` (default: the arena's outputs), layout order."""
        key = ("out", num_tokens, modules)
        if flat is None and key in self._views:
            return dict(self._views[key])
        views, at = {}, 0
        if flat is None:
            flat = self.out_flat(num_tokens, modules)
            self._cache(key, views)
        for module in mask_modules(modules):
            width = self.shapes[module][1]
            views[module] = flat[at : at + num_tokens * width].view(num_tokens, width)
            at += num_tokens * width
        return dict(views)

    def close(self) -> None:
        """Drop this process's references; views handed out keep the mapping alive."""
        self._x = self._out = self._mm = None

    def unlink(self) -> None:
        shm.unlink_shm(self.name)
