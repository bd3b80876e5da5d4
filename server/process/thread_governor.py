"""How many OpenMP threads the engine's steps run on, chosen from the steps it runs.

A CPU decode step is some 150 parallel regions (the GEMVs, attention, norms), each ending in a
barrier: with one thread per core, a neighbour that takes a core (another process; on Linux
with autogroup, `nice` does not rank processes of different sessions) deschedules one of the
team at some barrier, and the others wait a scheduler slice for it, region after region. Steps
then take several times what fewer threads take beside the neighbour (docs/serving.md: the
numbers), while on a quiet machine all of them are about twice as fast. Which holds changes by
the minute, so the governor measures rather than guesses:

- It compares decode steps only (each request one token), of the same batch size: their cost
  is the same work from one step to the next, whatever the prompts.
- Every `probe_every` such steps, or sooner when the recent steps run over `slow` x the level
  they had at the last decision (a neighbour arrived; their median, or two of them where the
  cores read crowded, below), it runs `probe_steps` steps at the other
  count (half the threads from all of them; all of them from fewer). Fewer threads are kept
  only when clearly faster, their steps under `gain` x the time of all of them (a neighbour's
  barrier waits: 0.02-0.2x); all the threads again as soon as they are no slower. The rule is
  lopsided because the steps a probe cannot measure are what all the threads serve best: a
  prompt of 512 tokens ran 1.75x faster on both cores of a quiet 2-core EPYC than on one, while
  decode steps of a few requests may not tell the two counts apart (13.5 against 13.7 ms in
  the benchmarks' process, where more OpenMP workers than cores keep libgomp from spinning; 9
  against 14 ms in toppings-serve's), so that a symmetric rule (keep whichever is faster by
  0.85) went to one thread on noise there (0.70 / 0.82x beside the benchmark's own client) and
  ran every prompt on it for the next minutes (bench_chunked_prefill at 0.7 of capacity: P99
  TTFT 2.1x, median gap 2.1x that round). A probe that changes nothing costs its steps, and
  doubles the interval to the next, up to 8 x `probe_every` (a steady machine pays a probe's
  steps in thousands); a change sets it back.
- A probe step slower than `abort` x the chosen count's median ends the probe at once: all the
  threads beside a neighbour that still holds a core take many times longer (a stall of that
  one step, not of `probe_steps`).
- It also reads how much of its cores the machine's other processes use (cores_watch.py: their
  CPU time over a quarter of a second; a busy neighbour about one core, a quiet machine with a
  client reading a stream's tokens a few hundredths), past the cores `max_threads` leaves them
  (the CPU workers'). At all the threads, half a core or more crowds the team, and two steps
  over `slow` x the level then start a probe compared with those two: beside a busy neighbour
  toppings-serve's decode steps on both cores of a 2-core EPYC took 500-900 ms, 50-70x their
  time, and waiting for the median of 8 to slow took 4 of them. Below all the threads a
  neighbour's leaving does not show in the steps (fewer threads run as fast beside it as
  alone): where the others used no more than half of the cores the chosen count leaves, the
  cores are free, and it probes all the threads at once. A probe the others' CPU time started
  that changes nothing makes the window twice as long (up to 8x; back at a change). (A count
  of running tasks, read after each step, told a neighbour apart only now and then: beside a
  streaming client the fewest of 8 readings was rarely at the engine's own, and
  bench_neighbour's quiet phases ran on one thread for minutes.)
- Prefill and mixed steps run at the chosen count and teach it nothing, during a probe too: a
  prompt that came in during one ran on the probe's half of the threads (bench_chunked_prefill,
  unchunked at 0.7 of capacity on a 2-core EPYC: 3,161 prompt tokens beside 3 decodes took
  6.8 s on one thread, where 3,000 alone take 3.4 s on two), and every stream's gap and every
  queued prompt's TTFT waited for it.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque

from toppings.server.process.cores_watch import CoresWatch
from toppings.server.process.threads import set_torch_threads
from toppings.server.settings import process_cores

log = logging.getLogger(__name__)


class ThreadGovernor:
    """The engine thread's OpenMP count for the next step (`apply`), told each decode step's
    time (`observe`)."""

    def __init__(
        self, max_threads: int, probe_every: int = 400, probe_steps: int = 8,
        gain: float = 0.5, slow: float = 1.5, abort: float = 3.0,
        cores: tuple[int, ...] | None = None, watch: CoresWatch | None = None,
    ) -> None:  # fmt: skip
        """cores: the engine thread's (None: the process's; `--device-cores` pins it to fewer);
        watch: the other processes' use of them (default: read from /proc, the cores past
        `max_threads` left to them)."""
        self.max_threads = max_threads
        self.threads = max_threads  # the count steps run on now (a probe's, during one)
        self.switches = 0  # times the chosen count changed
        self._chosen = max_threads  # the count probes are measured against
        self._probe_every, self._probe_steps = probe_every, probe_steps
        self._gain, self._slow, self._abort = gain, slow, abort
        self._few = min(3, probe_steps)  # steps enough to compare
        self._watch = watch or CoresWatch(frozenset(cores or process_cores()), max_threads)
        self._crowded = False  # at all the threads, the last window's others took half a core
        self._freed = False  # below, the last window's others left the cores free
        self._baseline: dict[int, list[float]] | None = None  # a crowded probe's comparison
        self._recent: dict[int, deque[float]] = {}  # batch -> the chosen count's last steps
        self._level: dict[int, float] = {}  # batch -> their median at the last decision
        self._probe: dict[int, list[float]] | None = None  # batch -> the probe's steps
        self._since_probe = 0
        self._every = probe_every  # decode steps between probes now
        self._applied = 0  # the count this thread was last set to (0: not yet)

    @property
    def chosen(self) -> int:
        """The count decided on (`threads` but during a probe)."""
        return self._chosen

    def apply(self, prompt_tokens: bool = False) -> None:
        """Set the calling thread's torch count for the next step where it is not already:
        `threads` for a decode step, `chosen` for a step with prompt tokens (the module
        docstring)."""
        count = self._chosen if prompt_tokens else self.threads
        if self._applied != count:
            set_torch_threads(count)
            self._applied = count

    def alternative(self) -> int:
        """The count a probe tries: half the threads from all of them, all of them from fewer."""
        top = self.max_threads
        return max(1, top // 2) if self._chosen == top else top

    def observe(self, batch: int, seconds: float) -> None:
        """A decode step of `batch` requests (one token each) ran in `seconds` on `threads`."""
        if self.max_threads <= 1:
            return
        if self._probe is not None:
            self._probe.setdefault(batch, []).append(seconds)
            recent = (self._baseline or self._recent).get(batch)
            if recent and seconds > self._abort * statistics.median(recent):
                self._probe = {}  # far slower: no more such steps, nothing learned
                self._decide()
            elif sum(map(len, self._probe.values())) >= self._probe_steps:
                self._decide()
            return
        recent = self._recent.setdefault(batch, deque(maxlen=self._probe_steps))
        recent.append(seconds)
        self._since_probe += 1
        if len(recent) < self._few:
            return
        median = statistics.median(recent)
        level = self._level.setdefault(batch, median)
        self._read_watch()
        probe = self._freed or self._since_probe >= self._every
        if self._since_probe >= self._probe_steps:
            if self._crowded and min(last := list(recent)[-2:]) > self._slow * level:
                self._baseline = {batch: last}  # the crowded steps, not the 8 before them
            probe = probe or self._baseline is not None or median > self._slow * level
        if probe:
            self._probe, self.threads = {}, self.alternative()

    def _read_watch(self) -> None:
        """At the end of a window (cores_watch.py), whether the other processes crowded the team
        (at all the threads: half a core or more) or left the cores free (below: at most half of
        those the chosen count leaves them)."""
        cores = self._watch.read()
        if cores is None:
            return
        if self._chosen == self.max_threads:
            self._crowded = cores >= 0.5
        else:
            self._freed = cores <= 0.5 * (self.max_threads - self._chosen)

    def _decide(self) -> None:
        """End the probe: keep fewer threads only when their steps took under `gain` x the time
        of all of them, all the threads again when theirs were no slower."""
        probe, self._probe, self._since_probe = self._probe or {}, None, 0
        base, few = (self._baseline, 1) if self._baseline else (self._recent, self._few)
        ratios = [
            statistics.median(times) / statistics.median(base[batch])
            for batch, times in probe.items()
            if len(base.get(batch, ())) >= few
        ]  # fmt: skip
        ratio = statistics.median(ratios) if ratios else math.inf
        fewer = self.threads < self._chosen  # the probe tried half the threads
        if (ratio < self._gain) if fewer else (ratio <= 1.0):
            log.info("steps run on %d threads: %.2fx the time of %d here now", self.threads,
                     ratio, self._chosen)  # fmt: skip
            self._chosen, self.switches = self.threads, self.switches + 1
            self._recent = {b: deque(t, maxlen=self._probe_steps) for b, t in probe.items()}
            self._every = self._probe_every
            self._watch.reset()
        else:
            self._every = min(2 * self._every, 8 * self._probe_every)
            if self._freed or self._baseline:
                self._watch.longer()  # started by the others' CPU time, for nothing
        self._crowded = self._freed = False
        self._baseline = None
        self._watch.restart()  # a window at the count decided on from here
        self._level = {b: statistics.median(t) for b, t in self._recent.items() if t}
        self.threads = self._chosen
