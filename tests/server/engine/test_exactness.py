"""Mixed-adapter batches give the tokens transformers + PEFT give each request alone.

Rule (issue 2): greedy outputs must be identical, except that they may part at or after a
position where the reference's top-2 logit margin was below 1e-4 (a near tie that float
rounding may flip either way).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import running_engine
from toppings.server.requests.request import GenerationRequest, SamplingParams

MARGIN = 1e-4
NEW_TOKENS = 32
# rank -> targets: every projection kind appears, and the adapters differ in what they adapt.
ADAPTER_SPECS = {
    8: ("q_proj", "v_proj"),
    16: ("q_proj", "k_proj", "v_proj", "o_proj"),
    32: ("gate_proj", "up_proj", "down_proj"),
    64: ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}


def make_adapters(root, base_dir) -> dict[str, str]:
    from toppings.scripts.make_adapters import make_random_adapter

    paths = {}
    for i, (rank, targets) in enumerate(ADAPTER_SPECS.items()):
        name = f"r{rank}"
        paths[name] = str(
            make_random_adapter(root / name, base_dir, rank=rank, target_modules=targets, seed=i)
        )
    return paths


def reference_greedy(base_dir, adapters: dict[str, str], prompt: list[int], adapter: str | None):
    """Greedy tokens and top-2 margins from transformers + PEFT on one request alone (fp32)."""
    model = _peft_model(base_dir, tuple(sorted(adapters.items())))
    ids = torch.tensor([prompt])
    tokens, margins = [], []
    ctx = model.disable_adapter() if adapter is None else _nullcontext()
    if adapter is not None:
        model.set_adapter(adapter)
    with ctx, torch.inference_mode():
        past = None
        for _ in range(NEW_TOKENS):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            top2 = torch.topk(logits, 2).values
            margins.append(float(top2[0] - top2[1]))
            nxt = int(logits.argmax())
            tokens.append(nxt)
            ids = torch.tensor([[nxt]])
    return tokens, margins


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_PEFT_CACHE: dict = {}


def _peft_model(base_dir, adapters: tuple):
    key = (str(base_dir), adapters)
    if key not in _PEFT_CACHE:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        (first, first_path), *rest = adapters
        model = PeftModel.from_pretrained(base, first_path, adapter_name=first)
        for name, path in rest:
            model.load_adapter(path, adapter_name=name)
        _PEFT_CACHE.clear()
        _PEFT_CACHE[key] = model.eval()
    return _PEFT_CACHE[key]


def assert_same_greedy(ours: list[int], ref: list[int], margins: list[float], what: str) -> None:
    for pos, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            near_tie = min(margins[: pos + 1]) < MARGIN
            assert near_tie, (
                f"{what}: token {pos} differs ({a} vs reference {b}) with no near tie before it "
                f"(smallest margin {min(margins[: pos + 1]):.2e})"
            )
            return
    assert len(ours) == len(ref) == NEW_TOKENS, what


def submit_greedy(engine, prompts: list[tuple[list[int], str | None]]) -> list:
    """Submit each (prompt, adapter or None) for NEW_TOKENS greedy tokens; their handles."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [
        engine.submit(GenerationRequest(list(p), params, engine.resolve_adapter(a)))
        for p, a in prompts
    ]


def run_mixed_batch(
    model_dir, adapters: dict[str, str], prompts, kernel: str, device="cpu", **config
):
    with running_engine(
        model_dir, adapters, device=device, kernel=kernel, max_total_tokens=4096,
        max_batch_size=16, **config,
    ) as engine:  # fmt: skip
        # Submit everything before the first step so the requests share prefill and decode.
        handles = submit_greedy(engine, prompts)
        results = [h.result(timeout_s=300) for h in handles]
        stats = engine.stats().to_json()
        pin = int(engine.lora.mode.preload)  # a preloaded adapter keeps its registration pin
        held = {e.resident.name: e.refcount for e in engine.lora.cache.entries.values()
                if e.refcount != pin}  # fmt: skip
    assert stats["running"] == [] and stats["queue"] == []
    # Nothing held (on CUDA the memory pool also keeps adapters and KV blocks cached).
    assert stats["memory"]["blocks"]["kv_in_use"] == 0 and held == {}, (stats["memory"], held)
    return [r.new_token_ids for r in results]


def mixed_prompts(vocab: int, seed: int) -> list[tuple[list[int], str | None]]:
    """8 adapter requests (2 per adapter, different lengths) plus 2 base-model requests."""
    gen = torch.Generator().manual_seed(seed)
    names = [f"r{r}" for r in ADAPTER_SPECS] * 2 + [None, None]
    lengths = [5, 17, 9, 33, 12, 3, 21, 8, 14, 6]
    return [
        (torch.randint(3, vocab, (n,), generator=gen).tolist(), name)
        for n, name in zip(lengths, names)
    ]


def check_model(model_dir, adapters, vocab, kernel, device="cpu", **config):
    prompts = mixed_prompts(vocab, seed=1)
    ours = run_mixed_batch(model_dir, adapters, prompts, kernel, device, **config)
    for (prompt, name), got in zip(prompts, ours):
        ref, margins = reference_greedy(model_dir, adapters, prompt, name)
        assert_same_greedy(got, ref, margins, f"adapter {name}, prompt of {len(prompt)}")


@pytest.mark.parametrize(("kernel", "async_scheduling"),
                         [("mbgmv", False), ("bgmv", False), ("mbgmv", True)])  # fmt: skip
def test_mixed_batch_matches_peft_tiny(tmp_path_factory, tiny_model_dir, kernel, async_scheduling):
    adapters = make_adapters(tmp_path_factory.mktemp("adapters"), tiny_model_dir)
    check_model(tiny_model_dir, adapters, vocab=200, kernel=kernel,
                async_scheduling=async_scheduling)  # fmt: skip


@pytest.mark.parametrize("kernel", ["mbgmv", "bgmv"])
def test_a_rank_one_adapter_matches_peft(tmp_path, tiny_model_dir, kernel):
    """Rank 1 on all seven projections beside rank 16 and the base model (a rank-1 B [out, 1]
    held as the transpose of B^T is contiguous with a last stride of `out`: loading it failed)."""
    from toppings.scripts.make_adapters import make_random_adapter

    targets = ADAPTER_SPECS[64]
    adapters = {f"r{r}": str(make_random_adapter(tmp_path / f"r{r}", tiny_model_dir, rank=r,
                                                 target_modules=targets, seed=r))
                for r in (1, 16)}  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    prompts = [(torch.randint(3, 200, (n,), generator=gen).tolist(), name)
               for n, name in ((7, "r1"), (19, "r1"), (11, "r16"), (5, None))]  # fmt: skip
    ours = run_mixed_batch(tiny_model_dir, adapters, prompts, kernel)
    for (prompt, name), got in zip(prompts, ours):
        ref, margins = reference_greedy(tiny_model_dir, adapters, prompt, name)
        assert_same_greedy(got, ref, margins, f"adapter {name}, prompt of {len(prompt)}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernel", ["mbgmv", "bgmv"])
def test_mixed_batch_matches_peft_tiny_on_cuda(tmp_path_factory, tiny_model_dir, kernel):
    """The whole engine on the GPU (Triton kernels, device KV pool) against PEFT on the CPU."""
    adapters = make_adapters(tmp_path_factory.mktemp("adapters_cuda"), tiny_model_dir)
    check_model(tiny_model_dir, adapters, vocab=200, kernel=kernel, device="cuda")


@pytest.mark.slow
def test_mixed_batch_matches_peft_smollm2(tmp_path_factory, smollm2_dir):
    adapters = make_adapters(tmp_path_factory.mktemp("smol_adapters"), smollm2_dir)
    check_model(smollm2_dir, adapters, vocab=49152, kernel="mbgmv")


@pytest.mark.parametrize(
    ("num_cpu_workers", "cpu_spin_us", "async_scheduling"),
    [(0, 0.0, False), (2, 0.0, False), (1, 2000.0, False), (2, 0.0, True)],
)
def test_cpu_assisted_matches_peft_while_adapters_load(
    tmp_path_factory, num_cpu_workers, cpu_spin_us, async_scheduling
):
    """Loads throttled to take ~1 s each: prefill and early decode run partly on the host path
    (in-process with 0 workers, else the shared-memory CPU worker pool, sleeping or spinning
    on its semaphores), also with the model on the device lane (async scheduling)."""
    from toppings.scripts.make_tiny_llama import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny4"), num_layers=4)
    adapters = make_adapters(tmp_path_factory.mktemp("adapters4"), model_dir)
    adapter_bytes = 64 * (64 + 64) * 4 * 7 * 4  # rank 64, 7 projections of ~64x64, 4 layers, f32
    with running_engine(
        model_dir, adapters, lora_mode="cpu-assisted", max_total_tokens=4096, max_batch_size=16,
        link_gbps=adapter_bytes * 8 / 1.0 / 1e9, layers_per_group=1,
        num_cpu_workers=num_cpu_workers, cpu_spin_us=cpu_spin_us,
        async_scheduling=async_scheduling,
    ) as engine:  # fmt: skip
        assert engine.stats().to_json()["adapters"][0]["resident"] is False  # nothing preloaded
        prompts = mixed_prompts(200, seed=2)
        handles = submit_greedy(engine, prompts)
        ours = [h.result(timeout_s=300).new_token_ids for h in handles]
        assert engine.lora.host_stats.calls > 0, (
            "no layer ran on the host: the loads were not in flight"
        )
        assert engine.lora.cache.counters.loads == len(adapters)
        stats = engine.stats().to_json()
        assert [w["alive"] for w in stats["cpu_workers"]] == [True] * num_cpu_workers
    assert stats["free_kv_tokens"] == stats["max_total_tokens"]
    for (prompt, name), got in zip(prompts, ours):
        ref, margins = reference_greedy(model_dir, adapters, prompt, name)
        assert_same_greedy(got, ref, margins, f"cpu-assisted, adapter {name}")


def test_sigkilled_cpu_worker_mid_request_changes_no_token(tmp_path_factory):
    """A worker killed while loads are in flight: requests finish with the reference's tokens,
    and nothing of ours stays in /dev/shm after shutdown."""
    import glob
    import os
    import signal

    from toppings.scripts.make_tiny_llama import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny4k"), num_layers=4)
    adapters = make_adapters(tmp_path_factory.mktemp("adapters4k"), model_dir)
    adapter_bytes = 64 * (64 + 64) * 4 * 7 * 4
    with running_engine(
        model_dir, adapters, lora_mode="cpu-assisted", max_total_tokens=4096, max_batch_size=16,
        link_gbps=adapter_bytes * 8 / 2.0 / 1e9, num_cpu_workers=2,
    ) as engine:  # fmt: skip
        names = [engine.lora.host.repository.name, *engine.lora.host.workers.shm_names()]
        # POSIX names: "/x" is /dev/shm/x for memory and /dev/shm/sem.x for a semaphore.
        files = [p for n in names for p in glob.glob(f"/dev/shm/*{n.lstrip('/')}")]
        assert len(files) == len(names), "the worker pool's shared memory should exist"
        prompts = mixed_prompts(200, seed=3)
        handles = submit_greedy(engine, prompts)
        first = handles[0].events(timeout_s=120)
        got0 = list(next(first).new_token_ids)  # the first step ran: loads are still going
        victim = engine.stats().to_json()["cpu_workers"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        got0 += [t for out in first for t in out.new_token_ids]
        ours = [got0] + [h.result(timeout_s=300).new_token_ids for h in handles[1:]]
        workers = engine.stats().to_json()["cpu_workers"]
        assert victim not in [w["pid"] for w in workers] and all(w["alive"] for w in workers)
        assert engine.lora.host_stats.calls > 0
        counters = engine.counters()  # /metrics' series of the workers
        assert counters.cpu_workers_alive == 2 and counters.cpu_worker_restarts >= 1
    assert [p for p in files if os.path.exists(p)] == []
    for (prompt, name), got in zip(prompts, ours):
        ref, margins = reference_greedy(model_dir, adapters, prompt, name)
        assert_same_greedy(got, ref, margins, f"worker killed, adapter {name}")


@pytest.mark.parametrize("mode", ["on-demand", "on-demand-sync"])
def test_on_demand_waits_for_whole_adapters(tmp_path_factory, mode):
    """on-demand (a request waits for its adapter) and on-demand-sync (its step waits): no
    layer ever runs on the host; outputs stay exact."""
    from toppings.scripts.make_tiny_llama import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny4d"), num_layers=4)
    adapters = make_adapters(tmp_path_factory.mktemp("adapters4d"), model_dir)
    adapter_bytes = 64 * (64 + 64) * 4 * 7 * 4
    with running_engine(
        model_dir, adapters, lora_mode=mode, max_total_tokens=4096, max_batch_size=16,
        link_gbps=adapter_bytes * 8 / 0.5 / 1e9,
    ) as engine:  # fmt: skip
        prompts = mixed_prompts(200, seed=4)
        handles = submit_greedy(engine, prompts)
        ours = [h.result(timeout_s=300).new_token_ids for h in handles]
        assert engine.lora.host_stats.calls == 0
        assert engine.lora.cache.counters.loads == len(adapters)
    for (prompt, name), got in zip(prompts, ours):
        ref, margins = reference_greedy(model_dir, adapters, prompt, name)
        assert_same_greedy(got, ref, margins, f"{mode}, adapter {name}")
