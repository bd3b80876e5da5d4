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


def teacher_forced(model, prompt: list[int], tokens: list[int], adapter: str | None) -> dict:
    """transformers' verdict on `tokens`, greedy tokens of another engine after `prompt`: its own
    argmax at each position given the same context, and how far below its max logit each of
    `tokens` lies (0 where they agree; a small gap is a near-tie that rounding can flip)."""
    ids = torch.tensor([prompt + tokens[:-1]])  # [1, S + n - 1]
    kwargs = {"adapter_names": [adapter]} if adapter else {}
    with torch.inference_mode():
        logits = model(input_ids=ids, **kwargs).logits[0, len(prompt) - 1 :].float()  # [n, V]
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]  # [n]
    return {
        "argmax": logits.argmax(-1).tolist(),
        "logit_gaps": (logits.max(-1).values - chosen).tolist(),
    }


def agreement(ours: list[int], theirs: list[int], forced: dict) -> dict:
    """How far two greedy continuations of one prompt agree.

    fraction: the positions where transformers, fed our tokens so far (`teacher_forced`), picks
    our token; a free-running comparison would count every position after a first difference
    as a miss, since the contexts then differ. common_prefix: the tokens both pick running on
    their own. max_logit_gap: the largest gap between transformers' best logit and our token's
    (small: near-ties, which random weights in bf16 make frequent).
    """
    same = sum(a == b for a, b in zip(ours, forced["argmax"]))
    prefix = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    return {
        "fraction": same / max(len(ours), 1),
        "common_prefix": prefix,
        "max_logit_gap": max(forced["logit_gaps"], default=0.0),
        "ours": ours,
        "transformers": theirs,
    }
