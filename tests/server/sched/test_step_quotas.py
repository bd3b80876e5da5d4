"""Queue policies over a chunked-prefill step's token budget: Chameleon's quotas are shares of
every step's tokens (its running requests' decodes and prompt chunks take them, and they are
whole again at the next step); a prompt being prefilled keeps its place against later
arrivals under every policy; a small-request queue gets its share of every step while a large
prompt is prefilled, where FCFS makes it wait for the whole prompt."""

from __future__ import annotations

import pytest

from tests.server.sched.test_chameleon_queue import FakeGate, large, push, small
from tests.server.sched.test_chunked_schedule import make_chunked, step, tokens_of
from tests.server.sched.test_scheduler import submit
from toppings.server.config import SchedulingConfig
from toppings.server.sched.chameleon import ChameleonQueue
from toppings.server.sched.sizing import DEFAULT_TOKEN_S

# WRS of a base-model request here: 0.4 * prompt / 1000 + 0.6 * out / 100 (the base model
# counts as the largest adapter: every adapter has the same size).
MAXIMA = (1000.0, 100.0, 1.0)
CUTOFF = 0.2  # a prompt of 8 and 4 out: WRS 0.03 (small); a prompt of 600 or more: large


def chameleon(budget: int, quotas: list[int], max_batch: int = 64):
    sched, memory, adapters = make_chunked(budget=budget, max_batch=max_batch, policy="chameleon")
    sched.queue.set_queues([CUTOFF], quotas, MAXIMA, now=0.0)
    return sched, memory, adapters


@pytest.fixture(autouse=True)
def fixed_queues(monkeypatch):
    """The queues and quotas stay as set (no refresh: the clock counts calls, not seconds)."""
    monkeypatch.setattr("toppings.server.sched.size_queues.REFRESH_S", 1e9)


def test_quotas_are_consumed_by_a_steps_tokens_and_whole_again_at_the_next():
    """Budget 64: 16 tokens of every step for the small queue, 48 for the large one. The small
    queue's decodes take their token of its 16 and its new prompts the rest; the large prompt
    is prefilled 48 tokens a step, never the whole budget while small requests wait."""
    sched, memory, adapters = chameleon(budget=64, quotas=[16, 48])
    big = submit(sched, prompt_len=600, max_new=4, ignore_eos=True)
    smalls = [submit(sched, prompt_len=8, max_new=4, ignore_eos=True) for _ in range(12)]
    decodes_counted = False
    for _ in range(6):
        decoding = {s for s in smalls if s.is_prefilled and not s.finished}
        got = tokens_of(step(sched))
        assert got[big] == 48  # its queue's 48 every step, the same 48 again each step
        mine = {s: n for s, n in got.items() if s is not big}
        assert sum(mine.values()) == 16  # decodes and prompt chunks of the small queue
        assert all(mine[s] == 1 for s in decoding)
        decodes_counted |= bool(decoding)
    assert decodes_counted
    while sched.has_work():
        step(sched)
    assert all(len(s.output_ids) == 4 for s in [big, *smalls])
    assert memory.reserved == 0


def test_left_over_tokens_go_to_the_prompt_being_prefilled():
    """With nothing waiting in the small queue, its share goes to the large prompt: the step is
    used whole (work-conserving), the large prompt first."""
    sched, _, _ = chameleon(budget=64, quotas=[16, 48])
    big = submit(sched, prompt_len=600, max_new=4, ignore_eos=True)
    assert tokens_of(step(sched)) == {big: 64}
    late = submit(sched, prompt_len=8, max_new=4, ignore_eos=True)
    assert tokens_of(step(sched)) == {big: 56, late: 8}  # the small one gets in within its 16


def test_quotas_at_refresh_are_shares_of_the_step_budget():
    """With a step budget the M/M/1 bound is counted in tokens of a step: a request of W tokens
    (prompt plus output) in a queue holding Tok tokens of each tau-second step: mu = Tok /
    (W tau), so Tok_min = W_max * tau * (1/SLO + lambda), the rest split by demand."""
    config = SchedulingConfig(queue_policy="chameleon", ttft_slo_ms=1000)
    p = ChameleonQueue(config, max_total_tokens=10_000)

    class StepGate(FakeGate):
        def step_budget(self):
            return 256

        def step_left(self):
            return 0

        def planned(self, seq):
            return 0

        def try_admit(self, seq, max_chunk=None):
            return super().try_admit(seq)

    # 40 small (W = 20) and 40 large (W = 180) requests over 10 s: lambda = 4/s per queue.
    seqs = [small(f"s{i}", i / 8) if i % 2 else large(f"L{i}", i / 8) for i in range(80)]
    push(p, *seqs)
    p.select(StepGate(kv=10_000, rows=0), [], now=10.0)
    assert len(p.cutoffs) == 1
    tau = DEFAULT_TOKEN_S  # nothing completed yet
    tok_small, tok_large = 20 * tau * (1 + 4), 180 * tau * (1 + 4)
    demand_small, demand_large = 4 * tau * 20, 4 * tau * 180
    spare = 256 - tok_small - tok_large
    assert p.quotas == [
        int(tok_small + spare * demand_small / (demand_small + demand_large)),
        int(tok_large + spare * demand_large / (demand_small + demand_large)),
    ]
    assert sum(p.quotas) in (255, 256)


def test_step_quotas_under_overload_keep_a_token_for_every_queue():
    from toppings.server.sched.sizing import step_quotas

    arrivals = [(0, _Size(10, 10, 0.0)) for _ in range(100)] + [(1, _Size(4000, 100, 0.0))]
    quotas = step_quotas(arrivals, [], 2, budget=64, slo_s=0.1, now=1.0)
    assert sum(quotas) <= 64 and min(quotas) >= 1


class _Size:
    def __init__(self, in_tokens, out_tokens, arrived):
        self.in_tokens, self.out_tokens, self.arrived = in_tokens, out_tokens, arrived


@pytest.mark.parametrize("policy", ["fcfs", "chameleon"])
def test_a_prompt_being_prefilled_keeps_its_place_against_later_arrivals(policy):
    """A long prompt started first is continued every step until its last chunk, and no later
    request of its size (its queue) computes a token before that; the short ones arriving
    meanwhile start while it is prefilled (Chameleon: its small queue's share of each step;
    FCFS: the share kept for a shorter waiting prompt, which the long ones in line pass to)."""
    sched, _, _ = make_chunked(budget=64, max_batch=64, policy=policy)
    if policy == "chameleon":
        sched.queue.set_queues([CUTOFF], [16, 48], MAXIMA, now=0.0)
    first = submit(sched, prompt_len=600, max_new=2, ignore_eos=True)
    step(sched)
    later = [submit(sched, prompt_len=600, max_new=2, ignore_eos=True) for _ in range(2)]
    shorts = []
    while not first.is_prefilled:
        shorts.append(submit(sched, prompt_len=8, max_new=2, ignore_eos=True))
        got = tokens_of(step(sched))
        assert got.get(first, 0) > 0
        if any(s in got for s in later):  # only in the step of its last chunk, after it
            assert first.is_prefilled
    assert sum(len(s.output_ids) for s in shorts) > len(shorts)
    while sched.has_work():
        step(sched)
    assert all(len(s.output_ids) == 2 for s in [first, *later, *shorts])


@pytest.mark.parametrize("policy", ["fcfs", "chameleon"])
def test_a_small_request_queue_is_not_starved_by_large_prompts(policy):
    """Four 1,000-token prompts arrive first, then a short request every step. Under Chameleon's
    quotas (16 of each 64-token step for the small queue) every short request samples its first
    token within 2 steps of its arrival; in arrival order (FCFS) as well: the large prompts
    behind the one being prefilled wait their turn and pass the room kept for a shorter prompt
    on to it (server.sched.scheduler), where they held it for 3,000 prompt tokens."""
    sched, _, _ = make_chunked(budget=64, max_batch=64, policy=policy)
    if policy == "chameleon":
        sched.queue.set_queues([CUTOFF], [16, 48], MAXIMA, now=0.0)
    bigs = [submit(sched, prompt_len=1000, max_new=2, ignore_eos=True) for _ in range(4)]
    waits = []
    for _ in range(30):
        seq, arrived = submit(sched, prompt_len=8, max_new=2, ignore_eos=True), 0
        while not seq.output_ids:
            step(sched)
            arrived += 1
        waits.append(arrived)
    assert max(waits) <= 2
    assert any(b.num_prefilled > 0 for b in bigs)  # the large prompts advance meanwhile
    while sched.has_work():
        step(sched)
    assert all(len(b.output_ids) == 2 for b in bigs)


def test_a_prompt_advances_every_step_while_its_queues_decodes_take_its_share():
    """Twenty large requests decode (20 tokens a step, more than their queue's 16); a large
    prompt started then still gets its queue's 16 tokens a step (at most MIN_CHUNK) while
    short requests fill the rest of every step."""
    sched, _, _ = chameleon(budget=64, quotas=[48, 16], max_batch=128)
    streams = [submit(sched, prompt_len=100, max_new=400, ignore_eos=True) for _ in range(20)]
    while not all(s.output_ids for s in streams):
        step(sched)
    prompt = submit(sched, prompt_len=600, max_new=2, ignore_eos=True)
    while not prompt.is_prefilled:
        for _ in range(8):
            submit(sched, prompt_len=8, max_new=4, ignore_eos=True)
        got = tokens_of(step(sched))
        assert all(got[s] == 1 for s in streams)
        assert got[prompt] >= 16 or prompt.is_prefilled
        assert sum(got.values()) == 64
