"""The decode batch (server/engine/decode_batch.py): after every update from a plan its rows are
what reading the plan's requests afresh gives, over random sequences of joins, leaves, finishes,
adapters and resets, with and without a step in flight; and an engine decodes the same tokens
with async scheduling on and off while its rows stay equal to a fresh read at every step."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import running_engine
from tests.server.sched.test_scheduler import Tokenizer
from toppings.server.engine.decode_batch import (
    IDS,
    KV_ROWS,
    LENGTHS,
    POSITIONS,
    SLOTS,
    DecodeBatch,
    DecodeRows,
)
from toppings.server.memory.kv_cache import KVPool
from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.requests.request import GenerationRequest, RequestHandle, SamplingParams
from toppings.server.requests.sequence import Sequence
from toppings.server.sched.plan import StepPlan

ADAPTERS = [None, AdapterRef(1, "a", 4, 0), AdapterRef(2, "b", 16, 0), AdapterRef(3, "c", 8, 0)]


def fresh(plan: StepPlan, kv: KVPool) -> dict[str, list]:
    """A decode plan's rows read from its requests and the pool, as a step built them before
    the decode batch: each field per request, in plan order."""
    rows = [s.kv_hold.row for s in plan.seqs]
    return {
        "ids": [s.output_ids[-1] for s in plan.seqs],
        "positions": list(plan.starts),
        "lengths": [kv.lengths[r] for r in rows],
        "kv_rows": rows,
        "slots": [int(kv.req_to_slot[r, p]) for r, p in zip(rows, plan.starts)],
        "entries": [s.cache_entry for s in plan.seqs],
    }


def kept(rows: DecodeRows) -> dict[str, list]:
    host = rows.host
    fields = {"ids": IDS, "positions": POSITIONS, "lengths": LENGTHS, "kv_rows": KV_ROWS,
              "slots": SLOTS}  # fmt: skip
    return {name: host[f].tolist() for name, f in fields.items()} | {"entries": rows.entries}


class Requests:
    """Decoding requests over a real KV pool, joined and ended at random."""

    def __init__(self, rng: random.Random, kv: KVPool):
        self.rng, self.kv, self.live = rng, kv, []

    def join(self) -> None:
        rng = self.rng
        prompt = [rng.randrange(1, 200) for _ in range(rng.randrange(1, 9))]
        adapter = rng.choice(ADAPTERS)
        request = GenerationRequest(prompt, SamplingParams(max_new_tokens=40), adapter)
        seq = Sequence(request, RequestHandle(request, lambda _id: None), Tokenizer(), 0.0)
        seq.kv_hold = SimpleNamespace(row=self.kv.new_row(), cached_tokens=0)
        self.kv.reserve([seq.kv_hold.row], [len(prompt)])  # its prompt's KV
        seq.num_prefilled = len(prompt)
        seq.output_ids.append(rng.randrange(1, 200))  # the prefill's token
        seq.cache_entry = None if adapter is None else ("entry", adapter.id, seq)
        self.live.append(seq)

    def leave(self, seq: Sequence) -> None:
        self.live.remove(seq)
        self.kv.free_row(seq.kv_hold.row)

    def plan(self) -> StepPlan:
        """The decode step of every live request, its slots reserved (the scheduler's part)."""
        rows = [s.kv_hold.row for s in self.live]
        starts = self.kv.reserve(rows, [1] * len(rows))
        return StepPlan.of({s: 1 for s in self.live}, dict(zip(self.live, starts)))


def run_random_plans(seed: int, in_flight: bool, steps: int = 300) -> DecodeBatch:
    """`steps` decode steps of requests joining and leaving at random, the decode batch's rows
    checked against a fresh read after each update. in_flight: each step is prepared while the
    one before is still out (its tokens reach the requests after the update, as with async
    scheduling); else after."""
    rng = random.Random(seed)
    kv = KVPool(1, 4096, 1, 2, max_requests=24, max_len=64, dtype=torch.float32, block_tokens=4)
    owner, reqs = DecodeBatch(kv, torch.device("cpu")), Requests(rng, kv)
    before: tuple[StepPlan, list[int]] | None = None  # the last step and its tokens
    for _ in range(steps):
        for seq in list(reqs.live):  # ends: at random, or at the row's length
            if rng.random() < 0.02 or len(seq.output_ids) + seq.prompt_len >= 60:
                reqs.leave(seq)
        for _ in range(rng.choice([0] * 8 + [1, 1, 2, 5])):
            if kv.num_free_rows:
                reqs.join()
        if not reqs.live:
            continue
        if rng.random() < 0.05:
            owner.reset()  # a prefill or mixed step ran
        plan = reqs.plan()
        if rng.random() < 0.05 and len(plan.seqs) > 1:  # the staying rows in another order
            order = list(range(len(plan.seqs)))
            rng.shuffle(order)
            plan = StepPlan(*(tuple(v[i] for i in order)
                              for v in (plan.seqs, plan.tokens, plan.samples, plan.starts)),
                            False)  # fmt: skip
        pending = before[0] if in_flight and before is not None else None
        rows = owner.update(plan, pending)
        if before is not None and in_flight:  # the step before's tokens arrive only now
            for seq, token in zip(before[0].seqs, before[1]):
                if seq in reqs.live:
                    seq.output_ids.append(token)
        if rows.token_dst is not None:
            assert rows.source is (before[0] if before is not None else None)
            rows.fill(before[1])  # the source step's tokens, in its order
        assert rows.seqs == plan.seqs
        assert kept(rows) == fresh(plan, kv)
        assert rows.max_length == max(fresh(plan, kv)["lengths"])
        assert rows.seg_starts == list(range(len(plan.seqs) + 1))
        tokens = [rng.randrange(1, 200) for _ in plan.seqs]
        if not in_flight:
            for seq, token in zip(plan.seqs, tokens):
                seq.output_ids.append(token)
        before = (plan, tokens)
    return owner


@pytest.mark.parametrize("in_flight", [False, True], ids=["after", "in-flight"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_equal_a_fresh_read_after_every_plan(seed, in_flight):
    owner = run_random_plans(seed, in_flight)
    counts = owner.counts
    assert counts["same"] > 20 and counts["changed"] > 20 and counts["read"] > 5, counts


def test_the_generation_moves_exactly_when_the_rows_do():
    kv = KVPool(1, 512, 1, 2, max_requests=8, max_len=32, dtype=torch.float32, block_tokens=4)
    owner, reqs = DecodeBatch(kv, torch.device("cpu")), Requests(random.Random(5), kv)
    for _ in range(3):
        reqs.join()
    first = owner.update(reqs.plan())
    for seq in reqs.live:
        seq.output_ids.append(7)
    same = owner.update(reqs.plan())
    assert same.generation == first.generation
    assert same.host[POSITIONS].tolist() == [p + 1 for p in first.host[POSITIONS].tolist()]
    reqs.leave(reqs.live[1])
    left = owner.update(reqs.plan())
    assert left.generation != same.generation
    owner.reset()
    assert owner.update(reqs.plan()).generation not in (left.generation, same.generation)


def test_an_update_that_fails_halfway_spares_the_step_in_flight():
    """The next update reads every request, takes the in-flight step's tokens where its
    requests stay, and writes neither update into the set the step in flight reads."""
    kv = KVPool(1, 512, 1, 2, max_requests=8, max_len=32, dtype=torch.float32, block_tokens=4)
    owner, reqs = DecodeBatch(kv, torch.device("cpu")), Requests(random.Random(6), kv)
    for _ in range(3):
        reqs.join()
    flying = reqs.plan()
    first = owner.update(flying)
    values = kept(first)
    reqs.join()
    failing, joined = reqs.plan(), reqs.live[-1]
    hold, joined.kv_hold = joined.kv_hold, None  # reading the new row raises
    with pytest.raises(AttributeError):
        owner.update(failing, flying)
    joined.kv_hold = hold
    reqs.leave(reqs.live[0])
    plan = reqs.plan()
    rows = owner.update(plan, flying)
    assert kept(first) == values  # the set of the step in flight
    assert owner.counts["read"] == 2 and rows.source is flying and rows.in_flight
    tokens = [11, 12, 13]
    rows.fill(tokens)
    for seq, token in zip(flying.seqs, tokens):
        seq.output_ids.append(token)
    assert kept(rows) == fresh(plan, kv)


def decode_run(model_dir, adapters: dict[str, str], async_scheduling: bool, mirror: bool = False):
    """Requests of the base model and two adapters of other ranks, of random lengths, arriving
    while others decode; every decode step's rows checked against a fresh read when prepared.
    Returns each request's tokens, the rows the forward passes read (request, position, input
    token), the mismatches found and the decode batch's updates by path."""
    rng = random.Random(11)
    with running_engine(model_dir, adapters, max_total_tokens=4096, max_batch_size=6,
                        async_scheduling=async_scheduling) as engine:  # fmt: skip
        runner, mismatches, inputs = engine.runner, [], []
        if mirror:  # the device's path on a CPU: a copy of the set, the table read there
            runner.rows = DecodeBatch(runner.kv, engine.model.device, mirror=True)
        prepare, decode_batch = runner.prepare, runner._decode_batch

        def checked_prepare(plan, pending=None):
            step = prepare(plan, pending)
            if step.decode is not None:  # input tokens in flight: checked by `inputs`
                rows, read = kept(step.decode), fresh(plan, runner.kv)
                del rows["ids"], read["ids"]  # the slots: checked where the forward reads them
                del rows["slots"], read["slots"]
                if rows != read or step.decode.seqs != plan.seqs:
                    mismatches.append((rows, read))
            return step

        def recorded_batch(step):
            batch = decode_batch(step)
            table = runner.kv.req_to_slot
            slots = [int(table[s.kv_hold.row, p]) for s, p in zip(step.plan.seqs, step.plan.starts)]
            if batch.slots.tolist() != slots:
                mismatches.append(("slots", batch.slots.tolist(), slots))
            inputs.extend(zip(step.decode.seqs, batch.positions.tolist(),
                              batch.input_ids.tolist()))  # fmt: skip
            return batch

        runner.prepare, runner._decode_batch = checked_prepare, recorded_batch
        refs = [None] + [engine.resolve_adapter(name) for name in sorted(adapters)]
        handles = []
        for i in range(18):
            if i >= 6:
                time.sleep(rng.choice([0.0, 0.005, 0.02]))
            prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(2, 12))]
            params = SamplingParams(max_new_tokens=rng.randrange(1, 28), temperature=0.0,
                                    ignore_eos=True)  # fmt: skip
            handles.append(engine.submit(GenerationRequest(prompt, params, rng.choice(refs))))
        tokens = [h.result(timeout_s=120).new_token_ids for h in handles]
        return tokens, inputs, mismatches, dict(runner.rows.counts)


def test_an_engine_decodes_the_same_tokens_with_async_scheduling_on_and_off(
    tiny_model_dir, tmp_path
):
    from toppings.scripts.make_adapters import make_random_adapter

    adapters = {name: str(make_random_adapter(tmp_path / name, tiny_model_dir, rank=rank,
                                              seed=i))
                for i, (name, rank) in enumerate((("a", 4), ("b", 16)))}  # fmt: skip
    runs = {mode: decode_run(tiny_model_dir, adapters, mode) for mode in (False, True)}
    runs["mirror"] = decode_run(tiny_model_dir, adapters, True, mirror=True)
    assert runs[True][0] == runs[False][0] == runs["mirror"][0]
    for _, inputs, mismatches, counts in runs.values():
        assert not mismatches
        assert counts["same"] and counts["changed"], counts
        assert len(inputs) > 100
        for seq, position, token in inputs:  # each input: the request's token at its position
            assert (list(seq.request.prompt_ids) + seq.output_ids)[position] == token
