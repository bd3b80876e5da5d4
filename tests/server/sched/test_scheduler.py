"""The Scheduler without a model: pure-Python memory and adapters, a fake step model, real
Sequences and queue policies. Admission under the batch, memory and prefill limits, finishing
on length and stop, aborts, failed steps, squashes, and that everything held is given back."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from toppings.server.config import SchedulingConfig
from toppings.server.requests.request import GenerationRequest, RequestHandle, SamplingParams
from toppings.server.requests.sequence import Sequence
from toppings.server.sched.gate_limits import GateLimits
from toppings.server.sched.plan import StepPlan, StepResult
from toppings.server.sched.policies import make_queue_policy
from toppings.server.sched.queueing import Verdict
from toppings.server.sched.scheduler import Scheduler

EOS = 1
BLOCK = 4  # tokens per block


class Tokenizer:
    """Token t is the letter chr(97 + t % 26)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids)


@dataclass
class Hold:
    row: int
    reserved: int
    cached_tokens: int = 0
    length: int = 0  # tokens whose slots the scheduler reserved


class KV:
    block_tokens = BLOCK
    block_bytes = BLOCK * 16

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.num_slots = num_blocks * BLOCK


class Memory:
    """Blocks reserved per request (prompt + max_new_tokens, rounded up); no prefix cache."""

    shared = False

    def __init__(self, num_blocks: int):
        self.kv = KV(num_blocks)
        self.reserved = 0
        self.rows = 0
        self.released: list[tuple[str, bool]] = []  # (request id, keep_kv)
        self.prefills: list[int] = []  # batch sizes seen by after_prefill
        self.decodes: list[int] = []

    def match(self, seq):
        return []

    def kv_need(self, seq, path):
        return -(-seq.kv_need // BLOCK)

    def adapter_need(self, name, num_bytes):
        return 0

    def fits(self, extra_blocks):
        return self.committed() + extra_blocks <= self.kv.num_blocks

    def committed(self):
        return self.reserved

    def adapter_tokens(self, num_bytes):
        return 0

    def total_tokens(self):
        return self.kv.num_slots

    def free_tokens(self):
        return (self.kv.num_blocks - self.committed()) * BLOCK

    def admit(self, seq, path, now):
        self.rows += 1
        hold = Hold(self.rows, self.kv_need(seq, path))
        self.reserved += hold.reserved
        return hold

    def release(self, seq, keep_kv, now):
        self.reserved -= seq.kv_hold.reserved
        self.released.append((seq.request.request_id, keep_kv))
        seq.kv_hold = None

    def allocate(self, seqs, tokens):
        starts = [s.kv_hold.length for s in seqs]
        for seq, n in zip(seqs, tokens):
            seq.kv_hold.length += n
        return starts

    def tick(self, now):
        pass

    def after_prefill(self, seqs, seconds, num_tokens, now):
        self.prefills.append(len(seqs))

    def after_decode(self, batch_size, now):
        self.decodes.append(batch_size)


class Adapters:
    """At most `slots` adapters referenced at once; those in `loading` may not start yet."""

    def __init__(self, names=("a", "b", "c"), slots: int = 3):
        self.registry = {n: 8 for n in names}
        self.slots = slots
        self.refs: dict[str, int] = {}
        self.loading: set[str] = set()

    def registered(self):
        return list(self.registry)

    def make_room(self, name, queued):
        return bool(self.refs.get(name)) or sum(1 for n in self.refs.values() if n) < self.slots

    def acquire(self, name):
        if not self.make_room(name, frozenset()):
            return None
        self.refs[name] = self.refs.get(name, 0) + 1
        return name

    def release(self, name, entry):
        self.refs[name] -= 1

    def serve_on_host(self, name):
        return None

    def promote(self, queued):
        pass

    def may_start(self, entry):
        return entry is None or entry not in self.loading

    def bytes_of(self, name):
        return 0 if name is None else 1000

    def prefetch(self, names, queued):
        pass

    def fits_if_released(self, name, held):
        return False


def make(num_blocks=64, max_batch=8, max_prefill=8192, policy="fcfs", adapters=None):
    config = SchedulingConfig(queue_policy=policy)
    memory, adapters = Memory(num_blocks), adapters or Adapters()
    limits = GateLimits(max_batch, max_prefill)
    clock = iter(range(1_000_000)).__next__  # any increasing clock
    queue = make_queue_policy(config, num_blocks * BLOCK)
    sched = Scheduler(queue, memory, adapters, limits, {EOS}, 512, clock)
    return sched, memory, adapters


def submit(
    sched, prompt_len=8, max_new=3, adapter=None, stop=(), ignore_eos=False, temperature=0.0
) -> Sequence:
    params = SamplingParams(max_new, temperature=temperature, stop=stop, ignore_eos=ignore_eos)
    request = GenerationRequest(list(range(2, 2 + prompt_len)), params, adapter)
    seq = Sequence(request, RequestHandle(request, lambda _id: None), Tokenizer(), 0.0)
    sched.add(seq)
    return seq


def step(sched, token_of=lambda seq: 5) -> StepPlan | None:
    """One engine iteration with a step model that emits `token_of(seq)`."""
    plan = sched.schedule()
    if plan is not None:
        sched.update(plan, StepResult([token_of(s) for s in plan.seqs]))
    return plan


def run_all(sched, limit=1000, token_of=lambda seq: 5) -> list[StepPlan]:
    plans = []
    while sched.has_work() and len(plans) < limit:
        plan = step(sched, token_of)
        assert plan is not None, "work left that can never be scheduled"
        plans.append(plan)
    return plans


def outputs(seq):
    return seq.handle.poll()


def assert_all_given_back(sched, memory, adapters):
    assert not sched.running and not len(sched.queue)
    assert memory.reserved == 0
    assert all(n == 0 for n in adapters.refs.values())


def test_a_prefill_then_decode_steps_until_the_length():
    sched, memory, adapters = make()
    seq = submit(sched, max_new=3, adapter="a")
    plans = run_all(sched)
    assert [(len(p.seqs), p.is_prefill) for p in plans] == [(1, True), (1, False), (1, False)]
    assert seq.output_ids == [5, 5, 5] and seq.finished
    assert outputs(seq)[-1].finish_reason == "length"
    assert memory.prefills == [1] and memory.decodes == [1, 1]
    assert sched.finished == {"length": 1}
    assert memory.released == [(seq.request.request_id, True)]
    assert_all_given_back(sched, memory, adapters)


def test_admission_stops_at_the_batch_size():
    sched, memory, adapters = make(max_batch=2)
    seqs = [submit(sched, max_new=2) for _ in range(3)]
    plan = step(sched)
    assert plan.is_prefill and set(plan.seqs) == set(seqs[:2])
    assert sched.gate().try_admit(seqs[2]) is Verdict.BATCH_FULL
    plan = step(sched)  # the third still waits: the batch is full, so the two decode
    assert not plan.is_prefill and set(plan.seqs) == set(seqs[:2])
    assert all(s.finished for s in seqs[:2]) and len(sched.queue) == 1
    plan = step(sched)
    assert plan.is_prefill and plan.seqs == (seqs[2],)
    run_all(sched)
    assert_all_given_back(sched, memory, adapters)


def test_a_request_waits_until_memory_is_given_back():
    # 4 blocks: one request (8 + 8 tokens) at a time
    sched, memory, adapters = make(num_blocks=4)
    first, second = submit(sched, max_new=8), submit(sched, max_new=8)
    assert step(sched).seqs == (first,)
    assert sched.gate().try_admit(second) is Verdict.NO_ROOM
    assert memory.reserved == 4
    while not first.finished:
        plan = step(sched)
        assert second not in plan.seqs
    assert memory.reserved == 0
    assert step(sched).seqs == (second,)
    run_all(sched)
    assert_all_given_back(sched, memory, adapters)


def test_the_prefill_token_budget_splits_admissions():
    sched, memory, adapters = make(max_prefill=20)
    seqs = [submit(sched, prompt_len=12) for _ in range(3)]
    assert step(sched).seqs == (seqs[0],)  # 12 + 12 > 20: the second waits a step
    plan = step(sched)  # the next prompt, whole, beside the first one's decode
    assert dict(zip(plan.seqs, plan.tokens)) == {seqs[0]: 1, seqs[1]: 12}
    run_all(sched)
    assert all(s.finished for s in seqs)
    assert_all_given_back(sched, memory, adapters)


def test_a_step_batches_one_adapter_side_by_side():
    sched, *_ = make()
    for adapter in ("b", None, "a", "b", "a"):
        submit(sched, adapter=adapter)
    plan = step(sched)
    assert [s.request.adapter for s in plan.seqs] == [None, "a", "a", "b", "b"]


def test_eos_and_stop_strings_finish_with_stop():
    sched, memory, adapters = make()
    eos = submit(sched, max_new=10)
    text = submit(sched, max_new=10, stop=("cc",))
    ignoring = submit(sched, max_new=4, ignore_eos=True)
    tokens = {eos.request.request_id: [5, 5, EOS], text.request.request_id: [3, 2, 2, 7]}
    done: dict = {}

    def token_of(seq):
        rid = seq.request.request_id
        done[rid] = done.get(rid, -1) + 1
        return tokens.get(rid, [EOS] * 10)[done[rid]]

    run_all(sched, token_of=token_of)
    assert eos.output_ids == [5, 5, EOS] and outputs(eos)[-1].finish_reason == "stop"
    text_out = outputs(text)
    assert text.output_ids == [3, 2, 2] and text_out[-1].finish_reason == "stop"
    assert "".join(o.new_text for o in text_out) == "d"  # cut before the stop string
    assert ignoring.output_ids == [EOS] * 4 and outputs(ignoring)[-1].finish_reason == "length"
    assert sched.finished == {"stop": 2, "length": 1}
    assert_all_given_back(sched, memory, adapters)


def test_abort_ends_waiting_and_running_requests_and_gives_everything_back():
    sched, memory, adapters = make(max_batch=1)
    running = submit(sched, max_new=50, adapter="a")
    waiting = submit(sched, max_new=50, adapter="b")
    step(sched)
    assert sched.running == [running] and adapters.refs == {"a": 1}
    sched.abort(waiting.request.request_id)
    sched.abort(running.request.request_id)
    assert outputs(waiting)[-1].finish_reason == "abort"
    assert outputs(running)[-1].finish_reason == "abort"
    assert sched.finished == {"abort": 2}
    assert running.cache_entry is None and running.kv_hold is None
    assert_all_given_back(sched, memory, adapters)
    assert sched.schedule() is None


def test_a_failed_step_fails_its_requests_only_and_drops_their_kv():
    sched, memory, adapters = make(max_batch=4, max_prefill=10)
    first = submit(sched, max_new=5, adapter="a")
    step(sched)
    second = submit(sched, max_new=5, adapter="b")
    third = submit(sched, max_new=5, adapter="b")
    plan = sched.schedule()  # the second's prefill beside the first's decode; the third waits
    assert set(plan.seqs) == {first, second}
    sched.fail(plan, "engine error: boom")
    for seq in (first, second):
        last = outputs(seq)[-1]
        assert last.finish_reason == "error" and last.error == "engine error: boom"
        assert (seq.request.request_id, False) in memory.released
    assert not sched.running and not third.finished
    run_all(sched)
    assert outputs(third)[-1].finish_reason == "length"
    assert_all_given_back(sched, memory, adapters)


def test_adapter_memory_and_loading_verdicts():
    adapters = Adapters(slots=1)
    adapters.loading.add("b")
    sched, memory, _ = make(adapters=adapters)
    a = submit(sched, adapter="a")
    b = submit(sched, adapter="b")
    gate = sched.gate()
    assert gate.try_admit(a) is Verdict.ADMITTED
    assert gate.try_admit(b) is Verdict.NO_ADAPTER_MEMORY  # one adapter slot, taken by a
    assert b.cache_entry is None and b.kv_hold is None
    sched.abort(a.request.request_id)
    assert a.finished and adapters.refs["a"] == 0 and memory.reserved == 0
    gate = sched.gate()
    assert gate.try_admit(b) is Verdict.NOT_READY  # its adapter is still loading
    assert b.cache_entry == "b" and b.kv_hold is None  # keeps its reference while it loads
    adapters.loading.clear()
    assert step(sched).seqs == (b,)
    run_all(sched)
    assert_all_given_back(sched, memory, adapters)


def test_fcfs_lets_requests_pass_one_whose_adapter_loads():
    adapters = Adapters()
    adapters.loading.add("a")
    sched, memory, _ = make(adapters=adapters)
    loading, other = submit(sched, adapter="a"), submit(sched, adapter="b")
    assert step(sched).seqs == (other,)
    adapters.loading.clear()
    run_all(sched)
    assert loading.finished and other.finished
    assert_all_given_back(sched, memory, adapters)


def test_a_squash_gives_everything_back_and_the_request_resumes_where_it_was():
    sched, memory, adapters = make()
    seq = submit(sched, max_new=6, adapter="a")
    step(sched)
    step(sched)
    assert seq.output_ids == [5, 5]
    sched.gate().squash(seq)
    assert seq.output_ids == [5, 5] and not sched.running
    assert seq.prefill_ids == seq.request.prompt_ids + [5, 5] and seq.num_prefilled == 0
    assert memory.reserved == 0 and adapters.refs == {"a": 0}
    sched.queue.push(seq, 0.0)
    plan = step(sched)  # its prompt and its two tokens are its prefill; it samples the third
    assert plan.seqs == (seq,) and plan.tokens == (seq.prefill_len,) and plan.sampled == (seq,)
    run_all(sched)
    assert seq.output_ids == [5] * 6
    streamed = [t for o in outputs(seq) for t in o.new_token_ids]
    assert streamed == [5] * 6  # each token sent once
    assert_all_given_back(sched, memory, adapters)


@pytest.mark.parametrize("policy", ["fcfs", "chameleon"])
def test_a_mixed_workload_finishes_and_gives_everything_back(policy):
    sched, memory, adapters = make(num_blocks=40, max_batch=4, max_prefill=64, policy=policy)
    seqs = [
        submit(
            sched, prompt_len=4 + 7 * (i % 5), max_new=1 + i % 9, adapter=[None, "a", "b"][i % 3]
        )
        for i in range(30)
    ]
    plans = run_all(sched)
    assert all(len(p.seqs) <= 4 for p in plans)
    assert all(s.finished and len(s.output_ids) == s.request.params.max_new_tokens for s in seqs)
    assert sched.finished == {"length": 30}
    assert_all_given_back(sched, memory, adapters)


def test_scheduling_and_requests_import_no_torch():
    root = Path(__file__).resolve().parents[3] / "server"
    modules = [
        f"toppings.server.{pkg}.{m.name}"
        for pkg in ("sched", "requests")
        for m in pkgutil.iter_modules([str(root / pkg)])
    ]
    assert "toppings.server.sched.scheduler" in modules
    assert "toppings.server.requests.sequence" in modules
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules)
    code += "leaked = [m for m in ('torch', 'triton') if m in sys.modules]\n"
    code += "assert not leaked, leaked\n"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("temperature", [0.0, 1.0])  # a random request resumes as exactly
def test_slots_that_cannot_be_had_preempt_the_youngest_before_the_step(temperature):
    sched, memory, adapters = make(max_batch=4)
    old = submit(sched, max_new=4, temperature=temperature)
    young = submit(sched, max_new=4, temperature=temperature)
    step(sched)  # both prefilled, one token each
    refusals, allocate = [None], memory.allocate

    def refuse_once(seqs, tokens):
        return refusals.pop() if refusals else allocate(seqs, tokens)

    memory.allocate = refuse_once
    plan = step(sched)
    assert plan.seqs == (old,) and sched.preemptions == 1
    assert young in sched.queue and young.kv_hold is None and young.output_ids == [5]
    assert (young.request.request_id, True) in memory.released  # its computed KV stays cached
    run_all(sched)
    for seq in (old, young):  # the preempted one resumed after its token, each sent once
        outs = outputs(seq)
        assert [t for o in outs for t in o.new_token_ids] == [5] * 4
        assert outs[-1].finish_reason == "length"
    assert_all_given_back(sched, memory, adapters)


def test_a_request_that_cannot_get_its_slots_with_nothing_to_preempt_fails_alone():
    sched, memory, adapters = make(max_batch=4)
    params = SamplingParams(4, temperature=1.0)
    request = GenerationRequest([2, 3, 4], params, None)
    seq = Sequence(request, RequestHandle(request, lambda _id: None), Tokenizer(), 0.0)
    sched.add(seq)
    memory.allocate = lambda seqs, tokens: None
    assert sched.schedule() is None
    last = outputs(seq)[-1]
    assert last.finish_reason == "error" and "no KV memory" in last.error
    assert_all_given_back(sched, memory, adapters)


@pytest.mark.parametrize("policy", ["fcfs", "chameleon"])
def test_decodes_alone_skip_the_queue_policy_until_a_request_waits(policy, monkeypatch):
    """A step of decodes with nothing waiting is every running request's next token, planned
    without the queue policy; a request that arrives is admitted through it at the next step."""
    sched, memory, adapters = make(policy=policy)
    selects = []
    select = sched.queue.select
    monkeypatch.setattr(sched.queue, "select", lambda *a: selects.append(1) or select(*a))
    first = [submit(sched, max_new=6, adapter=name) for name in ("a", None)]
    assert step(sched).is_prefill and len(selects) == 1
    for _ in range(2):
        plan = step(sched)
        assert not plan.is_prefill and set(plan.seqs) == set(first)
        assert plan.tokens == (1, 1) and plan.samples == (True, True)
    assert len(selects) == 1  # decodes alone: the policy was not asked
    late = submit(sched, max_new=2)
    plan = step(sched)
    assert len(selects) == 2 and late in plan.seqs and plan.is_prefill
    run_all(sched)
    assert [len(s.output_ids) for s in (*first, late)] == [6, 6, 2]
    assert_all_given_back(sched, memory, adapters)
