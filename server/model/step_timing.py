"""Step times measured at start-up on the engine's own model and machine.

The chunked-prefill budget (server.sched.step_budget) is sized from a linear model of step
times: a decode step of B requests, and each prompt token computed beside it. Its points are
timed here on the base model's forward pass over scratch KV rows, taken from the pool and given
back before the engine serves: decode steps of one, half and all of `max_batch_size` requests
over a short past, prompts of two lengths beside the full batch of decodes (a mixed step runs a
decode row as a one-token segment, which costs more than in a decode step), and the shorter
prompt alone, with no past and after a long one (its attention to that past is what a late
chunk of a long prompt costs more), each timed best of `REPEATS` after a warm-up; and the
model's projections at GEMM_LADDER rows (one layer's timed, times its layers), from which the
budget's GEMM floor is chosen (server.sched.step_budget: on a 2-core AMX Xeon oneDNN's bfloat16
products cost 1.4-2x more a row below ~1,344 rows than above; docs/benchmarks.md, "Measurements
behind the code"). Each size is timed right after an untimed call of the same shapes: oneDNN
keeps a compiled primitive per shape in a cache the server bounds to 16 entries
(server.process.allocator), and the ladder's sizes in turn are 16 shapes, so timed cold every
call paid a primitive's creation (~0.7 ms a product on a 2-core EPYC), once a layer here where
a step pays it once for all its layers: that made 256 rows read 1.4x the rate of 2,048 in the
server (1.1x warm) and the floor 1,024 instead of 256. The
result is only a prior: whatever else ran on the machine at start-up is in it, and the steps
the engine really runs correct it within a few dozen steps (server.sched.step_refit).
LoRA is not in the timed steps (no adapter is on the device at start-up); it adds a few percent
to a step (bench engine_throughput's decode_step_ratio_lora_vs_base).

The times are kept under the cache (`~/.cache/toppings/step_times/`, a JSON file per key) and
read back at the next start-up of the same model shape, dtype, device, batch, pool geometry, thread
count, CPU, torch and forward-pass source (measuring them is most of a small machine's start-up:
docs/benchmarks.md, "The demo, cold and warm"): the engine corrects them from its real steps as it
runs (server.sched.step_refit). `TOPPINGS_STEP_TIMES=measure` measures again (and keeps the new
times); deleting the file does too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from toppings.server.memory.kv_cache import KVPool
from toppings.server.model.llama import ForwardBatch, LlamaModel

log = logging.getLogger(__name__)

PAST = 48  # tokens each decode row has attended to (a short chat turn)
PROMPTS = (32, 160)  # the two prompt lengths whose difference gives the cost of a token
LONG_PAST = 1024  # the past of the late chunk (PROMPTS[0] tokens), where the pool allows
REPEATS = 3
GEMM_LADDER = (256, 512, 1024, 2048)  # rows at which the projections are timed


@dataclass(frozen=True)
class StepTimes:
    """Measured step times in ms: decode steps by batch size, a chunk of `chunk_tokens` alone
    by the length of its past (0 among them), and mixed steps of `mixed_rows` decodes by their
    prompt tokens."""

    decode_ms: dict[int, float]
    chunk_ms: dict[int, float]
    mixed_ms: dict[int, float]  # mixed_rows decode rows and each of PROMPTS prompt tokens
    mixed_rows: int
    chunk_tokens: int = PROMPTS[0]
    # the model's projections (qkv, o, gate_up, down; one layer's timed, times its layers) by
    # rows, GEMM_LADDER ({}: not measured)
    gemm_ms: dict[int, float] = dataclasses.field(default_factory=dict)
    cached_in: str | None = None  # the file these were read from (None: measured now)

    def describe(self) -> str:
        def points(times: dict[int, float]) -> str:
            return "/".join(map(str, times)) + ": " + "/".join(f"{t:.1f}" for t in times.values())

        when = "measured at start-up" + (
            "" if self.cached_in is None else f" (an earlier one's, kept in {self.cached_in})"
        )
        return (
            f"{when}, decode steps of {points(self.decode_ms)} ms, "
            f"{self.chunk_tokens} tokens after "
            f"{points(self.chunk_ms)} ms, {self.mixed_rows} decodes beside "
            f"{points(self.mixed_ms)} ms (base model, no LoRA)"
            + (f", the projections by rows {points(self.gemm_ms)} ms" if self.gemm_ms else "")
        )


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """A function that times a call in ms, waiting for the device's queued work."""

    def best_ms(call: Callable[[], object]) -> float:
        call()  # warm-up: kernels picked, buffers allocated
        return min(_once_ms(device, call) for _ in range(REPEATS))

    return best_ms


def _rows_that_fit(kv: KVPool, max_batch_size: int) -> int:
    """How many decode rows of PAST + 1 tokens the pool holds beside one prompt's blocks."""
    blocks = lambda n: -(-n // kv.block_tokens)  # noqa: E731
    spare = kv.num_free_blocks - blocks(_prompt_slots(kv))
    return max(0, min(max_batch_size, kv.num_free_rows, spare // blocks(PAST + 1)))


def _prompt_slots(kv: KVPool) -> int:
    """Slots of the prompt row: PROMPTS, and the late chunk after its past where it fits."""
    return max(max(PROMPTS), _long_past(kv) + PROMPTS[0])


def _long_past(kv: KVPool) -> int:
    """The past of the late chunk: LONG_PAST, or what the pool's longest row leaves."""
    return min(LONG_PAST, kv.max_len - PROMPTS[0])


def _cache_file(model: LlamaModel, kv: KVPool, num_rows: int) -> Path:
    """Where the times of this model, pool geometry and machine are kept."""
    from toppings.server.model import llama
    from toppings.server.model.loader import cache_dir

    try:
        cpu = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith(("model name", "flags"))), "")  # fmt: skip
    except OSError:
        cpu = platform.processor()
    sources = [Path(__file__).read_bytes(), Path(llama.__file__).read_bytes()]
    parts = [repr(model.config), str(model.dtype), str(model.quantization), str(model.device),
             str(num_rows),
             str(kv.block_tokens), str(kv.max_len), str(torch.get_num_threads()), cpu,
             torch.__version__, os.environ.get("TOPPINGS_NATIVE", "1")]  # fmt: skip
    key = hashlib.sha256(b"\0".join([p.encode() for p in parts] + sources)).hexdigest()[:16]
    return cache_dir() / "step_times" / f"{key}.json"


def _read(path: Path) -> StepTimes | None:
    try:
        raw = json.loads(path.read_text())
        ints = lambda d: {int(k): float(v) for k, v in d.items()}  # noqa: E731
        return StepTimes(ints(raw["decode_ms"]), ints(raw["chunk_ms"]), ints(raw["mixed_ms"]),
                         int(raw["mixed_rows"]), int(raw["chunk_tokens"]), ints(raw["gemm_ms"]),
                         str(path))  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # none kept, or unreadable: measured again


def _write(path: Path, times: StepTimes) -> None:
    raw = dataclasses.asdict(times)
    raw.pop("cached_in")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(raw))
        os.replace(tmp, path)  # a concurrent start-up reads a whole file or none
    except OSError as e:
        log.warning("could not keep the step times in %s: %s", path, e)


def measure_steps(model: LlamaModel, kv: KVPool, max_batch_size: int) -> StepTimes | None:
    """Step times of `model` on this machine: decode steps of 1, half and all of up to
    `max_batch_size` requests, each of PROMPTS tokens beside those decodes, the shorter alone
    with no past and after a long one; None where the pool cannot hold two decode rows and a
    prompt (a tiny test pool). Every row and block taken from `kv` is given back. Times kept
    from an earlier start-up of the same key are read instead (see the module's docstring)."""
    num_rows = _rows_that_fit(kv, max_batch_size)
    if num_rows < 2 or kv.max_len < max(PROMPTS) or kv.max_len < PAST + 1:
        return None
    path = _cache_file(model, kv, num_rows)
    if os.environ.get("TOPPINGS_STEP_TIMES") != "measure" and (kept := _read(path)) is not None:
        return kept
    times = _measure(model, kv, num_rows)
    _write(path, times)
    return times


def warm_forward(model: LlamaModel, kv: KVPool) -> bool:
    """One prefill of PROMPTS[0] random tokens and one decode step after it, on a scratch
    KV row given back (False where the pool has no room for it). The step times above may come
    from a file, and then no forward ran before the first request, which met every one-time
    cost of a forward on its own path (on a GPU the BLAS library's set-up and each kernel's
    first load; on a CPU the thread pools and the native kernels' first calls). What a new
    shape costs stays: each new prompt length makes oneDNN's primitives of its shapes
    (server.process.allocator). Logs its time."""
    n = PROMPTS[0]
    if not kv.num_free_rows or kv.max_len < n + 1 or kv.num_free_slots < n + kv.block_tokens:
        return False
    device = torch.device(model.device)
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    row = kv.new_row()
    try:
        kv.extend(row, n + 1)
        index, lengths = kv.decode_index([row])  # [1, n + 1], [1]
        ids = torch.randint(model.config.vocab_size, (n + 1,), generator=gen).to(device)
        prefill = ForwardBatch(
            input_ids=ids[:n],  # [n]
            positions=torch.arange(n, device=device),  # [n]
            slots=kv.req_to_slot[row, :n],  # [n]
            seg_starts=[0, n],
            is_prefill=True,
            past_slots=[None],
        )
        decode = ForwardBatch(
            input_ids=ids[n:],  # [1]
            positions=torch.full((1,), n, dtype=torch.int64, device=device),  # [1]
            slots=index[:, n].contiguous(),  # [1]
            seg_starts=[0, 1],
            is_prefill=False,
            kv_index=index,
            kv_lengths=lengths,
        )
        with torch.inference_mode():
            model.forward(prefill, kv)
            model.forward(decode, kv)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        kv.free_row(row)
    log.info("warm-up forward (a %d-token prompt, then a decode step): %.0f ms", n,
             1000 * (time.perf_counter() - start))  # fmt: skip
    return True


def _measure(model: LlamaModel, kv: KVPool, num_rows: int) -> StepTimes:
    device = torch.device(model.device)
    best_ms = _timer(device)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    rows: list[int] = []
    prompt_blocks = kv.alloc_blocks(-(-_prompt_slots(kv) // kv.block_tokens))
    try:
        prompt_slots = kv.slots_of(prompt_blocks)  # [P]
        for _ in range(num_rows):
            rows.append(kv.new_row())
            kv.extend(rows[-1], PAST + 1)

        def decode(b: int) -> Callable[[], object]:
            index, lengths = kv.decode_index(rows[:b])  # [b, PAST + 1], [b]
            batch = ForwardBatch(
                input_ids=torch.randint(vocab, (b,), generator=gen).to(device),  # [b]
                positions=torch.full((b,), PAST, dtype=torch.int64, device=device),  # [b]
                slots=index[:, PAST].contiguous(),  # [b]
                seg_starts=list(range(b + 1)),
                is_prefill=False,
                kv_index=index,
                kv_lengths=lengths,
            )
            return lambda: model.forward(batch, kv)

        def step(b: int, n: int, past: int = 0) -> Callable[[], object]:
            """A step with prompt tokens: b decode rows (one-token segments after PAST, as a
            mixed step runs them) and n prompt tokens after `past`."""
            past_rows = [kv.req_to_slot[r, :PAST] for r in rows[:b]]
            batch = ForwardBatch(
                input_ids=torch.randint(vocab, (b + n,), generator=gen).to(device),  # [b + n]
                positions=torch.tensor([PAST] * b + list(range(past, past + n)), device=device),
                slots=torch.cat([kv.req_to_slot[rows[:b], PAST], prompt_slots[past : past + n]]),
                seg_starts=[*range(b + 1), b + n],
                is_prefill=True,
                past_slots=[*past_rows, prompt_slots[:past] if past else None],
            )
            return lambda: model.forward(batch, kv)

        long_past = _long_past(kv)

        with torch.inference_mode():
            decodes = {b: best_ms(decode(b)) for b in sorted({1, num_rows // 2, num_rows})}
            mixed = {n: best_ms(step(num_rows, n)) for n in PROMPTS}
            chunks = {0: best_ms(step(0, PROMPTS[0]))}
            if long_past >= PROMPTS[0]:  # the past's keys are a prompt's, or zeros
                chunks[long_past] = best_ms(step(0, PROMPTS[0], long_past))
            gemm = gemm_times(model, gen)
    finally:
        for row in rows:
            kv.free_row(row)
        kv.free_blocks(prompt_blocks)
    return StepTimes(decodes, chunks, mixed, num_rows, gemm_ms=gemm)


def gemm_times(model: LlamaModel, gen: torch.Generator) -> dict[int, float]:
    """The model's projections on random inputs of each of GEMM_LADDER rows, in ms by rows:
    its first layer's (qkv, o, gate_up, down) timed, times its layers; each size's best of
    REPEATS after a warm-up, the sizes in turn within a repeat, so that a neighbour's burst does
    not fall on one size alone, each timed call right after an untimed one of its shapes (warm
    primitives: the module docstring)."""
    layer = model.layers[0]
    projections = (layer.qkv, layer.o, layer.gate_up, layer.down)
    device = torch.device(model.device)
    inputs = {n: [torch.randn(n, p.in_features, generator=gen).to(model.dtype).to(device)
                  for p in projections] for n in GEMM_LADDER}  # fmt: skip
    calls = {n: (lambda xs=xs: [p(x) for p, x in zip(projections, xs)]) for n, xs in inputs.items()}
    times = {n: float("inf") for n in GEMM_LADDER}
    for repeat in range(REPEATS + 1):  # the first a warm-up
        for n, call in calls.items():
            call()  # its shapes' primitives made (again) before the timed call
            took = _once_ms(device, call)
            if repeat:
                times[n] = min(times[n], took)
    return {n: ms * len(model.layers) for n, ms in times.items()}


def _once_ms(device: torch.device, call: Callable[[], object]) -> float:
    """One call's time in ms, waiting for the device's queued work before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 1000 * (time.perf_counter() - start)
