"""One OpenMP team in the process (server/process/threads.py): the engine thread keeps its count
whatever another thread set last, and the server's other long-lived threads run torch alone."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.helpers import running_engine
from toppings.gpu_lora.loader import PipelinedLoader
from toppings.scripts.make_adapters import make_random_adapter
from toppings.server.api.admin.lifecycle import AdapterThread
from toppings.server.process.threads import run_in_passing_thread, torch_on_this_thread_only
from toppings.server.requests.request import (
    Constraint,
    ConstraintKind,
    GenerationRequest,
    SamplingParams,
)
from toppings.server.sampling import sampler


@pytest.fixture
def main_count():
    """Two torch threads on this thread (a count that 1 can be told from, whatever the machine
    or an earlier test left), and the count it had restored as the process-wide count after the
    test (a thread that sets 1 changes it for threads that have not asked yet)."""
    count = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(count)


def _set_one_elsewhere() -> None:
    thread = threading.Thread(target=torch_on_this_thread_only)
    thread.start()
    thread.join()


def test_passing_thread_returns_raises_and_runs_with_its_count(main_count):
    assert run_in_passing_thread(torch.get_num_threads, threads=1) == 1
    assert run_in_passing_thread(lambda a, b: a + b, 2, 3, threads=main_count) == 5

    def fails():
        raise KeyError("no such tensor")

    with pytest.raises(KeyError, match="no such tensor"):
        run_in_passing_thread(fails, threads=1)


def test_engine_thread_keeps_the_builders_count_after_another_thread_set_one(
    main_count, tiny_engine, monkeypatch
):
    seen = []
    with tiny_engine() as engine:
        _set_one_elsewhere()  # before the engine thread's first torch op
        forward = engine.model.forward

        def recording(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return forward(*args, **kwargs)

        monkeypatch.setattr(engine.model, "forward", recording)
        params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
        engine.submit(GenerationRequest([5, 6, 7], params)).result(timeout_s=120)
    assert seen and set(seen) == {main_count}


def test_adapter_admin_and_loader_threads_run_torch_alone(
    main_count, tiny_engine, tiny_model_dir, tmp_path, monkeypatch
):
    seen = {}
    load = PipelinedLoader._load

    def loading(self, *args):
        seen["adapter-loader"] = torch.get_num_threads()
        return load(self, *args)

    monkeypatch.setattr(PipelinedLoader, "_load", loading)
    adapter = make_random_adapter(tmp_path / "a", tiny_model_dir, rank=4)
    seen["adapter-admin"] = AdapterThread().run(torch.get_num_threads)
    with tiny_engine({"a": str(adapter)}) as engine:
        params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
        engine.submit(GenerationRequest([5, 6, 7], params, engine.resolve_adapter("a"))).result(
            timeout_s=120
        )
    assert seen == {"adapter-admin": 1, "adapter-loader": 1}


def test_grammar_mask_thread_runs_torch_alone(main_count, smollm2_dir, monkeypatch):
    seen = []
    fill = sampler.fill_masks

    def filling(*args):
        seen.append(torch.get_num_threads())
        return fill(*args)

    monkeypatch.setattr(sampler, "fill_masks", filling)
    with running_engine(smollm2_dir, max_total_tokens=2048) as engine:
        regex = Constraint(ConstraintKind.REGEX, "[ab]{1,4}")
        params = SamplingParams(max_new_tokens=4, temperature=0.0, constraint=regex)
        engine.submit(GenerationRequest([5, 6, 7], params)).result(timeout_s=120)
    assert seen and set(seen) == {1}
