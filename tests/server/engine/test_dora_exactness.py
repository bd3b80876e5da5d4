"""DoRA adapters (PEFT's `use_dora=True`) in mixed batches with plain LoRA and base-model rows
give what transformers + PEFT's own DoRA forward gives each request alone: the greedy token at
every position (unless the reference has a near tie there) and the logprobs within 1e-4, for
both kernels and every LoRA mode, the CPU-assisted host path (in-process and worker processes)
included, on a Llama and on a Qwen2 (whose q/k/v biases DoRA leaves unscaled).

Each request is scored alone by the reference on its prompt plus the tokens our engine chose
(teacher forcing), so every position our engine computed is checked.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import running_engine
from tests.server.engine.test_exactness import _nullcontext, _peft_model
from toppings.server.requests.request import GenerationRequest, SamplingParams

TOL = 1e-4
MARGIN = 1e-4
NEW_TOKENS = 8
TOP = 2
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (rank, targets, use_dora): odd-rank DoRA adapters on all seven targets and on some,
# beside a plain LoRA adapter.
SPECS = {
    "dora3": (3, ALL, True),
    "dora5": (5, ("q_proj", "v_proj", "o_proj", "down_proj"), True),
    "dora7": (7, ALL, True),
    "lora8": (8, ("q_proj", "v_proj", "gate_proj"), False),
}
MODES = ("cached", "on-demand", "on-demand-sync", "cpu-assisted")


def make_adapters(root, base_dir) -> dict[str, str]:
    from toppings.scripts.make_adapters import make_random_adapter

    return {
        name: str(
            make_random_adapter(
                root / name, base_dir, rank=rank, target_modules=targets, seed=i, use_dora=dora
            )
        )  # fmt: skip
        for i, (name, (rank, targets, dora)) in enumerate(SPECS.items())
    }


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from toppings.scripts.make_tiny_llama import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path_factory.mktemp("dora_llama"), num_layers=3)
    return model_dir, make_adapters(tmp_path_factory.mktemp("dora_adapters"), model_dir)


def prompts_for(vocab: int, seed: int) -> list[tuple[list[int], str | None]]:
    """Two requests per adapter (consecutive and apart) and two base-model requests."""
    gen = torch.Generator().manual_seed(seed)
    names = [*SPECS, None, *SPECS, None]
    lengths = [5, 17, 9, 23, 12, 3, 21, 8, 14, 6]
    return [(torch.randint(3, vocab, (n,), generator=gen).tolist(), name)
            for n, name in zip(lengths, names)]  # fmt: skip


def run(engine, prompts, new_tokens: int = NEW_TOKENS):
    """Greedy results of (prompt, adapter name) pairs, with TOP logprobs of prompt and output."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=TOP, prompt_logprobs=TOP)  # fmt: skip
    handles = [
        engine.submit(GenerationRequest(list(p), params, engine.resolve_adapter(a)))
        for p, a in prompts
    ]
    return [h.result(timeout_s=300) for h in handles]


def check_against_peft(model_dir, adapters, prompts, results) -> None:
    """Teacher-forced: our greedy choice is the reference's argmax (or a near tie) at every
    generated position, and every logprob we report matches its log-softmax within TOL."""
    model = _peft_model(model_dir, tuple(sorted(adapters.items())))
    for (prompt, name), out in zip(prompts, results):
        ids = prompt + out.new_token_ids
        ctx = model.disable_adapter() if name is None else _nullcontext()
        if name is not None:
            model.set_adapter(name)
        with ctx, torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)  # [len, V]
        scored = out.prompt_logprobs[1:] + out.logprobs  # predicts ids[1:]
        assert [s.token_id for s in scored] == ids[1:]
        for pos, s in enumerate(scored):
            want = ref[pos]
            assert abs(s.logprob - float(want[ids[pos + 1]])) < TOL, (name, pos)
            got_top = torch.tensor([lp for _, lp in s.top])
            assert torch.allclose(got_top, want.topk(TOP).values, atol=TOL), (name, pos)
        for pos in range(len(prompt) - 1, len(ids) - 1):  # the greedy choices
            top2 = torch.topk(logits[pos], 2).values
            if ids[pos + 1] != int(logits[pos].argmax()):
                assert float(top2[0] - top2[1]) < MARGIN, (name, pos, "greedy token differs")
                break  # past a near tie the continuations may part


def slow_link(adapters: dict[str, str], seconds: float) -> float:
    """An emulated link (Gbit/s) over which the largest adapter's load takes about `seconds`."""
    from safetensors import safe_open

    largest = 0
    for path in adapters.values():
        with safe_open(f"{path}/adapter_model.safetensors", "pt") as f:
            largest = max(largest, sum(f.get_tensor(k).numel() * 4 for k in f.keys()))
    return largest * 8 / seconds / 1e9


@pytest.mark.parametrize("lora_mode", MODES)
@pytest.mark.parametrize("kernel", ["mbgmv", "bgmv"])
def test_dora_mixed_batch_matches_peft(llama, kernel, lora_mode):
    model_dir, adapters = llama
    link = slow_link(adapters, 0.5) if lora_mode != "cached" else 0.0
    with running_engine(
        model_dir, adapters, kernel=kernel, lora_mode=lora_mode, max_total_tokens=4096,
        max_batch_size=16, link_gbps=link,
    ) as engine:  # fmt: skip
        assert sum(a.is_dora for a in engine.lora.host.registered()) == 3
        prompts = prompts_for(256, seed=11)
        results = run(engine, prompts)
        if lora_mode == "cpu-assisted":
            assert engine.lora.host_stats.calls > 0, "no layer ran on the host"
    check_against_peft(model_dir, adapters, prompts, results)


@pytest.mark.parametrize("num_cpu_workers", [2])
def test_dora_on_cpu_workers_matches_peft(llama, num_cpu_workers):
    """The host path in worker processes over shared memory: the workers compute x @ A @ B,
    the DoRA scale is applied where the base output and the delta meet."""
    model_dir, adapters = llama
    with running_engine(
        model_dir, adapters, lora_mode="cpu-assisted", max_total_tokens=4096, max_batch_size=16,
        link_gbps=slow_link(adapters, 1.0), num_cpu_workers=num_cpu_workers,
    ) as engine:  # fmt: skip
        prompts = prompts_for(256, seed=12)
        results = run(engine, prompts)
        assert engine.lora.host_stats.calls > 0, "no layer ran on the host"
        assert [w["alive"] for w in engine.stats().to_json()["cpu_workers"]] == [True] * 2
    check_against_peft(model_dir, adapters, prompts, results)


@pytest.mark.parametrize(("kernel", "lora_mode"), [("bgmv", "cached"), ("mbgmv", "cpu-assisted")])
def test_dora_with_biased_projections_matches_peft(tmp_path_factory, kernel,
                                                   lora_mode):  # fmt: skip
    """Qwen2's q/k/v have biases, which DoRA's scale leaves out: (1 - g) * bias per row."""
    from tests.server.model.tiny_families import make_tiny_family

    model_dir = make_tiny_family(tmp_path_factory.mktemp("dora_qwen2") / "model", "qwen2")
    adapters = make_adapters(tmp_path_factory.mktemp("dora_qwen2_adapters"), model_dir)
    link = slow_link(adapters, 0.5) if lora_mode != "cached" else 0.0
    with running_engine(
        model_dir, adapters, kernel=kernel, lora_mode=lora_mode, max_total_tokens=4096,
        max_batch_size=16, link_gbps=link,
    ) as engine:  # fmt: skip
        prompts = prompts_for(200, seed=13)
        results = run(engine, prompts)
    check_against_peft(model_dir, adapters, prompts, results)


def test_dora_adapter_files_that_do_not_fit_are_refused(llama, tmp_path):
    """A DoRA config without its magnitudes, magnitudes without use_dora, and DoRA with an
    option still unsupported: each refused naming what is wrong."""
    import shutil

    from toppings.gpu_lora.peft.adapter import AdapterError, load_peft_adapter
    from toppings.server.model.loader import load_checkpoint

    model_dir, adapters = llama
    config = load_checkpoint(str(model_dir)).config

    def variant(name: str, change_config=None, drop_magnitudes: bool = False):
        from safetensors.torch import load_file, save_file

        out = tmp_path / name
        shutil.copytree(adapters["dora3"], out)
        cfg = json.loads((out / "adapter_config.json").read_text())
        if change_config:
            cfg.update(change_config)
        (out / "adapter_config.json").write_text(json.dumps(cfg))
        if drop_magnitudes:
            tensors = load_file(out / "adapter_model.safetensors")
            kept = {k: v for k, v in tensors.items() if "magnitude" not in k}
            save_file(kept, out / "adapter_model.safetensors")
        return out

    cases = [
        (variant("no_magnitudes", drop_magnitudes=True), "lora_magnitude_vector"),
        (variant("not_dora", {"use_dora": False}), "does not set use_dora"),
        (variant("patterned", {"rank_pattern": {"q_proj": 2}}), "rank_pattern"),
    ]
    for path, words in cases:
        with pytest.raises(AdapterError, match=words):
            load_peft_adapter(path, config)


def test_dora_adapter_load_error_is_a_400(llama, tmp_path):
    """Over HTTP: a DoRA adapter missing its magnitudes is a 400 with the error body, and the
    server keeps serving the DoRA adapters it has."""
    import shutil

    from safetensors.torch import load_file, save_file

    from toppings.server.api.app import ApiOptions, create_app

    model_dir, adapters = llama
    bad = tmp_path / "bad"
    shutil.copytree(adapters["dora5"], bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if "magnitude" not in k},
              bad / "adapter_model.safetensors")  # fmt: skip
    with running_engine(model_dir, {"dora3": adapters["dora3"]}, max_total_tokens=1024) as engine:
        client = create_app(engine, ApiOptions(lora_roots=(str(tmp_path),))).test_client()
        reply = client.post("/v1/load_lora_adapter", json={"lora_name": "bad",
                                                           "lora_path": str(bad)})  # fmt: skip
        assert reply.status_code == 400, reply.get_data(as_text=True)
        error = reply.get_json()["error"]
        assert "lora_magnitude_vector" in error["message"] and error["type"] and error["code"]
        ok = client.post("/v1/completions", json={"model": "dora3", "prompt": "hello",
                                                  "max_tokens": 2})  # fmt: skip
        assert ok.status_code == 200


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cuda_graphs", [False, True])
@pytest.mark.parametrize("kernel", ["mbgmv", "bgmv"])
def test_dora_matches_peft_on_cuda(llama, kernel, cuda_graphs):
    """The engine on the GPU (Triton kernels); with decode graphs on, steps with a DoRA row run
    eagerly and the others may replay."""
    model_dir, adapters = llama
    with running_engine(
        model_dir, adapters, device="cuda", kernel=kernel, max_total_tokens=4096,
        max_batch_size=16, cuda_graphs=cuda_graphs,
    ) as engine:  # fmt: skip
        prompts = prompts_for(256, seed=14)
        results = run(engine, prompts)
    check_against_peft(model_dir, adapters, prompts, results)
