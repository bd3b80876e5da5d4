"""transformers (+ PEFT) on bench_throughput's workload: batched generate, one request alone, and
the greedy tokens to compare with ours.

The model comes from `bench.hf_peft_peer` (`load_base`, `attach_adapters`), so a dummy-weight
checkpoint is the same model our engine serves. Every call is greedy with
`min_new_tokens = max_new_tokens`, so EOS never ends a row early.
"""

from __future__ import annotations

import statistics
import time

import torch


def generate(model, prompts: list[list[int]], adapters: list[str] | None, new_tokens: int):
    """Greedy `new_tokens` tokens for equal-length `prompts` (one batch); [B, new_tokens] ids.

    `adapters`: one PEFT adapter name per prompt (the mixed-batch path), or None for the model
    as it is (a plain transformers model, or a PeftModel's active adapter)."""
    ids = torch.tensor(prompts)  # [B, S]
    kwargs = {"adapter_names": adapters} if adapters else {}
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out[:, ids.shape[1] :]


def run_hf_single(model, prompt, adapter: str | None, new_tokens: int, rounds: int) -> dict:
    """One request alone: TTFT = a 1-token generate, TPOT from the rest (median ms)."""
    adapters = [adapter] if adapter else None

    def timed(n: int) -> float:
        start = time.perf_counter()
        generate(model, [prompt], adapters, n)
        return (time.perf_counter() - start) * 1e3

    timed(2)  # warm-up
    ttft = statistics.median(timed(1) for _ in range(rounds))
    total = statistics.median(timed(new_tokens) for _ in range(rounds))
    return {"ttft_ms": ttft, "tpot_ms": (total - ttft) / (new_tokens - 1)}


def run_hf_peft(model, prompts, names, new_tokens: int, batch_size: int) -> dict:
    """Tokens/s of batched `generate(adapter_names=...)` over `prompts` in batches."""
    tokens = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        out = generate(model, prompts[i : i + batch_size], names[i : i + batch_size], new_tokens)
        tokens += out.numel()
    elapsed = time.perf_counter() - start
    return {
        "batch_size": batch_size,
        "requests": len(prompts),
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
    }


def agreement(ours: list[int], theirs: list[int]) -> dict:
    """How far two greedy continuations agree: the fraction of positions with the same token and
    the length of the common prefix (after a first difference the contexts differ, so later
    positions rarely agree). With random weights near-ties are common: bf16 rounding flips them.
    """
    same = sum(a == b for a, b in zip(ours, theirs))
    prefix = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    return {
        "fraction": same / max(len(ours), 1),
        "common_prefix": prefix,
        "ours": ours,
        "transformers": theirs,
    }
