"""Chameleon's queues on a simulated engine: both batch-formation phases, bypass, squash,
and that a long request is not starved by a steady stream of short ones."""

from __future__ import annotations

from dataclasses import dataclass, field

from toppings.server.config import SchedulingConfig
from toppings.server.requests.request import SamplingParams
from toppings.server.sched.chameleon import ChameleonQueue
from toppings.server.sched.queueing import FcfsQueue, Verdict

MAXIMA = (100.0, 100.0, 100.0)  # maxIn, maxOut, maxAdapter: WRS = (.4 in + .6 out) * rank / 1e6


@dataclass
class FakeRequest:
    adapter: str | None
    params: SamplingParams


@dataclass(eq=False)
class FakeSeq:
    """What a queue policy reads of a Sequence."""

    name: str
    prompt_len: int
    max_new: int
    arrival: float
    adapter: str | None = None
    greedy: bool = True
    output_ids: list[int] = field(default_factory=list)
    resumes: int = 0

    def __post_init__(self):
        temperature = 0.0 if self.greedy else 1.0
        self.request = FakeRequest(self.adapter, SamplingParams(self.max_new, temperature))
        self.kv_need = self.prompt_len + self.max_new

    @property
    def prefill_len(self) -> int:
        return self.prompt_len + len(self.output_ids) if self.resumes else self.prompt_len

    def resume(self):
        self.resumes += 1


class FakeGate:
    """KV slots, batch rows and adapter memory counted in adapters (each the size of its rank)."""

    def __init__(self, kv: int, rows: int = 64, adapter_slots: int = 100, ranks=None):
        self.kv, self.rows, self.adapter_slots = kv, rows, adapter_slots
        self.ranks = ranks or {}
        self.running: list[FakeSeq] = []
        self.reserved = 0
        self.holders: dict[str, int] = {}  # adapter -> running requests holding it
        self.squashed: list[FakeSeq] = []

    def used_adapter_memory(self) -> int:
        return sum(self.ranks[a] for a, n in self.holders.items() if n)

    def try_admit(self, seq):
        if len(self.running) >= self.rows:
            return Verdict.BATCH_FULL
        if self.reserved + seq.kv_need > self.kv:
            return Verdict.NO_ROOM
        a = seq.adapter
        if a and not self.holders.get(a):
            if self.used_adapter_memory() + self.ranks[a] > self.adapter_slots:
                return Verdict.NO_ADAPTER_MEMORY
        if a:
            self.holders[a] = self.holders.get(a, 0) + 1
        self.reserved += seq.kv_need
        self.running.append(seq)
        return Verdict.ADMITTED

    def release(self, seq):
        self.running.remove(seq)
        self.reserved -= seq.kv_need
        if seq.adapter:
            self.holders[seq.adapter] -= 1

    def squash(self, seq):
        self.release(seq)
        seq.resume()
        self.squashed.append(seq)

    def fits_if_released(self, waiting, running):
        need = self.ranks[waiting.adapter]
        free = self.adapter_slots - self.used_adapter_memory()
        if free >= need:
            return False
        mine = self.ranks[running.adapter] if self.holders.get(running.adapter) == 1 else 0
        return free + mine >= need

    def holds_adapter(self, seq):
        return False  # an admitted adapter is usable at once: no request waits holding one

    def adapter_tokens(self, adapter):
        return 0

    def adapter_size(self, adapter):
        return float(self.ranks.get(adapter, 100))

    def max_adapter_size(self):
        return 100.0

    def total_tokens(self):
        return self.kv

    def prefetch(self, adapters):
        pass

    def free_tokens(self):
        return self.kv - self.reserved

    def free_rows(self):
        return self.rows - len(self.running)

    def need_tokens(self, seq):
        return seq.kv_need

    def release_tokens(self, seq):
        return seq.kv_need

    def step_budget(self):
        return None  # steps are not budgeted: the quotas are KV slots


def policy(cutoffs, quotas, kv=1000, slo_ms=5000.0):
    config = SchedulingConfig(queue_policy="chameleon", ttft_slo_ms=slo_ms)
    p = ChameleonQueue(config, max_total_tokens=kv)
    p.set_queues(cutoffs, quotas, MAXIMA, now=0.0)
    return p


def push(p, *seqs):
    for s in seqs:
        p.push(s, s.arrival)


def names(seqs):
    return [s.name for s in seqs]


# WRS of a base request (adapter size 100 = max): 0.4 * prompt/100 + 0.6 * out/100.
def small(name, t, **kw):
    return FakeSeq(name, 10, 10, t, **kw)  # WRS 0.1, needs 20 slots


def large(name, t, **kw):
    return FakeSeq(name, 90, 90, t, **kw)  # WRS 0.9, needs 180 slots


def test_phase_one_each_queue_admits_within_its_quota_smallest_first():
    p = policy(cutoffs=[0.5], quotas=[40, 360], kv=400)
    gate = FakeGate(kv=400)
    push(p, large("L1", 0), small("s1", 1), small("s2", 2), small("s3", 3), large("L2", 4))
    batch = p.select(gate, gate.running, now=5)
    # The oldest request goes first (L1); then the small queue stops at its quota (2 x 20
    # slots), and the large queue admits L2 within what L1 left of its 360, which fills the
    # memory: s3 waits. FCFS would have admitted L1, s1, s2, s3 and kept L2 waiting.
    assert names(batch) == ["L1", "s1", "s2", "L2"]
    assert names(p) == ["s3"]
    assert p.view()["queue_lengths"] == [1, 0]


def test_phase_two_gives_the_free_memory_to_the_smallest_requests_first():
    p = policy(cutoffs=[0.5], quotas=[40, 400])
    gate = FakeGate(kv=1000)
    push(p, small("s1", 1), small("s2", 2), small("s3", 3), small("s4", 4), large("L1", 5))
    batch = p.select(gate, gate.running, now=6)
    # Phase 1: s1, s2 (quota 40), L1 (quota 400); phase 2: the free memory admits s3 and s4.
    assert names(batch) == ["s1", "s2", "L1", "s3", "s4"]


def test_phase_two_fills_the_memory_phase_one_left_smallest_requests_first():
    p = policy(cutoffs=[0.5], quotas=[40, 200])
    gate = FakeGate(kv=1000)
    push(p, small("s1", 1), small("s2", 2), small("s3", 3), large("L1", 4), large("L2", 5))
    batch = p.select(gate, gate.running, now=6)
    # Phase 1: s1, s2 (quota 40), L1 (quota 200); phase 2: the free memory takes s3, then L2
    # beyond the large queue's quota (memory kept idle would shorten no one's wait).
    assert names(batch) == ["s1", "s2", "L1", "s3", "L2"]
    p = policy(cutoffs=[0.5], quotas=[40, 200], kv=300)
    gate = FakeGate(kv=300)
    push(p, small("s1", 1), small("s2", 2), small("s3", 3), large("L1", 4), large("L2", 5))
    # With 300 slots, L2 (180) does not fit what phase 2 has left (60): it waits, without a
    # reservation (it is beyond its queue's quota, and the large queue has L1 running).
    assert names(p.select(gate, gate.running, now=6)) == ["s1", "s2", "L1", "s3"]
    assert names(p) == ["L2"] and p.view()["reserved"] == 0


def test_a_request_larger_than_its_quota_runs_when_its_queue_has_nothing_running():
    p = policy(cutoffs=[0.5], quotas=[0, 100], kv=300)
    gate = FakeGate(kv=300)
    push(p, large("L1", 0), large("L2", 1))
    assert names(p.select(gate, gate.running, now=2)) == ["L1"]
    assert names(p.select(gate, gate.running, now=3)) == []


def test_quotas_come_from_the_mm1_bound_at_refresh():
    config = SchedulingConfig(queue_policy="chameleon", ttft_slo_ms=1000)
    p = ChameleonQueue(config, max_total_tokens=10_000)
    gate = FakeGate(kv=10_000)
    # 40 small and 40 large requests over 10 s: lambda = 4/s per queue.
    seqs = [small(f"s{i}", i / 8) if i % 2 else large(f"L{i}", i / 8) for i in range(80)]
    push(p, *seqs)
    p.select(FakeGate(kv=10_000, rows=0), [], now=10.0)  # sizes and clusters; admits nothing
    assert len(p.cutoffs) == 1 and 0.1 < p.cutoffs[0] < 0.9
    # D = max_new * 0.05 s per token (nothing completed yet); S = the queue's largest request.
    tok_small = 20 * (10 * 0.05) * (1 / 1.0 + 4.0)
    tok_large = 180 * (90 * 0.05) * (1 / 1.0 + 4.0)
    demand_small, demand_large = 4 * 0.5 * 20, 4 * 4.5 * 180
    spare = 10_000 - tok_small - tok_large
    expect_small = tok_small + spare * demand_small / (demand_small + demand_large)
    assert p.quotas[0] == int(expect_small)
    assert sum(p.quotas) in (9999, 10_000)
    assert gate.running == []


def test_bypass_lets_a_short_request_with_a_resident_adapter_go_first():
    p = policy(cutoffs=[], quotas=[1000])
    ranks = {"big": 80, "run": 40, "hot": 10}
    gate = FakeGate(kv=1000, adapter_slots=100, ranks=ranks)
    long_running = FakeSeq("R0", 10, 50, 0, adapter="run")
    push(p, long_running)
    assert names(p.select(gate, gate.running, now=0)) == ["R0"]
    r1 = FakeSeq("R1", 10, 10, 1, adapter="big")  # 40 + 80 > 100: waits for R0's memory
    r2 = FakeSeq("R2", 10, 10, 2, adapter="hot")  # predicted 10 tokens < R0's 50 left
    r3 = FakeSeq("R3", 10, 10, 3, adapter="hot", greedy=False)  # random: resumes as exactly
    r4 = FakeSeq("R4", 10, 60, 4, adapter="hot")  # predicted to outlast R0
    push(p, r1, r2, r3, r4)
    assert names(p.select(gate, gate.running, now=3)) == ["R2", "R3"]
    assert p.view()["bypasses"] == 2
    assert names(p) == ["R1", "R4"]


def test_no_bypass_by_a_request_predicted_to_outlast_the_memory_wait():
    p = policy(cutoffs=[], quotas=[1000])
    gate = FakeGate(kv=1000, adapter_slots=100, ranks={"big": 80, "run": 40, "hot": 10})
    push(p, FakeSeq("R0", 10, 5, 0, adapter="run"))
    p.select(gate, gate.running, now=0)
    push(p, FakeSeq("R1", 10, 10, 1, adapter="big"), FakeSeq("R2", 10, 20, 2, adapter="hot"))
    assert p.select(gate, gate.running, now=3) == []  # R2 needs 20 tokens, R0 ends in 5


def test_squash_when_the_bypassed_request_fits_by_releasing_the_bypasser():
    p = policy(cutoffs=[], quotas=[1000])
    ranks = {"big": 80, "run": 40, "hot": 20}
    gate = FakeGate(kv=1000, adapter_slots=100, ranks=ranks)
    p._budget.work_tokens = 10_000  # earlier work: the 5% squash budget has room
    r0 = FakeSeq("R0", 10, 50, 0, adapter="run")
    push(p, r0)
    p.select(gate, gate.running, now=0)
    r1, r2 = FakeSeq("R1", 10, 10, 1, adapter="big"), FakeSeq("R2", 10, 10, 2, adapter="hot")
    push(p, r1, r2)
    assert names(p.select(gate, gate.running, now=3)) == ["R2"]  # bypass: 40 + 20 used
    r2.output_ids = [7, 7, 7]
    gate.release(r0)  # R0 ends early (the prediction was wrong): 80 free, R1 needs 80 ...
    p.finished(r0, True, now=4)
    gate.holders["run"] = 0
    gate.ranks["big"] = 90  # ... make R1 need 90: it fits only if R2's 20 are released
    batch = p.select(gate, gate.running, now=5)
    assert gate.squashed == [r2] and r2.resumes == 1
    assert names(batch) == ["R1"]  # R1 goes; R2 waits again in its arrival place
    assert names(p) == ["R2"]
    view = p.view()
    assert view["squashes"] == 1 and 0 < view["squashed_work_share"] <= 0.05


def test_no_squash_beyond_five_percent_of_the_work():
    p = policy(cutoffs=[], quotas=[1000])
    gate = FakeGate(kv=1000, adapter_slots=100, ranks={"big": 80, "run": 40, "hot": 20})
    p._budget.work_tokens = 100  # little work done: squashing R2's 13 tokens would waste > 5%
    push(p, FakeSeq("R0", 10, 50, 0, adapter="run"))
    p.select(gate, gate.running, now=0)
    r1, r2 = FakeSeq("R1", 10, 10, 1, adapter="big"), FakeSeq("R2", 10, 10, 2, adapter="hot")
    push(p, r1, r2)
    p.select(gate, gate.running, now=3)
    r2.output_ids = [7, 7, 7]
    gate.ranks["big"] = 90
    r0 = gate.running[0]
    gate.release(r0)
    p.finished(r0, True, now=4)
    assert p.select(gate, gate.running, now=5) == [] and gate.squashed == []


def simulate(p, gate, arrivals, iterations):
    """One token per running request per iteration; returns {name: admission iteration}."""
    admitted_at = {}
    for it in range(iterations):
        push(p, *arrivals.get(it, ()))
        for seq in p.select(gate, gate.running, now=float(it)):
            admitted_at[seq.name] = it
        for seq in list(gate.running):
            seq.output_ids.append(1)
            if len(seq.output_ids) >= seq.max_new:
                gate.release(seq)
                p.finished(seq, True, now=float(it))
    return admitted_at


def stream():
    """Three short requests (rank-10 adapter) per iteration; a long one (prompt 90 tokens,
    90 out, a rank-100 adapter) at iteration 20."""
    arrivals = {
        it: [small(f"s{it}.{j}", it + j / 10, adapter="r10") for j in range(3)] for it in range(200)
    }
    arrivals[20] = [large("L", 20.05, adapter="r100"), *arrivals[20]]
    return arrivals


def test_a_long_request_is_not_starved_by_a_steady_stream_of_short_ones(monkeypatch):
    # KV for 10 short requests (20 slots each) or one long one (180) plus one short one; three
    # short ones arrive every iteration, more than the server can take, for 200 iterations.
    # Quotas as split_quotas makes them, summing to the KV: 20 for the short queue, 180 for the
    # long one. The queues stay fixed (no refresh) so that the long one keeps its own queue.
    monkeypatch.setattr("toppings.server.sched.size_queues.REFRESH_S", 1e9)
    p = policy(cutoffs=[0.3], quotas=[20, 180], kv=200)
    gate = FakeGate(kv=200, ranks={"r10": 10, "r100": 100}, adapter_slots=1000)
    admitted_at = simulate(p, gate, stream(), 200)
    # Bound: from its arrival the long request heads its queue within its quota, so it gets a
    # reservation at the step by which the short requests running then (10 iterations each at
    # most) will have freed its memory (the one reservation that may be ahead of it, the
    # oldest short request's, starts at the first of those ends and needs 20 slots), and no
    # short request that would outlast that starts meanwhile: it waits at most 10 iterations,
    # plus one to be admitted.
    assert admitted_at["L"] - 20 <= 10 + 1
    assert p.view()["reserved"] >= 1
    # FCFS serves the same stream in arrival order: the long request waits behind the backlog
    # of short ones that arrived before it (more than 3 per iteration arrive, 1 is served).
    # (Arrival order: with fair shares, its adapter's request would go ahead of the others'
    # backlog: test_fair_share.py.)
    fcfs = FcfsQueue(SchedulingConfig(fair_share=False), max_total_tokens=200)
    gate = FakeGate(kv=200, ranks={"r10": 10, "r100": 100}, adapter_slots=1000)
    assert simulate(fcfs, gate, stream(), 200)["L"] - 20 > 2 * (10 + 1)


def test_the_oldest_request_is_not_passed_by_a_stream_even_beyond_its_quota():
    # A running large request (180 slots, 200 steps) takes the large queue's quota (200), so
    # the next one, Lc, the oldest waiting request, is beyond its quota. The other 220 slots
    # hold eleven short requests ending one per step; four more short ones (20 slots, 10 steps)
    # arrive every iteration. Without a reservation each 20 slots freed would go to a new
    # short request and Lc would wait for the stream to stop. With one, at the ninth end (180
    # free) no short request that outlasts it may start: Lc starts then.
    p, gate = policy(cutoffs=[0.5], quotas=[200, 200], kv=400), FakeGate(kv=400)
    push(p, FakeSeq("Lb", 90, 90, 0), *[small(f"r{i}", 1 + i / 100) for i in range(11)])
    assert len(p.select(gate, gate.running, now=1)) == 12
    for i, seq in enumerate(gate.running[1:]):
        seq.output_ids = [1] * (9 - i) if i < 9 else []  # r0 ends after 1 step, r8 after 9
    arrivals = {it: [small(f"s{it}.{j}", 3 + it + j / 10) for j in range(4)] for it in range(60)}
    arrivals[0] = [large("Lc", 2.5), *arrivals[0]]
    admitted_at = simulate(p, gate, arrivals, 60)
    assert admitted_at["Lc"] <= 9 + 1
    assert p.view()["reserved"] >= 1


def test_a_large_request_waits_for_its_quota_without_squashing_anyone():
    # Twenty short requests fill the memory (400 slots), twice their queue's quota of 200: the
    # large queue's quota was lent to them while it had nothing to run. A large request that
    # comes then waits with a reservation, however much squash budget is left: squashing
    # running requests to take the quota back at once cost more than it gained
    # (bench/queueing_sim). As the short ones end, none starts in the memory it waits for.
    p, gate = policy(cutoffs=[0.5], quotas=[200, 200], kv=400), FakeGate(kv=400)
    shorts = [small(f"s{i}", i) for i in range(20)]
    push(p, *shorts)
    assert len(p.select(gate, gate.running, now=20)) == 20
    p._budget.work_tokens = 10_000
    push(p, large("L", 21), *[small(f"n{i}", 22 + i) for i in range(5)])
    assert p.select(gate, gate.running, now=23) == [] and gate.squashed == []
    assert p.view()["reserved"] == 1
    for seq in shorts[:9]:  # 180 slots free: L fits, and starts before the newer short ones
        gate.release(seq)
        p.finished(seq, True, now=24)
    assert names(p.select(gate, gate.running, now=25))[0] == "L"


def step(p, gate, now):
    """One decode step: every running request makes a token; those at max_new end."""
    for seq in list(gate.running):
        seq.output_ids.append(1)
        if len(seq.output_ids) >= seq.max_new:
            gate.release(seq)
            p.finished(seq, True, now)


def test_while_a_long_request_waits_only_requests_that_do_not_delay_it_start():
    p = policy(cutoffs=[0.3, 0.7], quotas=[40, 100, 260], kv=400)
    gate = FakeGate(kv=400)
    # Three medium requests (WRS 0.5-0.7): A 140 slots, B and C 90 each; 80 slots stay free.
    push(p, FakeSeq("A", 90, 50, 0), FakeSeq("B", 10, 80, 1), FakeSeq("C", 10, 80, 2))
    assert names(p.select(gate, gate.running, now=3)) == ["A", "B", "C"]
    gate.running[0].output_ids = [1] * 30  # A ends in 20 steps, B and C in 80
    # L (180 slots) heads the large queue within its quota but does not fit: its reservation
    # is A's end (20 steps), when 220 slots will be free, 40 to spare.
    o0, o1 = FakeSeq("o0", 10, 30, 5), FakeSeq("o1", 10, 30, 6)  # small queue, 40 slots each
    s0, s1 = small("s0", 7), small("s1", 8)  # 20 slots, 10 steps
    push(p, large("L", 4), o0, o1, s0, s1)
    # o0 outlasts the reservation (30 steps) and takes the 40 spare; o1 would too, with no
    # spare left: it waits, although 40 slots are free now; s0 and s1 end before L's turn.
    assert names(p.select(gate, gate.running, now=9)) == ["o0", "s0", "s1"]
    assert p.view()["reserved"] == 1 and p.view()["backfilled"] == 3
    for it in range(10):
        step(p, gate, now=10 + it)  # s0 and s1 end: 40 slots free, A ends in 10 steps
    assert names(p.select(gate, gate.running, now=20)) == []
    for it in range(10):
        step(p, gate, now=21 + it)  # A ends: the reservation's step
    assert names(p.select(gate, gate.running, now=31)) == ["L"]


def test_fcfs_is_the_same_interface():
    p = FcfsQueue(SchedulingConfig(), max_total_tokens=32768)
    gate = FakeGate(kv=60)
    push(p, small("a", 0), large("b", 1), small("c", 2))
    assert names(p.select(gate, gate.running, now=3)) == ["a"]  # b blocks c: head-of-line
    assert names(p) == ["b", "c"]


def test_adapters_are_prefetched_in_arrival_order():
    # A younger request of a smaller queue must not have its adapter loaded first: that memory
    # is what the oldest request's larger adapter waits for (and, wanted, it is not evicted).
    p = policy(cutoffs=[0.5], quotas=[40, 360], kv=400)
    gate = FakeGate(kv=400, rows=0)  # nothing is admitted: every request keeps waiting
    prefetched = []
    gate.prefetch = prefetched.extend
    push(p, large("L1", 0, adapter="big"), small("s1", 1, adapter="hot"))
    p.select(gate, gate.running, now=2)
    assert prefetched == ["big", "hot"]
