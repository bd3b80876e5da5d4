"""Chameleon stays live with adapters loaded on demand: a waiting request that holds its
adapter (told to wait for the load) is asked again once nothing runs, so the memory it holds
comes back to the oldest request, which waits for adapter memory, instead of no one running."""

from __future__ import annotations

from dataclasses import dataclass

from tests.server.sched.test_chameleon_queue import FakeGate, FakeSeq, names, policy, push
from toppings.server.sched.queueing import Verdict


@dataclass(eq=False)
class LoadingSeq(FakeSeq):
    holds: bool = False  # a reference on its adapter, taken when its load was started


class LoadingGate(FakeGate):
    """FakeGate whose adapters are loaded on demand: a request's first admission takes a
    reference on its adapter and starts its load, which lands at the next `tick`; the request
    waits (NOT_READY) holding it until then. Adapter memory counts every held adapter, of
    waiting and running requests alike."""

    def __init__(self, kv: int, adapter_slots: int, ranks: dict[str, int]):
        super().__init__(kv=kv, adapter_slots=adapter_slots, ranks=ranks)
        self.landed: set[str] = set()
        self.in_flight: set[str] = set()
        self.num_loads = 0

    def tick(self):
        self.landed |= self.in_flight
        self.in_flight = set()

    def try_admit(self, seq, max_chunk=None):
        if len(self.running) >= self.rows:
            return Verdict.BATCH_FULL
        if self.reserved + seq.kv_need > self.kv:
            return Verdict.NO_ROOM
        a = seq.adapter
        if a and not seq.holds:
            if not self.holders.get(a):
                if self.used_adapter_memory() + self.ranks[a] > self.adapter_slots:
                    return Verdict.NO_ADAPTER_MEMORY
                if a not in self.landed:
                    self.in_flight.add(a)
                    self.num_loads += 1
            self.holders[a] = self.holders.get(a, 0) + 1
            seq.holds = True
        if a and a not in self.landed:
            return Verdict.NOT_READY
        self.reserved += seq.kv_need
        self.running.append(seq)
        return Verdict.ADMITTED

    def release(self, seq):
        super().release(seq)
        seq.holds = False
        if seq.adapter and not self.holders[seq.adapter]:
            self.landed.discard(seq.adapter)  # no cache: an adapter no one holds is dropped

    def holds_adapter(self, seq):
        return seq.holds


def decode(p, gate, now):
    """One step with nothing landing: every running request makes a token; those at max_new
    end."""
    for seq in list(gate.running):
        seq.output_ids.append(1)
        if len(seq.output_ids) >= seq.max_new:
            gate.release(seq)
            p.finished(seq, True, now)


def run(p, gate, iterations):
    """Each iteration: the link lands what is in flight, the policy admits, every running
    request makes a token and those at max_new end. Returns the admission order."""
    order = []
    for it in range(iterations):
        gate.tick()
        order += names(p.select(gate, gate.running, now=float(it)))
        decode(p, gate, now=float(it))
        if not len(p) and not gate.running:
            break
    return order


def test_a_waiting_request_holding_a_landed_adapter_runs_so_the_oldest_gets_its_memory():
    p = policy(cutoffs=[], quotas=[1000])
    gate = LoadingGate(kv=1000, adapter_slots=100, ranks={"run": 40, "big": 80, "hot": 30})
    push(p, LoadingSeq("R0", 10, 5, 0, adapter="run"))
    assert run(p, gate, 2) == ["R0"]  # loads at the first select, starts at the second
    old = LoadingSeq("O", 10, 10, 3, adapter="big")  # 40 + 80 > 100: waits for R0's memory
    short = LoadingSeq("W", 10, 2, 4, adapter="hot")  # ends before R0: may go first
    push(p, old, short)
    assert p.select(gate, gate.running, now=5) == []  # W's load starts; it holds 30 slots
    assert short.holds and not old.holds
    while gate.running:
        decode(p, gate, now=6)  # R0 ends before W's load lands
    # R0 ends and W's load lands: nothing runs, O finds 30 + 80 > 100 held; only W, asked
    # again, can give those 30 back. Every request is served within a few dozen steps.
    order = run(p, gate, 40)
    assert order == ["W", "O"]
    assert not len(p) and not gate.running
    assert p.view()["bypasses"] == 0 and gate.squashed == []  # W was no bypasser: no squash
    assert gate.num_loads == 3  # no adapter was dropped and loaded again


def test_no_thrash_while_younger_requests_hold_their_adapters():
    """Several young requests hold landed adapters while the oldest waits for memory: each
    runs once and gives its adapter back, and no load is repeated (load, drop, reload)."""
    p = policy(cutoffs=[], quotas=[1000])
    ranks = {"run": 40, "big": 90, "a": 20, "b": 20, "c": 20}
    gate = LoadingGate(kv=1000, adapter_slots=100, ranks=ranks)
    push(p, LoadingSeq("R0", 10, 5, 0, adapter="run"))
    run(p, gate, 2)
    young = [LoadingSeq(n.upper(), 10, 2, 2 + i, adapter=n) for i, n in enumerate("abc")]
    push(p, LoadingSeq("O", 10, 10, 1, adapter="big"), *young)
    p.select(gate, gate.running, now=3)
    assert [s.holds for s in young] == [True, True, True]  # 40 + 3 x 20 = 100 slots held
    while gate.running:
        decode(p, gate, now=4)  # R0 ends before the loads land
    order = run(p, gate, 60)
    assert sorted(order[:3]) == ["A", "B", "C"] and order[3:] == ["O"]
    assert not len(p) and not gate.running
    assert gate.num_loads == 5  # every adapter loaded once


def test_a_reservation_does_not_hold_back_a_request_holding_the_memory_it_waits_for():
    """The oldest request holds a reservation and then finds its adapter memory held by a
    waiting request whose KV need the reservation leaves no room for: once nothing runs, that
    request starts anyway (its memory comes back only once it has run)."""
    p = policy(cutoffs=[0.5], quotas=[500, 500], kv=400)
    gate = LoadingGate(kv=400, adapter_slots=100, ranks={"run": 40, "big": 80, "hot": 30})
    push(p, LoadingSeq("R0", 50, 100, 0, adapter="run"))  # 150 slots for 100 steps
    assert run(p, gate, 2) == ["R0"]
    old = LoadingSeq("O", 160, 100, 1, adapter="big")  # 260 slots: waits for R0's end
    held = LoadingSeq("W", 180, 20, 2, adapter="hot")  # 200 slots, ends before R0
    push(p, old, held)
    assert p.select(gate, gate.running, now=3) == []  # W's load starts
    assert held.holds and not old.holds and p.view()["reserved"] >= 1
    while gate.running:
        decode(p, gate, now=4)  # R0 ends before W's load lands
    # O's reservation leaves 400 - 260 = 140 slots to spare, W needs 200; O finds 30 + 80
    # adapter slots > 100 held.
    order = run(p, gate, 150)
    assert order == ["W", "O"]
    assert not len(p) and not gate.running
