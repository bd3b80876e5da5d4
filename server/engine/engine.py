"""The engine loop: continuous batching of many requests over one model and many adapters.

One thread owns all request state. Each iteration it takes new requests and aborts from its inbox,
admits waiting requests while their prompt plus max_new_tokens fit in the memory not yet
promised (server/memory/manager.py), prefills the newly admitted ones (only the part of a prompt not
found in the prefix cache under the same adapter), or else runs one decode step of the running
batch, and streams every new token to the request's handle.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from toppings.gpu_lora.peft_format import LoraAdapter, load_peft_adapter
from toppings.server import native
from toppings.server.config import EngineConfig
from toppings.server.engine.adapters import AdapterManager
from toppings.server.engine.decode_step import DecodeStep
from toppings.server.memory.build import build_memory
from toppings.server.model.llama import ForwardBatch, LlamaModel, free_device_bytes
from toppings.server.model.loader import Checkpoint
from toppings.server.requests.errors import NOT_FOUND, unknown_adapter
from toppings.server.requests.request import GenerationRequest, RequestError, RequestHandle
from toppings.server.requests.sequence import Sequence
from toppings.server.requests.stats_schema import (
    AdapterView,
    EngineCounters,
    ServerStats,
    WorkerView,
)
from toppings.server.sched.admission import EngineGate
from toppings.server.sched.policies import make_queue_policy

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    """Counts and wall time of engine steps (for benchmarks and metrics)."""

    prefill_steps: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_s: float = 0.0

    def reset(self) -> None:
        self.prefill_steps, self.prefill_s, self.decode_steps, self.decode_s = 0, 0.0, 0, 0.0


class Engine:
    """One model on one device, serving a stream of requests; see the module docstring."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint):
        self.config = config
        self.model_name = checkpoint.name
        self.model_config = mc = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        dtype = getattr(torch, config.dtype)
        if config.device == "cpu":
            native.keep_freed_memory()
        self.model = LlamaModel(mc, checkpoint.weights, dtype, config.device, self.max_model_len)
        # KV pool, prefix tree, host tier and adapter cache: one owner of device memory.
        self.memory = build_memory(config, mc, dtype, self.max_model_len, self._free_device_bytes)
        self.kv = self.memory.kv
        # The only LoRA object the engine uses.
        self.lora = AdapterManager(config, mc, dtype, self.memory.adapter_cache)
        self.decode = DecodeStep.create(config, self.model, self.kv, self.lora)
        self._adapters = self.lora.registry  # read-only here: name -> LoraAdapter
        self.eos_ids = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self._inbox: queue.Queue = queue.Queue()
        self.queue = make_queue_policy(config)  # the waiting requests and who goes next
        self._running: list[Sequence] = []
        self.step_stats = StepStats()
        self._lock = threading.Lock()  # held during a step and while the pool changes
        self._stopping = threading.Event()
        self._draining = threading.Event()
        self._finished: dict[str, int] = {}  # finish reason -> requests
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def _free_device_bytes(self) -> int:
        return free_device_bytes(self.model.device)

    # ---- called from any thread -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the loop; every unfinished request ends with finish_reason "abort"."""
        self._stopping.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join()
        self._drain_inbox(block=False)
        for seq in list(self.queue) + list(self._running):
            self._finish(seq, "abort")
        self.lora.close()

    def is_healthy(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def add_adapter(self, name: str, path: str) -> LoraAdapter:
        """Validate a PEFT directory and make it servable (raises AdapterError)."""
        adapter = load_peft_adapter(path, self.model_config, name=name)
        with self._lock:
            self.lora.register(adapter)
        log.info(
            "adapter %s: rank %d, targets %s", name, adapter.rank, ",".join(adapter.target_modules)
        )
        return adapter

    def remove_adapter(self, name: str) -> None:
        """Unregister an adapter; refused (409) while a queued or running request uses it."""
        with self._lock:
            if name not in self._adapters:
                raise RequestError(unknown_adapter(name), 404, NOT_FOUND)
            with self._inbox.mutex:  # requests submitted but not yet picked up count too
                pending = [s for item in self._inbox.queue if isinstance(item, list)
                           for s in item]  # fmt: skip
            seqs = pending + list(self.queue) + self._running
            users = [s for s in seqs if s.request.adapter == name]
            if users:
                raise RequestError(
                    f"adapter {name!r} is in use by {len(users)} requests; retry when they end",
                    409, "conflict",
                )  # fmt: skip
            self.lora.unregister(name)
            self.memory.forget_adapter(name)
        log.info("adapter %s removed", name)

    def drain(self, timeout_s: float) -> bool:
        """Stop admitting new requests and wait for queued and running ones to end."""
        self._draining.set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not len(self.queue) and not self._running and self._inbox.empty():
                return True
            time.sleep(0.05)
        return False

    def counters(self) -> EngineCounters:
        """Monotonic counters and current gauges, for /metrics."""
        st = self.step_stats
        return EngineCounters(
            finished=dict(self._finished),
            prefill_steps=st.prefill_steps,
            prefill_seconds=st.prefill_s,
            decode_steps=st.decode_steps,
            decode_seconds=st.decode_s,
            host_lora_calls=self.lora.host_stats.calls,
            host_lora_seconds=self.lora.host_stats.seconds,
            num_running=len(self._running),
            num_waiting=len(self.queue),
            queueing=self.queue.view(),
            kv_reserved_tokens=self.memory.reserved * self.kv.block_tokens,
            kv_used_tokens=self.kv.num_slots - self.kv.num_free_slots,
            max_total_tokens=self.kv.num_slots,
            memory=self.memory.view(),
            adapter_cache=self.lora.cache.snapshot(),
            adapter_references=self.lora.references(),
        )

    def adapters(self) -> list[dict]:
        return [
            {
                "name": a.name,
                "rank": a.rank,
                "path": a.path,
                "target_modules": list(a.target_modules),
            }
            for a in list(self._adapters.values())
        ]

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; raises RequestError when it can never be served."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: list[GenerationRequest]) -> list[RequestHandle]:
        """Queue requests together (the choices and prompts of one HTTP request): the engine
        picks them up in one iteration, so they share a prefill step. Raises RequestError for
        the first that can never be served, and then queues none."""
        for request in requests:
            self._check(request)
        seqs = [Sequence(r, RequestHandle(r, self.abort), self.tokenizer, time.monotonic())
                for r in requests]  # fmt: skip
        self._inbox.put(seqs)
        return [s.handle for s in seqs]

    def _check(self, request: GenerationRequest) -> None:
        if self._stopping.is_set() or self._draining.is_set():
            raise RequestError("the server is shutting down", 503, "unavailable")
        ids = request.prompt_ids
        if not ids:
            raise RequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise RequestError(f"token ids must be integers in [0, {vocab})")
        if request.adapter is not None and request.adapter not in self._adapters:
            raise RequestError(unknown_adapter(request.adapter), 404, NOT_FOUND)
        need = len(ids) + request.params.max_new_tokens
        if need > self.max_model_len:
            raise RequestError(
                f"prompt ({len(ids)} tokens) plus max_new_tokens "
                f"({request.params.max_new_tokens}) exceeds the context of "
                f"{self.max_model_len} tokens"
            )
        mem = self.memory
        blocks = mem.blocks_for(need)
        if mem.shared and request.adapter is not None:
            blocks += mem.blocks_for_bytes(self.lora.bytes_of(request.adapter))
        if blocks > self.kv.num_blocks:
            raise RequestError(
                f"request needs {blocks} memory blocks of {self.kv.block_tokens} tokens (KV for "
                f"{need} tokens and its adapter); the server has {self.kv.num_blocks}"
            )

    def abort(self, request_id: str) -> None:
        self._inbox.put(request_id)

    def stats(self) -> ServerStats:
        """What the cluster scheduler needs; cheap, no lock (snapshots of the lists)."""
        resident, loading = self.lora.residency()  # one read of the cache entries
        is_resident = set(resident)
        return ServerStats(
            model=self.model_name,
            kernel=self.config.kernel,
            device=self.config.device,
            lora_mode=self.config.lora_mode,
            running=tuple(s.describe(self._adapters) for s in list(self._running)),
            queue=tuple(s.describe(self._adapters) for s in self.queue),
            adapters=tuple(
                AdapterView(n, a.rank, n in is_resident) for n, a in list(self._adapters.items())
            ),
            free_kv_tokens=(self.kv.num_blocks - self.memory.committed()) * self.kv.block_tokens,
            max_total_tokens=self.kv.num_slots,
            memory=self.memory.view(),
            healthy=self.is_healthy(),
            cpu_workers=tuple(WorkerView(**w) for w in self.lora.worker_stats()),
            resident_adapters=tuple(resident),
            loading_adapters=tuple(loading),
            queueing=self.queue.view(),
        )

    # ---- the engine thread ------------------------------------------------------------------

    def _loop(self) -> None:
        if self.config.num_threads:
            # Per thread: torch.set_num_threads sets the calling thread's OpenMP team size. ATen
            # gives a thread the process-wide count (the last one set, by any thread) at its
            # first parallel op unless it has asked for its count before: ask first, then set.
            torch.get_num_threads()
            torch.set_num_threads(self.config.num_threads)
        while not self._stopping.is_set():
            self._drain_inbox(block=not (len(self.queue) or self._running))
            if self._stopping.is_set():
                break
            with self._lock:
                self.memory.tick(time.monotonic())
                admitted = self._admit()
                step = admitted or list(self._running)
                if step:
                    started = time.perf_counter()
                    try:
                        self._step(step, is_prefill=bool(admitted))
                    except Exception as exc:  # keep serving: fail this step's requests only
                        log.exception("engine step failed")
                        for seq in step:
                            self._finish(seq, "error", error=f"engine error: {exc}")
                    self._count_step(bool(admitted), time.perf_counter() - started)
            if not step:
                # Requests wait for an adapter load or for adapter memory: poll, don't spin.
                time.sleep(0.002)

    def _count_step(self, is_prefill: bool, seconds: float) -> None:
        st = self.step_stats
        if is_prefill:
            st.prefill_steps += 1
            st.prefill_s += seconds
        else:
            st.decode_steps += 1
            st.decode_s += seconds

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if isinstance(item, list):  # requests submitted together
                    for seq in item:
                        self.queue.push(seq, time.monotonic())
                elif isinstance(item, str):
                    self._abort(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _abort(self, request_id: str) -> None:
        for seq in list(self.queue) + self._running:
            if seq.request.request_id == request_id:
                self._finish(seq, "abort")

    def _admit(self) -> list[Sequence]:
        """The requests the queue policy admits now, through this iteration's gate."""
        return self.queue.select(EngineGate(self), self._running, time.monotonic())

    def _step(self, seqs: list[Sequence], is_prefill: bool) -> None:
        # One adapter's requests side by side: the LoRA kernels run once per run of them.
        seqs = sorted(seqs, key=lambda s: s.request.adapter or "")
        if is_prefill:
            logits = self._prefill(seqs)  # [B, V]
        else:
            logits = self.decode.forward(seqs)  # [B, V]: a CUDA graph's replay, or eager
            self.memory.after_decode(len(seqs), time.monotonic())
        tokens = Sequence.sample_batch(seqs, logits, self.eos_ids)
        for seq, token in zip(seqs, tokens):
            reason = seq.append(token, self.eos_ids, self.max_model_len)
            if reason is not None:
                self._finish(seq, reason)

    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Compute the prompts (each from the end of its cached prefix, the row's length so
        far) and start running them; returns their last tokens' logits [B, V]."""
        device = self.model.device
        starts = [self.kv.lengths[s.kv_hold.row] for s in seqs]
        past = [self.kv.req_to_slot[s.kv_hold.row, :n] if n else None
                for s, n in zip(seqs, starts)]  # fmt: skip
        slots = torch.cat([self.kv.extend(s.kv_hold.row, s.prompt_len - n)
                           for s, n in zip(seqs, starts)])  # fmt: skip
        ids = [t for s, n in zip(seqs, starts) for t in s.request.prompt_ids[n:]]
        positions = [p for s, n in zip(seqs, starts) for p in range(n, s.prompt_len)]
        seg_starts = [0]
        for s, n in zip(seqs, starts):
            seg_starts.append(seg_starts[-1] + s.prompt_len - n)
        rows = Sequence.logit_rows(seqs, seg_starts)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            slots=slots,
            seg_starts=seg_starts,
            is_prefill=True,
            past_slots=past,
            lora=self.lora.step([s.cache_entry for s in seqs], seg_starts, True),
            logit_rows=None if rows is None else torch.tensor(rows, device=device),
        )
        started = time.perf_counter()
        logits = self.model.forward(batch, self.kv)  # [R, V]; R = B unless a prompt is scored
        logits = Sequence.score_prompts(seqs, logits, seg_starts)  # [B, V]
        self._running.extend(seqs)
        self.memory.after_prefill(seqs, time.perf_counter() - started, len(ids), time.monotonic())
        return logits

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End a request on any path: free its KV row and reservation, send the last output."""
        if seq.finished:
            return
        self._finished[reason] = self._finished.get(reason, 0) + 1
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self.queue:
            self.queue.remove(seq)
        if seq.kv_hold is not None:
            self.queue.finished(seq, reason in ("stop", "length"), time.monotonic())
        self.release(seq, keep_kv=reason != "error")
        seq.finish(reason, error)

    def release(self, seq: Sequence, keep_kv: bool = True) -> None:
        """Give back a request's KV row, reservation and prefix-tree nodes (its computed blocks
        stay cached unless keep_kv is False: after an error) and its adapter reference."""
        if seq.kv_hold is not None:
            self.memory.release(seq, keep_kv, time.monotonic())
        if seq.cache_entry is not None:
            self.lora.release(seq.request.adapter)
            seq.cache_entry = None
