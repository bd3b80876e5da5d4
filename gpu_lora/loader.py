"""Pipelined adapter loads: copy an adapter into its pool rows one layer group at a time.

The engine reads `LoadTicket.layers_ready()` before each layer: layers below it are resident and
run on the device kernels, the rest go to the CPU workers (cpu-assisted) or wait (on-demand).
On a CPU device a loader thread does real copies, optionally throttled to emulate a PCIe link
(`LinkProfile`: a bandwidth and a per-transfer latency, paid per layer-group copy); with the
device/host split the thread runs on the host cores only, as a GPU's copy engine runs beside
its compute; on CUDA the copies run on a side stream from pinned host memory with one event per
group, and readiness is a non-blocking event query.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from toppings.gpu_lora.adapter_pool import AdapterPool, ResidentAdapter
from toppings.gpu_lora.load_times import LoadTimes
from toppings.gpu_lora.peft.adapter import LoraAdapter
from toppings.gpu_lora.trace import CopyEvent, TraceRecorder

log = logging.getLogger(__name__)


class LoadTicket:
    """Progress of one load: the number of leading layers already resident.

    The copy strategy moves it forward: `mark_ready` (the CPU thread, after each group's copies)
    or `add_event` (CUDA, one event per group on the side stream, read without blocking).
    `load_times` gets the seconds from the ticket's creation until its last layer is resident,
    once (None: not observed).
    """

    def __init__(self, num_layers: int, load_times: LoadTimes | None = None):
        self.num_layers = num_layers
        self.error: str | None = None
        self._ready = 0
        self._events: list[tuple[int, object]] = []  # CUDA: (layers ready after, event)
        self._done = threading.Event()
        self._load_times = load_times
        self._started_s = time.perf_counter()
        self._observe_lock = threading.Lock()

    def layers_ready(self) -> int:
        while self._events and self._events[0][1].query():
            self._ready = self._events.pop(0)[0]
            if self._ready >= self.num_layers:
                self._observe()  # CUDA: the first thread to see the last event complete
        return self._ready

    def _observe(self) -> None:
        """Record the load's duration once, from whichever thread sees it finish first."""
        with self._observe_lock:
            load_times, self._load_times = self._load_times, None
        if load_times is not None:
            load_times.observe(time.perf_counter() - self._started_s)

    @property
    def done(self) -> bool:
        return self.layers_ready() >= self.num_layers

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until every layer is resident or the load failed (tests, eviction, shutdown)."""
        if not self._done.wait(timeout_s):
            return False
        for _, event in self._events:
            event.synchronize()
        return True

    def mark_ready(self, layers: int) -> None:
        """The first `layers` layers are resident now."""
        self._ready = layers
        if layers >= self.num_layers:
            self._observe()
            self._done.set()

    def add_event(self, layers: int, event) -> None:
        """The first `layers` layers are resident once `event` (a torch.cuda.Event) completes."""
        self._events.append((layers, event))
        if layers >= self.num_layers:
            self._done.set()  # every copy is queued; wait() synchronizes on the events

    def fail(self, message: str) -> None:
        """The load stopped: rows past layers_ready() are not valid, waiters are released."""
        self.error = message
        self._done.set()

    @staticmethod
    def resident(num_layers: int) -> LoadTicket:
        ticket = LoadTicket(num_layers)
        ticket.mark_ready(num_layers)
        return ticket


@dataclass(frozen=True)
class LinkProfile:
    """An emulated host-to-device bus: `gbps` Gbit/s (0: no emulation, copies run at memory
    speed) and `latency_us` per transfer. A load's layer groups go over it one after another,
    each one transfer."""

    gbps: float = 0.0
    latency_us: float = 0.0

    def ready_after_s(self, transfers: int, moved_bytes: int) -> float:
        """Seconds from a load's start until a link of this profile has moved `moved_bytes` in
        `transfers` transfers (0 when the link is not emulated)."""
        if self.gbps <= 0:
            return 0.0
        return transfers * self.latency_us * 1e-6 + moved_bytes * 8 / (self.gbps * 1e9)


class ThreadCopy:
    """CPU device: plain copies on the loader thread, each layer group ready no earlier than
    the emulated link would have delivered it. `clock` and `sleep` are time.perf_counter and
    time.sleep outside tests."""

    def __init__(
        self,
        link: LinkProfile = LinkProfile(),
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.link = link
        self._clock, self._sleep = clock, sleep
        self._start = 0.0
        self._groups = 0

    def begin(self) -> None:
        self._start = self._clock()
        self._groups = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def group_done(self, ticket: LoadTicket, layers: int, moved_bytes: int) -> None:
        self._groups += 1
        ready_s = self.link.ready_after_s(self._groups, moved_bytes)
        if ready_s:
            delay = self._start + ready_s - self._clock()
            if delay > 0:
                self._sleep(delay)
        ticket.mark_ready(layers)


class StreamCopy:
    """CUDA device: asynchronous copies on a side stream, one event per layer group."""

    def __init__(self):
        self._stream = torch.cuda.Stream()

    def begin(self) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)

    def group_done(self, ticket: LoadTicket, layers: int, moved_bytes: int) -> None:
        event = torch.cuda.Event()
        event.record(self._stream)
        ticket.add_event(layers, event)


class PipelinedLoader:
    """Runs loads in FIFO order on one background thread (the copy engine of the device).

    link_gbps, link_latency_us: the emulated link of a CPU device (LinkProfile). cores: the
    cores the thread runs on (the host side of the device/host split); empty: any. trace: gets
    one CopyEvent per layer-group copy (None: no tracing)."""

    def __init__(
        self,
        pool: AdapterPool,
        layers_per_group: int = 1,
        link_gbps: float = 0.0,
        link_latency_us: float = 0.0,
        cores: Collection[int] = (),
        trace: TraceRecorder | None = None,
    ):
        if layers_per_group < 1:
            raise ValueError("layers_per_group must be >= 1")
        self.pool = pool
        self.layers_per_group = layers_per_group
        self.bytes_loaded = 0
        self.load_times = LoadTimes()  # submission to last layer resident, per finished load
        if pool.device.type == "cuda":
            self._copier = StreamCopy()
        else:
            self._copier = ThreadCopy(LinkProfile(link_gbps, link_latency_us))
        self._cores = frozenset(cores)
        self._trace = trace
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="adapter-loader", daemon=True)
        self._thread.start()

    @property
    def thread_id(self) -> int | None:
        """The loader thread's kernel id (/proc/<pid>/task/<id>), for diagnostics."""
        return self._thread.native_id

    def submit(self, adapter: LoraAdapter, entry: ResidentAdapter) -> LoadTicket:
        """Start copying `adapter` into the rows of `entry`; returns at once."""
        ticket = LoadTicket(self.pool.config.num_layers, self.load_times)
        self._queue.put((adapter, entry, ticket))
        return ticket

    def idle(self) -> bool:
        return self._queue.unfinished_tasks == 0

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        if self._cores:
            os.sched_setaffinity(0, self._cores)  # this thread only: affinity is per thread
        # Copies of a few rows, on this thread alone: an OpenMP team of its own beside the
        # engine's would slow every decode step (server/process/threads.py). Ask, then set:
        # ATen gives a thread the process-wide count at its first op unless it has asked.
        torch.get_num_threads()
        torch.set_num_threads(1)
        while (item := self._queue.get()) is not None:
            adapter, entry, ticket = item
            try:
                self._load(adapter, entry, ticket)
            except Exception as exc:  # a failed load must not kill the loader
                log.exception("loading adapter %s failed", adapter.name)
                ticket.fail(str(exc))
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _load(self, adapter: LoraAdapter, entry: ResidentAdapter, ticket: LoadTicket) -> None:
        num_layers = self.pool.config.num_layers
        per_layer = _layer_weights(adapter, num_layers)
        elem = self.pool.lora_a[next(iter(entry.targets))].element_size()
        rows = slice(entry.offset, entry.offset + entry.rank)
        self._copier.begin()
        moved = 0
        for g in range(math.ceil(num_layers / self.layers_per_group)):
            lo, hi = g * self.layers_per_group, min((g + 1) * self.layers_per_group, num_layers)
            tracing = self._trace is not None
            started, moved_before = time.perf_counter() if tracing else 0.0, moved
            for layer in range(lo, hi):
                for module, a, b in per_layer[layer]:
                    moved += (a.numel() + b.numel()) * elem
                    self._copier.copy(self.pool.lora_a[module][layer, rows], a)
                    self._copier.copy(self.pool.lora_b[module][layer, rows], b.t())
            copied = time.perf_counter() if tracing else 0.0
            self._copier.group_done(ticket, hi, moved)
            if tracing:
                self._trace.copy_group(
                    CopyEvent(adapter.id, lo, hi, moved - moved_before, started, copied,
                              time.perf_counter())
                )  # fmt: skip
        self.bytes_loaded += moved


def _layer_weights(adapter: LoraAdapter, num_layers: int) -> list[list[tuple]]:
    per_layer: list[list[tuple]] = [[] for _ in range(num_layers)]
    for (layer, module), (a, b) in adapter.weights.items():
        per_layer[layer].append((module, a, b))
    return per_layer
