"""A pool of pinned CPU LoRA worker processes fed through shared memory.

`run()` computes, for one layer, the LoRA deltas of all projections that share an input, for a
batch of request segments: x goes once into the I/O arena, each worker gets a contiguous slice
of the rows (protocol.py), and the pool waits on the workers' done semaphores. A worker that
dies or hangs is noticed within the call (timed waits plus `poll()`); its slice is recomputed
in-process and a replacement worker is started, so the result is still complete and correct.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import threading
import time
from dataclasses import dataclass, field

import torch

from toppings.cpu_lora.compute import run_job, wait_for_x
from toppings.cpu_lora.profiling import CoreProfile, choose_tokens_per_core, time_one_core
from toppings.cpu_lora.protocol import OP_RUN, STATUS_ERROR, STATUS_OK, IoArena, Job
from toppings.cpu_lora.repository import HostRepository
from toppings.cpu_lora.serial_copy import copy_serial, zeros_serial
from toppings.cpu_lora.shapes import LORA_TARGETS, ModelShapes, module_mask
from toppings.cpu_lora.split import num_parts, split_rows
from toppings.cpu_lora.workers import WorkerProcess, allowed_cores
from toppings.gpu_lora.host_lora import add_deltas

log = logging.getLogger(__name__)


@dataclass
class CallStats:
    """What the last `run()` did: worker compute times (ns) and slices recomputed in-process."""

    worker_compute_ns: list[int] = field(default_factory=list)
    fallbacks: int = 0


class CpuLoraPool:
    """Worker processes, one per core, computing LoRA deltas from the shared host repository."""

    def __init__(
        self,
        repository: HostRepository,
        model_config: ModelShapes,
        num_workers: int,
        cores: list[int] | None = None,
        max_tokens: int = 2048,
        *,
        max_segments: int = 256,
        modules: tuple[str, ...] = LORA_TARGETS,
        tokens_per_core: int | None = None,
        timeout_s: float = 30.0,
        start_timeout_s: float = 120.0,
        use_numactl: bool | None = None,
        spin_us: float = 0.0,
    ) -> None:
        """Start `num_workers` workers, worker i pinned to cores[i % len(cores)].

        cores defaults to the cores this process may run on. tokens_per_core None runs
        `profile()` once the workers are up; an int fixes c without profiling. spin_us > 0:
        the pool and the workers spin that long on a semaphore before sleeping (spin.py).
        """
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        if spin_us < 0:
            raise ValueError("spin_us must be >= 0")
        for module in modules:
            if tuple(model_config.projection_shape(module)) != repository.shapes[module]:
                raise ValueError(f"{module}: the repository was made for another model")
        self.repository, self.modules = repository, tuple(modules)
        self.shapes = repository.shapes
        self.timeout_s = timeout_s
        self._cores = list(cores) if cores else allowed_cores()
        numactl = shutil.which("numactl") if use_numactl is not False else None
        if use_numactl and not numactl:
            raise RuntimeError("use_numactl=True but numactl is not installed")
        self.io = IoArena.create(
            num_workers, max_tokens, max_segments, self.shapes, self.modules, repository.dtype
        )
        self._lock = threading.Lock()
        self._seq = 0
        self._x_seq = 0  # the call whose x is (or is being put) in the arena
        self._device = None  # CudaStager, made at the first call with a CUDA x
        self._specs: dict[tuple[str, ...], tuple[int, int]] = {}
        self._closed = False
        self.last_call = CallStats()
        self.profile_result: CoreProfile | None = None
        self._workers: list[WorkerProcess] = []
        try:
            for i in range(num_workers):
                core = self._cores[i % len(self._cores)]
                self._workers.append(
                    WorkerProcess(i, core, self.io, repository.name, numactl, spin_us)
                )
                self._workers[-1].start()
            self.wait_ready(start_timeout_s)
            self.tokens_per_core = tokens_per_core or self.profile().tokens_per_core
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------- the hot path
    def add(self, layer: int, x: torch.Tensor, segments, outputs) -> None:
        """y += each segment's delta (`run`'s) for each (module, y) of outputs, in place
        (`gpu_lora.host_lora.HostLoraRunner.add`)."""
        add_deltas(self, layer, x, segments, outputs)

    def native_table(self, segments, modules, num_layers, dtype) -> None:
        """None: the workers compute in their own processes, called layer by layer
        (`gpu_lora.host_lora.HostLoraRunner.native_table`)."""
        return None

    def run(
        self,
        layer: int,
        x: torch.Tensor,
        segments: list[tuple[int | None, int, int]],
        modules: tuple[str, ...],
        *,
        copy: bool = True,
    ) -> dict[str, torch.Tensor]:
        """LoRA deltas of `modules` (which share the input x) for each request segment.

        Semantics:
            for module in modules:
                y[module] = zeros(T, H_out)
                for adapter_id, start, end in segments:
                    if adapter_id is not None and that adapter targets (layer, module):
                        A, B = adapter.weights[(layer, module)]
                        y[module][start:end] = scale * (x[start:end] @ A.T) @ B.T

        Args:
            layer: layer index.
            x: [T, H_in] float32/bfloat16, the input the projections share. Only the rows from
                the first segment's start to the last one's end are read (and copied into the
                arena); when x is `input_buffer(T, H_in)` (filled by the caller) nothing is
                copied. A CUDA x is copied into the arena on its current stream without a host
                synchronize (cuda_stage.py); the workers start once it has landed.
            segments: (adapter id in the repository or None, start, end); non-overlapping
                token ranges.
            modules: projections with the same H_in, e.g. ("q_proj", "k_proj", "v_proj").
            copy: False returns views of the shared outputs, in the arena dtype, valid until
                the next call (saves a copy when the caller consumes them at once). Ignored
                for a CUDA x: the outputs are new device tensors, ready in stream order.
        Returns:
            {module: [T, H_out]} on x's device, in x's dtype (copy=True or CUDA).
        """
        mask, h_in = self._check_call(layer, x, modules)
        work = self._resolve(segments, x.shape[0])
        num_tokens = x.shape[0]
        with self._lock:
            if self._closed:
                raise RuntimeError("the pool is closed")
            stats = self.last_call = CallStats()
            if work:
                self._stage_x(x, h_in, work[0][1], work[-1][2])
                self._dispatch(layer, mask, num_tokens, work, stats)
                if x.device.type != "cpu":  # _stage_x made self._device
                    return self._device.fetch(self.io.out_views(num_tokens, mask), x.dtype)
                if not copy:
                    return self.io.out_views(num_tokens, mask)
                shared = self.io.out_flat(num_tokens, mask)
                flat = torch.empty(shared.shape, dtype=x.dtype)
                copy_serial(flat, shared)  # one copy for all modules
                return self.io.out_views(num_tokens, mask, flat)
        zeros = {m: zeros_serial(num_tokens, self.shapes[m][1], x.dtype) for m in modules}
        return {m: z.to(x.device) for m, z in zeros.items()}

    def _stage_x(self, x: torch.Tensor, h_in: int, lo: int, hi: int) -> None:
        """Put rows [lo, hi) of x [T, H_in] in the arena; mark them as the next call's x.

        The workers read no other rows: a decode batch with one request still loading sends
        that request's row, not the batch.
        """
        self._x_seq += 1
        staged = self.io.x_view(x.shape[0], h_in)
        if x.device.type != "cpu":
            if self._device is None:
                from toppings.cpu_lora.cuda_stage import CudaStager

                self._device = CudaStager(self.io, x.device)
            self._device.stage(x[lo:hi], staged[lo:hi], self._x_seq)
            return
        if x.data_ptr() != staged.data_ptr() or x.stride() != staged.stride():
            copy_serial(staged[lo:hi], x[lo:hi])
        self.io.set_x_seq(self._x_seq)

    def input_buffer(self, num_tokens: int, width: int) -> torch.Tensor:
        """The shared input x [T, H_in] (arena dtype): fill it and pass it to run() uncopied."""
        return self.io.x_view(num_tokens, width)

    def _dispatch(self, layer, mask, num_tokens, work, stats: CallStats) -> None:
        ready = [w for w in self._workers if w.is_ready()]
        parts = num_parts(sum(e - s for _, s, e, _ in work), self.tokens_per_core, len(ready))
        slices = split_rows(work, num_tokens, max(parts, 1))
        posted = []
        for worker, (lo, hi, segs) in zip(ready, slices):
            self._seq += 1
            job = Job(self._seq, OP_RUN, layer, mask, num_tokens, lo, hi, tuple(segs), self._x_seq)
            worker.post(job)
            posted.append((worker, job))
        # Without a ready worker (all restarting) the whole call runs here.
        local = [
            Job(0, OP_RUN, layer, mask, num_tokens, lo, hi, tuple(s), self._x_seq)
            for lo, hi, s in slices[len(posted) :]
        ]
        deadline = time.monotonic() + self.timeout_s
        for worker, job in posted:
            status, ns = worker.wait(job.seq, deadline)
            if status == STATUS_OK:
                stats.worker_compute_ns.append(ns)
                continue
            if status != STATUS_ERROR:  # died or hung: replace it
                log.warning(
                    "CPU LoRA worker %d %s; recomputing its slice in-process", worker.index, status
                )
                worker.replace(str(status))
            local.append(job)  # an error raises here again, with its message
        for job in local:
            stats.fallbacks += 1
            wait_for_x(self.io, job)
            run_job(self.repository, self.io, job)

    def _check_call(self, layer: int, x: torch.Tensor, modules: tuple[str, ...]):
        """(modules bitmask, H_in) of a valid call; raises on a bad one."""
        spec = self._specs.get(modules)
        if spec is None:
            unknown = [m for m in modules if m not in self.modules]
            if not modules or unknown:
                raise ValueError(f"modules {modules} are not among the pool's {self.modules}")
            widths = {self.shapes[m][0] for m in modules}
            if len(widths) != 1:
                raise ValueError(f"{modules} have different inputs {sorted(widths)}")
            spec = self._specs[modules] = (module_mask(modules), widths.pop())
        if x.dim() != 2 or x.shape[1] != spec[1]:
            raise ValueError(f"x {list(x.shape)} does not match the input {spec[1]} of {modules}")
        if x.shape[0] > self.io.max_tokens:
            raise ValueError(f"{x.shape[0]} tokens; the pool was sized for {self.io.max_tokens}")
        if not 0 <= layer < self.repository.num_layers:
            raise IndexError(f"layer {layer} out of range")
        return spec

    def _resolve(self, segments, num_tokens: int) -> list[tuple[int, int, int, int]]:
        """(slot, start, end, rank) of the segments with an adapter, sorted, checked."""
        work, last_end = [], 0
        for adapter_id, start, end in sorted(segments, key=lambda s: s[1]):
            if not 0 <= start <= end <= num_tokens or start < last_end:
                raise ValueError(
                    f"segment ({adapter_id!r}, {start}, {end}) is out of [0, "
                    f"{num_tokens}) or overlaps another"
                )
            last_end = end
            if adapter_id is None or end == start:
                continue
            slot = self.repository.lookup(adapter_id)
            if slot is None:
                raise KeyError(f"adapter id {adapter_id} is not in the host repository")
            work.append((slot, start, end, self.repository.rank(slot)))
        if len(work) > self.io.max_segments:
            raise ValueError(f"{len(work)} segments; the pool holds {self.io.max_segments}")
        return work

    # ----------------------------------------------------------------- profile
    def profile(self, rank: int = 64, modules: tuple[str, ...] | None = None) -> CoreProfile:
        """Measure one core and the invocation overhead; sets and returns c (tokens per core)."""
        if modules is None:
            first = self.shapes[self.modules[0]][0]
            modules = tuple(m for m in self.modules if self.shapes[m][0] == first)
        counts = tuple(n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256) if n <= self.io.max_tokens)
        compute = time_one_core(
            [self.shapes[m] for m in modules], rank, self.repository.dtype, counts
        )
        overhead = self.measure_overhead_us()
        c = choose_tokens_per_core(counts, compute, overhead)
        self.profile_result = CoreProfile(counts, tuple(compute), overhead, c)
        self.tokens_per_core = c
        log.info("CPU LoRA profile: %d tokens per core (overhead %.0f us)", c, overhead)
        return self.profile_result

    def measure_overhead_us(self, calls: int = 50) -> float:
        """Median round trip of an empty job through worker 0, in microseconds."""
        worker, samples = self._workers[0], []
        with self._lock:
            for _ in range(calls):
                self._seq += 1
                start = time.perf_counter_ns()
                worker.post(Job(self._seq, OP_RUN, 0, 1, 0, 0, 0, (), self._x_seq))
                status, _ = worker.wait(self._seq, time.monotonic() + self.timeout_s)
                if status != STATUS_OK:
                    raise RuntimeError(f"worker 0 {status} while profiling")
                samples.append((time.perf_counter_ns() - start) / 1e3)
        return statistics.median(samples)

    # ----------------------------------------------------------------- processes
    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Block until every worker has attached (RuntimeError on a timeout or an exit)."""
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            worker.wait_ready(deadline)

    def shm_names(self) -> list[str]:
        """Names of the pool's I/O arena and semaphores (the repository's is not the pool's)."""
        sems = [s.name for w in self._workers for s in (w.job_sem, w.done_sem)]
        return [self.io.name, *sems]

    def workers_info(self) -> list[dict]:
        """Per worker: pid, core, alive, restarts (for /stats and /metrics). A worker whose
        restart has waited out its backoff is restarted here too when no call holds the pool,
        so that an idle server does not report it down until its next CPU LoRA call."""
        if self._lock.acquire(blocking=False):
            try:
                for w in self._workers:
                    if not self._closed and w.proc.poll() is not None:
                        w.is_ready()  # restarts it when its delay is over
            finally:
                self._lock.release()
        return [
            {
                "pid": w.proc.pid,
                "core": w.core,
                "alive": w.proc.poll() is None,
                "restarts": w.restarts,
            }
            for w in self._workers
        ]

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def close(self) -> None:
        """Stop the workers (killed if they do not stop) and unlink the I/O arena and semaphores.

        The repository is the caller's and stays open.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for worker in self._workers:
                worker.request_stop()
            for worker in self._workers:
                worker.stop(grace_s=2.0)
            if self._device is not None:
                self._device.close()
            self.io.unlink()
            self.io.close()

    def __enter__(self) -> CpuLoraPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
