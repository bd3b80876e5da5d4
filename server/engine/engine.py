"""The engine: continuous batching of many requests over one model and many adapters.

One thread owns all request state. Each iteration it takes new requests and aborts from its
inbox, asks the scheduler (server/sched/scheduler.py) for a step (the newly admitted requests'
prefill, only the part of a prompt not found in the prefix cache under the same adapter, or else
one decode step of the running batch), has the model runner (model_runner.py) compute it, and
gives the tokens back to the scheduler, which streams them to each request's handle. The engine
owns the lifecycle (start, drain, shutdown, adapters) and the reporting (stats, counters).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass

import torch

from toppings.gpu_lora.peft_format import LoraAdapter
from toppings.gpu_lora.trace import TraceRecorder
from toppings.gpu_lora.validate import check_finite_delta
from toppings.server import native
from toppings.server.config import EngineConfig, LoraConfig, MemoryConfig, SchedulingConfig
from toppings.server.engine.adapters import AdapterManager
from toppings.server.engine.grammar import GrammarCompiler
from toppings.server.engine.model_runner import ModelRunner
from toppings.server.memory.build import build_memory
from toppings.server.model.llama import LlamaModel, free_device_bytes
from toppings.server.model.loader import Checkpoint
from toppings.server.model.step_timing import measure_steps
from toppings.server.requests.errors import NOT_FOUND, unknown_adapter
from toppings.server.requests.request import GenerationRequest, RequestError, RequestHandle
from toppings.server.requests.sequence import Sequence
from toppings.server.requests.stats_schema import (
    AdapterView,
    EngineCounters,
    ServerStats,
    WorkerView,
)
from toppings.server.sched.admission import GateLimits
from toppings.server.sched.policies import make_queue_policy
from toppings.server.sched.scheduler import Scheduler, StepPlan
from toppings.server.sched.step_budget import StepBudget, StepTimeModel, choose_step_budget
from toppings.server.sched.step_refit import StepRefit, StepShape, shape_of

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

    def __init__(
        self,
        config: EngineConfig,
        checkpoint: Checkpoint,
        trace: TraceRecorder | None = None,
        step_model: StepTimeModel | None = None,
    ):
        """trace: records adapter copies, host LoRA calls and forward passes (benchmarks; None:
        no tracing, the default). step_model: the step times chunked prefill's budget is sized
        from (None: measured at start-up; a benchmark passes one engine's `step_model` to the
        others it compares, so that they share a budget)."""
        self.step_model = step_model
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
        # Each part goes to the modules it configures; values another part holds go explicitly.
        lora_config, sched_config = config.part(LoraConfig), config.part(SchedulingConfig)
        # KV pool, prefix tree, host tier and adapter cache: one owner of device memory.
        self.memory = build_memory(
            config.part(MemoryConfig), lora_config, config.device, config.max_batch_size,
            mc, dtype, self.max_model_len, self._free_device_bytes, trace,
        )  # fmt: skip
        self.kv = self.memory.kv
        # Chunked prefill's tokens per step (None: chunked prefill off), sized from step times
        # measured here unless the budget is given.
        self.step_budget = None if not config.chunked_prefill else self._choose_step_budget()
        step_budget = self.step_budget.tokens if self.step_budget else None
        # A derived budget follows the steps as they really run (a given one stays).
        derived = step_budget is not None and not config.max_num_batched_tokens
        self._refit = StepRefit(self.step_model) if derived else None
        self._logged_budget = step_budget
        max_step_tokens = max(config.max_prefill_tokens, config.max_batch_size)
        if step_budget is not None:  # a prompt prefilled whole may share a step with the decodes
            max_step_tokens = max(max_step_tokens + config.max_batch_size, step_budget)
        # The only LoRA object the engine uses.
        self.lora = AdapterManager(
            lora_config, config.kernel, config.device, max_step_tokens,
            mc, dtype, self.memory.adapter_cache, trace,
        )  # fmt: skip
        self._adapters = self.lora.registry  # read-only here: name -> LoraAdapter
        # Stop tokens: config.json's, the tokenizer's, and generation_config.json's list (where
        # chat checkpoints name their end of turn: Llama 3's <|eot_id|>, Qwen's <|im_end|>).
        self.eos_ids = set(mc.eos_token_ids) | set(checkpoint.generation_eos_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        # Structured output: constraints compile here, before their request is queued.
        self.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size, self.eos_ids)
        self.runner = ModelRunner.create(
            config.use_cuda_graphs, config.max_batch_size, self.model, self.kv, self.lora,
            self.eos_ids, self.grammars, trace,
        )  # fmt: skip
        limits = GateLimits.from_config(sched_config, self.step_budget)
        self.scheduler = Scheduler(
            make_queue_policy(sched_config, config.max_total_tokens), self.memory, self.lora,
            limits, self.eos_ids, self.max_model_len, on_end=self._request_ended,
        )  # fmt: skip
        self.queue = self.scheduler.queue  # the waiting requests and who goes next
        self._running = self.scheduler.running  # the scheduler's list, read for views
        self._inbox: queue.Queue = queue.Queue()
        self.step_stats = StepStats()
        self._lock = threading.Lock()  # held during a step and while the pool changes
        # Held while requests are checked and queued and while an adapter is removed (taken
        # after _lock where both are held): a request accepted for an adapter counts in
        # _adapter_users until it ends, so no unload can pull the adapter from under it.
        self._accepting = threading.Lock()
        self._adapter_users: Counter[str] = Counter()
        self._stopping = threading.Event()
        self._draining = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def _choose_step_budget(self) -> StepBudget:
        config = self.config
        if self.step_model is None and not config.max_num_batched_tokens:
            times = measure_steps(self.model, self.kv, config.max_batch_size)
            self.step_model = StepTimeModel.fit(times) if times is not None else StepTimeModel()
        budget = self._budget_of(self.step_model)
        log.info("chunked prefill: %d tokens per step, %s", budget.tokens, budget.how)
        return budget

    def _budget_of(self, model: StepTimeModel | None) -> StepBudget:
        config = self.config
        return choose_step_budget(
            config.max_batch_size, config.max_prefill_tokens,
            config.max_num_batched_tokens, config.itl_target_ms, model,
        )  # fmt: skip

    def _refit_step_budget(self, shape: StepShape, seconds: float) -> None:
        """Correct the step model by the step just run (server.sched.step_refit) and, when
        that moves the budget, resize the steps to come."""
        model = self._refit.observe(shape, 1000 * seconds)
        if model is None:
            return
        self.step_model, before = model, self.step_budget
        self.step_budget = budget = self._budget_of(model)
        if (budget.tokens, budget.past_weight, budget.lone_tokens) != (
            before.tokens,
            before.past_weight,
            before.lone_tokens,
        ):
            self.scheduler.set_step_budget(budget)
            # every window moves it a little: logged where it moved a tenth since last logged
            moved = abs(budget.tokens - self._logged_budget) >= self._logged_budget / 10
            if moved:
                self._logged_budget = budget.tokens
            log.log(
                logging.INFO if moved else logging.DEBUG,
                "chunked prefill: %d -> %d tokens per step (real steps: a decode step of %d "
                "%.1f ms, a step with prompt tokens %+.1f ms more, a prompt token after a past "
                "of P counts 1 + %.2g x P)",
                before.tokens, budget.tokens, self.config.max_batch_size,
                model.decode_step_ms(self.config.max_batch_size), model.mixed_fixed_ms,
                budget.past_weight,
            )  # fmt: skip

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
        self.scheduler.abort_all()
        self.lora.close()

    def is_healthy(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def add_adapter(self, name: str, path: str) -> LoraAdapter:
        """Validate a PEFT directory and make it servable (raises AdapterError, also for a
        LoRA product that overflows the model's dtype, or RequestError 507 when it is larger
        than the memory it would live in)."""
        adapter = self.lora.open(path, name)
        check_finite_delta(adapter, self.model.dtype)
        with self._lock:
            self.lora.register(adapter)
        log.info(
            "adapter %s: rank %d, targets %s", name, adapter.rank, ",".join(adapter.target_modules)
        )
        return adapter

    def remove_adapter(self, name: str) -> None:
        """Unregister an adapter; refused (409) while a request accepted for it has not ended."""
        with self._lock, self._accepting:
            if name not in self._adapters:
                raise RequestError(unknown_adapter(name), 404, NOT_FOUND)
            users = self._adapter_users[name]
            if users:
                raise RequestError(
                    f"adapter {name!r} is in use by {users} requests; retry when they end",
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
            finished=dict(self.scheduler.finished),
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
            step_budget_tokens=self.step_budget and self.step_budget.tokens,
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
        for constraint in {r.params.constraint for r in requests} - {None}:
            self.grammars.compile(constraint)  # a spec that cannot compile: 400, nothing queued
        with self._accepting:  # an unload sees these requests from here on
            for request in requests:
                self._check(request)
            seqs = [Sequence(r, RequestHandle(r, self.abort), self.tokenizer, time.monotonic())
                    for r in requests]  # fmt: skip
            self._adapter_users.update(r.adapter for r in requests if r.adapter is not None)
            self._inbox.put(seqs)
        return [s.handle for s in seqs]

    def _request_ended(self, seq: Sequence) -> None:
        """A request ended on any path: it no longer keeps its adapter registered."""
        if seq.request.adapter is not None:
            with self._accepting:
                users = self._adapter_users
                users[seq.request.adapter] -= 1
                if not users[seq.request.adapter]:
                    del users[seq.request.adapter]  # no entry kept per adapter name ever used

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
            free_kv_tokens=self.memory.free_tokens(),
            max_total_tokens=self.kv.num_slots,
            memory=self.memory.view(),
            healthy=self.is_healthy(),
            cpu_workers=tuple(WorkerView(**w) for w in self.lora.worker_stats()),
            resident_adapters=tuple(resident),
            loading_adapters=tuple(loading),
            queueing=self.queue.view(),
            adapter_host_memory=self.lora.host_memory.view(),
        )

    # ---- the engine thread ------------------------------------------------------------------

    def _loop(self) -> None:
        device_cores = self.config.device_cores
        if device_cores:
            # The device side of the split: this thread only (affinity is per thread), before
            # its first torch op, so the OpenMP team it creates inherits the same cores.
            os.sched_setaffinity(0, device_cores)
        num_threads = self.config.num_threads or len(device_cores)
        if num_threads:
            # Per thread: torch.set_num_threads sets the calling thread's OpenMP team size. ATen
            # gives a thread the process-wide count (the last one set, by any thread) at its
            # first parallel op unless it has asked for its count before: ask first, then set.
            torch.get_num_threads()
            torch.set_num_threads(num_threads)
        while not self._stopping.is_set():
            self._drain_inbox(block=not (len(self.queue) or self._running))
            if self._stopping.is_set():
                break
            if self.step() is None:
                # Requests wait for an adapter load or for adapter memory: poll, don't spin.
                time.sleep(0.002)

    def step(self) -> StepPlan | None:
        """One iteration of the loop: take what was submitted, schedule a step and run it.
        Returns the plan run, or None when nothing could run. The engine thread calls it; a
        test may drive an engine it has not started with it."""
        self._drain_inbox(block=False)
        with self._lock:
            started = time.perf_counter()  # a stream waits for the scheduling as well
            try:
                plan = self.scheduler.schedule()
            except Exception:  # the loop outlives any fault of a plan's making
                log.exception("scheduling failed")
                return None
            if plan is None:
                return None
            shape = shape_of(plan) if self._refit is not None else None
            try:
                outcome = self.runner.run(plan)
                for seq, error in outcome.failed.items():  # fails alone; its neighbours go on
                    log.warning("request %s failed: %s", seq.request.request_id, error)
                    self.scheduler.finish(seq, "error", error=error)
                if outcome.plan.seqs:
                    self.scheduler.update(outcome.plan, outcome.result)
            except Exception as exc:  # keep serving: fail this step's requests only
                log.exception("engine step failed")
                self.scheduler.fail(plan, f"engine error: {exc}")
            seconds = time.perf_counter() - started
            self._count_step(plan.is_prefill, seconds)
            if shape is not None:
                self._refit_step_budget(shape, seconds)
        return plan

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
                        self.scheduler.add(seq)
                elif isinstance(item, str):
                    self.scheduler.abort(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
