"""The engine: continuous batching of many requests over one model and many adapters.

One thread owns all request state. Each iteration it takes new requests and aborts from its
inbox (inbox.py), asks the scheduler (server/sched/scheduler.py) for a step (each scheduled
request's token count: the running decodes, prompt chunks, or whole prompts after their cached
prefix, its KV slots reserved), has the model runner (model_runner.py) compute it, and gives the
tokens back to the scheduler, which hands each request's new token to its text side: the output
processor's thread (output_processor.py: detokenizing, stop strings, streaming to the handle;
`--output-thread`) or the engine thread itself. With async scheduling (`--async-scheduling`, on
with cuda) the model runs each step on a thread of its own while the engine thread plans the
next one (step_pipeline.py). The engine owns the loop and the lifecycle
(start, drain, shutdown; adapters through adapter_admin.py); its parts are built by
compose.py, the chunked-prefill budget is server/sched/step_budget_keeper.py's, its reports
are reports.py's.
"""

from __future__ import annotations

import logging
import threading
import time

from toppings.gpu_lora.host_memory import ContentKey
from toppings.gpu_lora.peft.adapter import LoraAdapter
from toppings.gpu_lora.trace import TraceRecorder
from toppings.server.config import EngineConfig
from toppings.server.engine import reports
from toppings.server.engine.adapter_admin import AdapterAdmin
from toppings.server.engine.compose import compose_engine
from toppings.server.engine.inbox import Inbox
from toppings.server.engine.model_runner import StepOutcome
from toppings.server.engine.output_processor import OutputProcessor
from toppings.server.engine.step_pipeline import Launched, StepPipeline, reads_its_output
from toppings.server.kv_events.publisher import Sink
from toppings.server.model.loader import Checkpoint
from toppings.server.process.thread_governor import ThreadGovernor
from toppings.server.process.threads import (
    engine_thread_count,
    enter_engine_thread,
    torch_on_this_thread_only,
)
from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.requests.engine_counters import EngineCounters
from toppings.server.requests.errors import RETRY_AFTER_S, UNAVAILABLE
from toppings.server.requests.request import GenerationRequest, RequestError, RequestHandle
from toppings.server.requests.sequence import Sequence
from toppings.server.requests.stats_schema import ServerStats
from toppings.server.sched.admission import check_request
from toppings.server.sched.plan import StepPlan
from toppings.server.sched.step_budget import StepBudget, StepTimeModel

log = logging.getLogger(__name__)


class Engine:
    """One model on one device, serving a stream of requests; see the module docstring."""

    def __init__(
        self,
        config: EngineConfig,
        checkpoint: Checkpoint,
        trace: TraceRecorder | None = None,
        step_model: StepTimeModel | None = None,
        kv_sink: Sink | None = None,
    ):
        """trace: records adapter copies, host LoRA calls and forward passes (benchmarks; None:
        no tracing, the default). step_model: the step times chunked prefill's budget is sized
        from (None: measured at start-up; a benchmark passes one engine's `step_model` to the
        others it compares, so that they share a budget). kv_sink: where the prefix cache's KV
        events go instead of --kv-events-endpoint (tests capture them in-process; None: the
        endpoint, if any)."""
        self.config = config
        self.model_name, self.model_config = checkpoint.name, checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        parts = compose_engine(config, checkpoint, self._request_ended, trace, step_model, kv_sink)
        self.max_model_len, self.model, self.memory = parts.max_model_len, parts.model, parts.memory
        self.kv, self.lora, self.budget = parts.kv, parts.lora, parts.budget
        self.eos_ids, self.grammars = parts.eos_ids, parts.grammars
        self.runner, self.scheduler = parts.runner, parts.scheduler
        self.queue = self.scheduler.queue  # the waiting requests and who goes next
        self.step_stats = reports.StepStats()
        self._lock = threading.Lock()  # held during a step and while the pool changes
        self.admin = AdapterAdmin(
            self.lora,
            self.memory,
            self.queue,
            self._lock,
            self.model.dtype,
            lambda ref: self.inbox.retired(ref),  # the inbox is built with the admin's forget
        )
        self.inbox = Inbox(self.scheduler, self.admin.forget_retired)
        # Detokenizing, stop strings and streaming (None: inside each step, on the engine thread)
        self.outputs = OutputProcessor(self.inbox.end) if config.use_output_thread else None
        # A request accepted for an adapter counts in flight there until it ends: no unload can
        # pull the adapter from under it (server/adapters/registry.py).
        self.adapter_refs = self.lora.refs
        self._stopping = threading.Event()
        self._draining = threading.Event()
        # The engine thread's OpenMP team, as the thread that builds the engine sees it
        self._num_threads = engine_thread_count(config)
        self.governor = None
        if config.use_thread_governor:
            self.governor = ThreadGovernor(self._num_threads, cores=config.device_cores)
        self.pipeline = None
        if config.use_async:
            cores = config.device_cores
            self.pipeline = StepPipeline(
                self.runner,
                self.scheduler,
                self._wait_for_loads,
                lambda: enter_engine_thread(self._num_threads, cores),
            )
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    @property
    def num_threads(self) -> int:
        """The engine thread's OpenMP team (the cores its steps take on a CPU)."""
        return self._num_threads

    @property
    def step_budget(self) -> StepBudget | None:
        """Chunked prefill's budget now (None: chunked prefill off)."""
        return self.budget.budget if self.budget is not None else None

    @property
    def step_model(self) -> StepTimeModel | None:
        """The step-time model the budget is sized from (None: not modelled)."""
        return self.budget.step_model if self.budget is not None else None

    # ---- called from any thread -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the loop; every unfinished request ends with finish_reason "abort"."""
        self._stopping.set()
        self.inbox.wake()
        if self._thread.is_alive():
            self._thread.join()
        self.inbox.drain(block=False)
        self.scheduler.abort_all()
        if self.outputs is not None:
            self.outputs.close()  # every final output put, the thread joined
        if self.pipeline is not None:
            self.pipeline.close()
        self.lora.close()
        self.memory.close()

    def is_healthy(self) -> bool:
        outputs_alive = self.outputs is None or self.outputs.is_alive
        return self._thread.is_alive() and not self._stopping.is_set() and outputs_alive

    def resolve_adapter(self, name: str | None) -> AdapterRef | None:
        """The reference a request for adapter `name` carries (None: the base model); 404
        when no adapter has that name."""
        return self.adapter_refs.resolve(name)

    def add_adapter(self, name: str, path: str) -> LoraAdapter:
        """Validate a PEFT directory and make it servable (raises AdapterError, also for a
        LoRA product that overflows the model's dtype, or RequestError 507 when it is larger
        than the memory it would live in)."""
        adapter = self.admin.open(name, path)
        self.admin.register(adapter)
        return adapter

    def open_adapter(self, name: str, path: str) -> LoraAdapter:
        """`add_adapter`'s read and checks, without registering (AdapterAdmin.open)."""
        return self.admin.open(name, path)

    def register_adapter(
        self, adapter: LoraAdapter, content: ContentKey | None = None
    ) -> AdapterRef:
        """Make an adapter from `open_adapter` servable (AdapterAdmin.register)."""
        return self.admin.register(adapter, content)

    def remove_adapter(self, name: str) -> LoraAdapter:
        """Unregister an adapter, waiting for a running step (AdapterAdmin.remove)."""
        return self.admin.remove(name)

    def retire_adapter(self, name: str) -> LoraAdapter:
        """Unregister an adapter, its device side before the next plan (AdapterAdmin.retire)."""
        return self.admin.retire(name)

    def drain(self, timeout_s: float) -> bool:
        """Stop admitting new requests and wait for queued and running ones to end."""
        self._draining.set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.scheduler.has_work() and self.inbox.empty():
                return True
            time.sleep(0.05)
        return False

    def counters(self) -> EngineCounters:
        """Monotonic counters and current gauges, for /metrics (reports.py)."""
        return reports.counters(self)

    def num_adapters(self) -> int:
        """How many adapters are registered (cheap: no list)."""
        return self.lora.host.num_registered

    def adapters(self) -> list[dict]:
        return reports.adapter_list(self)

    def stats(self, adapters_since: str | None = None) -> ServerStats:
        """What the cluster scheduler needs (reports.py); cheap, no lock. `adapters_since`: an
        earlier `adapters_version`; the adapter list is left out while it still holds."""
        return reports.stats(self, adapters_since)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; raises RequestError when it can never be served."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: list[GenerationRequest]) -> list[RequestHandle]:
        """Queue requests together (the choices and prompts of one HTTP request): the engine
        picks them up in one iteration, so they share a prefill step. Raises RequestError for
        the first that can never be served, and then queues none."""
        for constraint in {r.params.constraint for r in requests} - {None}:
            self.grammars.compile(constraint)  # a spec that cannot compile: 400, nothing queued
        if self._stopping.is_set() or self._draining.is_set():
            raise RequestError(  # a client may retry at once: another replica takes it
                "the server is shutting down", 503, UNAVAILABLE, retry_after_s=RETRY_AFTER_S
            )
        refs = [r.adapter for r in requests]
        self.adapter_refs.acquire(refs)  # 404 if unloaded since resolved; no unload from here
        try:
            for request in requests:
                self._check(request)
            lora_starts = [self.lora.steps.lora_start(r.adapter, r.prompt_ids) for r in requests]
            seqs = [Sequence(r, RequestHandle(r, self.abort), self.tokenizer, time.monotonic(),
                             self.outputs) for r in requests]  # fmt: skip
            for seq, lora_start in zip(seqs, lora_starts, strict=True):
                seq.lora_start = lora_start
                seq.is_activated = self.lora.steps.is_activated(seq.request.adapter)
        except BaseException:
            for ref in refs:
                self.adapter_refs.release(ref)
            raise
        self.inbox.submit(seqs)
        return [s.handle for s in seqs]

    def _check(self, request: GenerationRequest) -> None:
        vocab = self.model_config.vocab_size
        check_request(request, vocab, self.max_model_len, self.memory, self.lora)

    def _request_ended(self, seq: Sequence) -> None:
        """A request ended on any path: it no longer keeps its adapter registered."""
        self.adapter_refs.release(seq.request.adapter)

    def abort(self, request_id: str) -> None:
        self.inbox.abort(request_id)

    def abort_all(self) -> None:
        """End every request queued or running with finish_reason "abort" (on the engine
        thread, at its next iteration): a drain whose time ran out."""
        self.inbox.abort_all()

    # ---- the engine thread ------------------------------------------------------------------

    def _loop(self) -> None:
        if self.pipeline is None:
            enter_engine_thread(self._num_threads, self.config.device_cores)
        else:
            torch_on_this_thread_only()  # the model runs on the device lane, with its team
        try:
            while not self._stopping.is_set():
                idle = not self.scheduler.has_work() and self._pending() is None
                self.inbox.drain(block=idle)
                if self._stopping.is_set():
                    break
                plan = self.step() if self.pipeline is None else self._step_ahead()
                if plan is None and self._pending() is None:
                    # Requests wait for an adapter load or for adapter memory: poll, don't spin.
                    time.sleep(0.002)
        finally:
            if (pending := self._pending()) is not None:
                with self._lock:
                    self._take_back(pending)

    def _pending(self) -> Launched | None:
        return self.pipeline.pending if self.pipeline is not None else None

    def _step_ahead(self) -> StepPlan | None:
        """One iteration with async scheduling (step_pipeline.py): plan the next step while the
        one on the device runs (ahead of a decode step only), launch it, then take the one
        before back. Returns the plan launched, or None."""
        with self._lock:
            pending = self.pipeline.pending
            if pending is not None and not pending.is_chainable:
                self._take_back(pending)
                pending = None
            try:
                plan = self.scheduler.schedule()  # its KV slots reserved
            except Exception:  # the loop outlives any fault of a plan's making
                log.exception("scheduling failed")
                plan = None
            if plan is not None:
                if pending is not None and any(map(reads_its_output, plan.seqs)):
                    self._take_back(pending)  # its sampling reads the tokens before
                    pending = None
                try:
                    shape = self.budget.shape_of(plan) if self.budget is not None else None
                    self.pipeline.launch(plan, shape)
                except Exception as exc:
                    log.exception("engine step failed")
                    self.scheduler.fail(plan, f"engine error: {exc}")
            if pending is not None:
                self._take_back(pending)
        self._flush_outputs()
        return plan

    def _take_back(self, launched: Launched) -> None:
        """Wait for a launched step and give its tokens to the scheduler (under the lock)."""
        outcome, seconds, error = self.pipeline.take_back(launched)
        plan = launched.plan
        try:
            if error is not None:
                log.error("engine step failed", exc_info=error)
                self.scheduler.fail(plan, f"engine error: {error}")
            else:
                self._apply(outcome)
        finally:
            self.scheduler.returned(plan)
        self._observe(plan, launched.shape, seconds)

    def _flush_outputs(self) -> None:
        """The step's output records to the output processor, one batch a step."""
        if self.outputs is not None:
            self.outputs.flush()

    def _wait_for_loads(self, plan: StepPlan) -> None:
        """Under on-demand-sync, wait until the plan's adapters are loaded (else at once)."""
        self.lora.steps.wait_for_loads([s.cache_entry for s in plan.seqs])

    def _apply(self, outcome: StepOutcome) -> None:
        for seq, error in outcome.failed.items():  # fails alone; its neighbours go on
            log.warning("request %s failed: %s", seq.request.request_id, error)
            self.scheduler.finish(seq, "error", error=error)
        if outcome.plan.seqs:
            self.scheduler.update(outcome.plan, outcome.result)

    def _observe(self, plan: StepPlan, shape, seconds: float) -> None:
        """A step's time, for the reports, the thread governor and the step budget's refit."""
        self.step_stats.count(plan.is_prefill, seconds)
        if self.governor is not None and not plan.is_prefill:
            self.governor.observe(len(plan.seqs), seconds)
        if shape is not None and (moved := self.budget.observe(shape, seconds)) is not None:
            self.scheduler.set_step_budget(moved)

    def step(self) -> StepPlan | None:
        """One iteration of the loop: take what was submitted, schedule a step and run it.
        Returns the plan run, or None when nothing could run. The engine thread calls it; a
        test may drive an engine it has not started with it."""
        self.inbox.drain(block=False)
        with self._lock:
            started = time.perf_counter()  # a stream waits for the scheduling as well
            try:
                plan = self.scheduler.schedule()  # its KV slots reserved
            except Exception:  # the loop outlives any fault of a plan's making
                log.exception("scheduling failed")
                plan = None
            if plan is not None:
                self._run(plan, started)
        self._flush_outputs()  # also an abort's final output when nothing ran
        return plan

    def _run(self, plan: StepPlan, started: float) -> None:
        """Run a plan on this thread and give its tokens to the scheduler (under the lock)."""
        shape = self.budget.shape_of(plan) if self.budget is not None else None
        if self.governor is not None:
            self.governor.apply(plan.is_prefill)
        try:
            self._wait_for_loads(plan)
            self._apply(self.runner.run(plan))
        except Exception as exc:  # keep serving: fail this step's requests only
            log.exception("engine step failed")
            self.scheduler.fail(plan, f"engine error: {exc}")
        self._observe(plan, shape, time.perf_counter() - started)
