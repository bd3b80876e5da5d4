"""lm-eval-harness, a real evaluation client, scores a local multiple-choice task through our
server (`local-completions`: echo + logprobs on lists of token-id prompts) and with its own `hf`
backend on the same checkpoint, with and without an adapter (`model=ADAPTER` against
`hf` with `peft=DIR`): every choice's log-likelihood agrees within 1e-3 (fp32), and so do the
is-greedy flags and the accuracy. Offline: the task is a JSONL file next to its YAML.

By hand, against a running `toppings-serve --model DIR --lora sql=ADAPTER --dtype float32`:

    cd tests/server/api/lm_eval_task && HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 lm_eval \\
      --model local-completions --include_path . --tasks toppings_tiny_mc --model_args \\
      model=sql,base_url=http://127.0.0.1:8100/v1/completions,tokenizer=DIR,\\
    tokenizer_backend=huggingface,tokenized_requests=True --batch_size 4
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TASK = "toppings_tiny_mc"
TOL = 1e-3

lm_eval = pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir, tiny_engine, serve_app):
    """A waitress server on the tiny model (float32) with adapter `sql`; yields (url, base model
    name, adapter directory)."""
    from toppings.scripts.make_adapters import make_random_adapter
    from toppings.server.api.app import create_app

    root = tmp_path_factory.mktemp("lm_eval_adapter")
    adapter = make_random_adapter(root / "sql", tiny_model_dir, rank=16, seed=11)
    with (
        tiny_engine({"sql": str(adapter)}, max_total_tokens=8192, max_batch_size=32) as engine,
        serve_app(create_app(engine)) as url,
    ):
        yield url, engine.model_name, Path(adapter)


def evaluate(model: str, model_args: str, batch_size: int) -> tuple[float, list[list]]:
    """(accuracy, per doc: [(loglikelihood, is_greedy) per choice]) of one lm-eval run."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(TASK_DIR)),
        batch_size=batch_size,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    per_doc = [[tuple(r[0]) for r in s["resps"]] for s in samples]
    return results["results"][TASK]["acc,none"], per_doc


@pytest.mark.parametrize("adapter", [False, True], ids=["base", "adapter"])
def test_lm_eval_local_completions_matches_hf(served, tiny_model_dir, monkeypatch, adapter):
    url, base_name, adapter_dir = served
    monkeypatch.chdir(TASK_DIR)  # the YAML names its JSONL relative to here
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(Path(os.environ.get("TMPDIR", "/tmp")) / "lmeval"))
    ours_args = (
        f"model={'sql' if adapter else base_name},base_url={url}/v1/completions,"
        f"tokenizer={tiny_model_dir},tokenizer_backend=huggingface,tokenized_requests=True,"
        "num_concurrent=1,max_retries=1,max_length=512"
    )
    hf_args = f"pretrained={tiny_model_dir},dtype=float32,device=cpu"
    if adapter:
        hf_args += f",peft={adapter_dir}"
    ours_acc, ours = evaluate("local-completions", ours_args, batch_size=4)
    hf_acc, ref = evaluate("hf", hf_args, batch_size=4)
    assert len(ours) == len(ref) == 10
    for doc_idx, (got, want) in enumerate(zip(ours, ref)):
        assert len(got) == len(want)
        for (ll, greedy), (ll_ref, greedy_ref) in zip(got, want):
            assert abs(ll - ll_ref) < TOL, (doc_idx, got, want)
            assert greedy == greedy_ref, (doc_idx, got, want)
    assert ours_acc == hf_acc
