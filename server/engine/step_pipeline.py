"""Async scheduling: the next step planned and its inputs read while the device runs this one.

The synchronous loop puts every host task on the device's critical path: plan, read the inputs,
run, wait, sample, update each request, plan again. With async scheduling (vLLM v1's
`--async-scheduling`, SGLang's overlap scheduler) the device side of a step (the forward pass
and the sampling: `ModelRunner.execute`) runs on a thread of its own, the device lane, which
runs steps one after the other in launch order as a CUDA stream runs kernels. While it runs
step N, the engine thread plans step N+1, reads its inputs from the KV tables and the requests
(`ModelRunner.prepare`) and launches it, and only then waits for step N's tokens and gives them
to the scheduler. A decode of step N+1 whose token step N samples takes it from step N's result
on the lane (`DecodeRows.fill`, `PreparedStep.in_flight` in a mixed step), so the device never
waits for the host's update.

The step time is then the larger of the device's and the host's, not their sum. A plan is made
ahead of a decode step only: a prompt chunk in flight would move the prompt's progress that
the next plan starts from. A request whose sampling reads its own output so far (a grammar, a
penalty, min_tokens: `reads_its_output`) is not planned ahead of its own token either: the
step with it is taken back first, and a plan with it waits for the step before. The scheduler
keeps what ends meanwhile until its step is back (`Scheduler.launched` / `returned`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from toppings.server.engine.model_runner import ModelRunner, PreparedStep, StepOutcome
from toppings.server.requests.sequence import Sequence
from toppings.server.sched.plan import StepPlan
from toppings.server.sched.scheduler import Scheduler
from toppings.server.sched.step_refit import StepShape

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Launched:
    """A step on the device lane: its plan, its outcome to come (with the lane's seconds), and
    its shape as the step budget's refit takes it before the step runs (None: not followed)."""

    plan: StepPlan
    outcome: Future  # -> (StepOutcome, seconds)
    shape: StepShape | None = None

    @property
    def is_chainable(self) -> bool:
        """Whether the next step may be planned before this one is back: a decode step none of
        whose requests samples from its own output so far."""
        return not self.plan.is_prefill and not any(map(reads_its_output, self.plan.seqs))


def reads_its_output(seq: Sequence) -> bool:
    """Whether the request's sampling reads its output so far (a grammar advanced by each
    token; penalties, min_tokens and the like: `SamplingParams.has_processors`), which is not
    all there while a step of it is in flight."""
    params = seq.request.params
    return params.constraint is not None or params.has_processors


class StepPipeline:
    """The device lane and the step on it; see the module docstring. `before_run(plan)` runs
    on the lane before each step (the wait for adapter loads under on-demand-sync);
    `enter_lane` sets up the lane's thread (it runs the model: the OpenMP team is its)."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        before_run: Callable[[StepPlan], None],
        enter_lane: Callable[[], None],
    ):
        self.runner, self.scheduler, self._before_run = runner, scheduler, before_run
        self._lane = ThreadPoolExecutor(1, thread_name_prefix="device-lane", initializer=enter_lane)
        self.pending: Launched | None = None

    def launch(self, plan: StepPlan, shape: StepShape | None = None) -> None:
        """Read the plan's inputs now and run it on the lane after the step there (whose
        sampled tokens are the inputs of the requests it has in flight)."""
        previous = self.pending
        self.scheduler.launched(plan)
        try:
            step = self.runner.prepare(plan, previous.plan if previous is not None else None)
        except BaseException:
            self.scheduler.returned(plan)
            raise
        before = previous.outcome if previous is not None else None
        self.pending = Launched(plan, self._lane.submit(self._run, step, before), shape)

    def take_back(self, launched: Launched) -> tuple[StepOutcome | None, float, Exception | None]:
        """Wait for a launched step: its outcome and the lane's seconds for it, or the error it
        raised. Its requests are no longer on the device once the caller has applied it
        (`Scheduler.returned`)."""
        if self.pending is launched:
            self.pending = None
        try:
            outcome, seconds = launched.outcome.result()
            return outcome, seconds, None
        except Exception as exc:  # noqa: BLE001 - the step's requests fail, the loop goes on
            return None, 0.0, exc

    def close(self) -> None:
        """Stop the lane after the step on it."""
        self._lane.shutdown(wait=True)

    def _run(self, step: PreparedStep, before: Future | None) -> tuple[StepOutcome, float]:
        started = time.perf_counter()
        previous = None
        if before is not None and before.exception() is None:  # done: the lane runs in order
            previous = before.result()[0]
        self._before_run(step.plan)
        outcome = self.runner.execute(step, previous)
        return outcome, time.perf_counter() - started
