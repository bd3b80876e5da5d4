"""The peer a user would pick instead: transformers + PEFT, replaying a trace in-process.

What it does, exactly: the base model and every adapter of the trace are loaded into one
`PeftModel` (float32 unless asked otherwise, before the clock starts). A `--load-format dummy`
checkpoint (config.json only) gets the very tensors our engine draws for it: `load_base` copies
the engine loader's `DummyWeights` into transformers' model of the config. A loop then serves
the trace open-loop in arrival time: it waits for the next arrival, takes every request that has
arrived (up to `max_batch`), left-pads their prompts and runs one
`generate(adapter_names=[...])` for the batch (greedy, `min_new_tokens = max_new_tokens = ` the
longest request of the batch, so EOS never ends a row early); requests arriving meanwhile wait
for the next batch (static batching).

Timing is generous to the peer: a stopping-criteria hook stamps each decoding step, a request's
TTFT is its arrival to the batch's first token, and its E2E is its arrival to the step that
produced its own last token (as if it were streamed and closed then), not to the end of the
batch. No HTTP is involved. Records have the load generator's shape
(toppings.scripts.loadgen.client).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from toppings.scripts.loadgen.client import request_config
from toppings.scripts.loadgen.workload import TraceEntry
from toppings.scripts.make_adapters import base_from_config
from toppings.server.config import LoadFormat
from toppings.server.model.loader import load_checkpoint, resolve_model_dir

log = logging.getLogger(__name__)


class StepClock(StoppingCriteria):
    """Stamps the wall time of every generated token of a batch; never stops generation."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.times.append(time.time())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def load_base(
    model: str | Path, dtype: torch.dtype = torch.float32, load_format: LoadFormat = LoadFormat.AUTO
):
    """transformers' model of `model` (what toppings-serve --model takes) in `dtype`, eval mode.

    AUTO and SAFETENSORS read the checkpoint with `from_pretrained`; DUMMY builds the model from
    config.json and fills it with the weights our engine's loader draws for the same directory
    (`load_checkpoint(model, "dummy")`, seed 0 as the engine's), so both serve the same model.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if load_format is LoadFormat.DUMMY:
        weights = load_checkpoint(str(model), load_format).weights
        hf_config = AutoConfig.from_pretrained(resolve_model_dir(str(model)))
        return base_from_config(hf_config, weights, dtype)
    return AutoModelForCausalLM.from_pretrained(resolve_model_dir(str(model)), dtype=dtype).eval()


def attach_adapters(base, adapters: dict[str, str]):
    """`base` wrapped (in place) in a `PeftModel` holding every adapter (name -> PEFT dir)."""
    from peft import PeftModel

    items = list(adapters.items())
    model = PeftModel.from_pretrained(base, items[0][1], adapter_name=items[0][0])
    for name, path in items[1:]:
        model.load_adapter(path, adapter_name=name)
    return model.eval()


def load_peft_model(
    model_dir: str | Path,
    adapters: dict[str, str],
    dtype: torch.dtype = torch.float32,
    load_format: LoadFormat = LoadFormat.AUTO,
):
    """The base model (see `load_base`) with all `adapters` (name -> PEFT dir), in eval mode."""
    return attach_adapters(load_base(model_dir, dtype, load_format), adapters)


def run_batch(model, batch: list[TraceEntry], pad_id: int) -> list[float]:
    """Generate for one batch; returns the time stamp of each decoding step."""
    width = max(len(e.prompt) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [B, S], left-padded
    mask = torch.zeros_like(ids)
    for row, entry in enumerate(batch):
        ids[row, width - len(entry.prompt) :] = torch.tensor(entry.prompt)
        mask[row, width - len(entry.prompt) :] = 1
    new_tokens = max(e.max_tokens for e in batch)
    clock = StepClock()
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            adapter_names=[e.model for e in batch],
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    return clock.times


def replay(model, trace: list[TraceEntry], max_batch: int = 32, pad_id: int = 0) -> list[dict]:
    """Serve `trace` as described in the module doc; one record per request."""
    pending = deque(sorted(trace, key=lambda e: e.arrival_s))
    records = []
    start = time.time()
    while pending:
        wait = start + pending[0].arrival_s - time.time()
        if wait > 0:
            time.sleep(wait)
        now = time.time() - start
        batch = []
        while pending and pending[0].arrival_s <= now and len(batch) < max_batch:
            batch.append(pending.popleft())
        began = time.time()
        steps = run_batch(model, batch, pad_id)
        for entry in batch:
            arrival = start + entry.arrival_s
            end = steps[entry.max_tokens - 1]
            result = {
                "ok": True,
                "start_unix": arrival,
                "end_unix": end,
                "lag_s": 0.0,
                "queue_s": began - arrival,
                "ttft_s": steps[0] - arrival,
                "e2e_s": end - arrival,
                "tpt_s": (end - arrival) / entry.max_tokens,
                "output_tokens": entry.max_tokens,
                "batch_size": len(batch),
            }
            records.append({"config": request_config(entry), "result": result})
        log.info("hf-peft: batch of %d done, %d left", len(batch), len(pending))
    return records
