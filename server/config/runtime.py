"""Where and how the model runs: device, dtype, kernels, weight format, threads
(`RuntimeConfig`, one part of server.config.EngineConfig)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from toppings.server.settings import (
    ON_OFF,
    Bound,
    Flag,
    Settings,
    on_off,
    setting,
)

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = (*DTYPES, "auto")  # auto: resolved for the machine at start-up (runtime.py)
KERNELS = ("bgmv", "mbgmv")


class LoadFormat(enum.Enum):
    """Where the base model's weights come from (server.model.loader reads them)."""

    AUTO = "auto"  # the checkpoint's safetensors, one file or shards (the only format read)
    SAFETENSORS = "safetensors"
    DUMMY = "dummy"  # random weights of the checkpoint's shapes; only config.json is read


LOAD_FORMATS = tuple(f.value for f in LoadFormat)


class Quantization(enum.Enum):
    """How the base model's projections hold their weights (server.model.quant)."""

    NONE = "none"  # in the activation dtype (--dtype)
    INT8 = "int8"  # weight-only int8, one symmetric scale per output channel
    INT4 = "int4"  # weight-only int4, groups of 32 inputs with a scale and a zero each


QUANTIZATIONS = tuple(q.value for q in Quantization)


@dataclass(frozen=True)
class RuntimeConfig(Settings):
    """Where and how the model runs."""

    title = "device and runtime"

    device: str = setting(
        "cpu", choices=DEVICES, flag=Flag("where the model, its KV cache and the kernels run")
    )
    dtype: str = setting(
        "bfloat16",
        choices=DTYPE_CHOICES,
        flag=Flag(
            "auto (default): bfloat16 on cuda; on a cpu, bfloat16 where it multiplies natively "
            "and the model's projections run faster in it (measured at start-up), else float32",
            default="auto",
        ),
    )
    kernel: str = setting(
        "mbgmv",
        choices=KERNELS,
        flag=Flag(
            "the batched LoRA kernel: mbgmv (S-LoRA's, each adapter at its own rank) or bgmv "
            "(Punica's, every row padded to the batch's largest rank)"
        ),
    )
    load_format: str = setting(
        "auto",
        choices=LOAD_FORMATS,
        flag=Flag(
            "auto/safetensors: the checkpoint's safetensors (one file, or the shards of "
            "model.safetensors.index.json); dummy: random weights of the checkpoint's shapes "
            "from its config.json alone, for benchmarks"
        ),
    )
    quantization: str = setting(
        "none",
        choices=QUANTIZATIONS,
        flag=Flag(
            "weight-only quantization of the base model's projections (q/k/v/o/gate/up/down and "
            "lm_head; embeddings and norms stay in --dtype, LoRA runs in --dtype): int8, one "
            "scale per output channel; int4, groups of 32 inputs (lm_head int8); from the "
            "checkpoint's float weights at load, or a GGUF's Q8_0 / Q4_0 / Q4_1 blocks. "
            "--device cpu only",
        ),
    )
    # Decode steps replay CUDA graphs; None: on for cuda.
    cuda_graphs: bool | None = setting(
        None,
        flag=Flag(
            "decode steps replay CUDA graphs captured per batch-size bucket (default: on with "
            "--device cuda; refused with --device cpu)",
            choices=ON_OFF,
            parse=on_off,
        ),
    )
    # Attention over the paged KV by the Triton kernels of model/paged/ on a GPU; None: on for cuda.
    paged_attention: bool | None = setting(
        None,
        flag=Flag(
            "on a GPU, attention reads the paged KV in place with the Triton kernels (decode and "
            "prefill); off: the torch path, which gathers each step's KV into a dense copy "
            "first (default: on with --device cuda; refused with --device cpu, whose native "
            "kernels read the pool in place)",
            choices=ON_OFF,
            parse=on_off,
        ),
    )
    # Every Triton LoRA kernel variant compiled before /health answers (model/kernel_warmup.py);
    # None: on for cuda.
    warmup: bool | None = setting(
        None,
        flag=Flag(
            "compile every Triton LoRA kernel variant the server can launch (each rank bucket, "
            "token tile and projection shape, decode and prefill) at start-up, before /health "
            "answers, and log their count and time; a kept TRITON_CACHE_DIR makes the next "
            "start-up load them (default: on with --device cuda; refused with --device cpu, "
            "which runs no Triton)",
            choices=ON_OFF,
            parse=on_off,
        ),
    )
    # The next step planned while the device runs this one (engine/step_pipeline.py); None: on
    # for cuda.
    async_scheduling: bool | None = setting(
        None,
        flag=Flag(
            "plan the next step and read its inputs while the device runs this one; the model "
            "runs on a thread of its own (default: on with --device cuda; off on a cpu, where "
            "the host's work and the model's share the cores)",
            choices=ON_OFF,
            parse=on_off,
        ),
    )
    # Detokenizing, stop strings and streaming on a thread of their own
    # (engine/output_processor.py); None: on for cuda without async scheduling.
    output_thread: bool | None = setting(
        None,
        flag=Flag(
            "detokenize, check stop strings and stream outputs on a thread of their own, fed "
            "token ids by the engine thread, while that waits on the device (a request whose "
            "text hits a stop string ends a step or a few later, its tokens past the stop not "
            "sent); off: on the engine thread, inside each step (default: on with --device "
            "cuda and --async-scheduling off; off with async scheduling, where the engine "
            "thread's work already runs beside the device's and the two threads would take "
            "turns at the interpreter, and on a cpu)",
            choices=ON_OFF,
            parse=on_off,
        ),
    )
    # torch (OpenMP) threads of the engine thread; 0: every core.
    num_threads: int = setting(
        0,
        bound=Bound.NON_NEGATIVE,
        flag=Flag(
            "OpenMP threads of the engine's compute (0: torch's default, every core); leave "
            "cores to --cpu-workers on a CPU-only node",
            name="--torch-threads",
            type=int,
            metavar="N",
        ),
    )
    # The engine's thread count chosen from its decode steps (process/thread_governor.py);
    # None: on for cpu.
    adapt_threads: bool | None = setting(
        None,
        flag=Flag(
            "run the engine's steps on half its threads while those measure under half the "
            "time (a neighbour taking a core), all of them again when they are no slower: "
            "decode steps are compared now and then (default: on with --device cpu)",
            choices=ON_OFF,
            parse=on_off,
        ),
    )
    max_model_len: int = setting(0, bound=Bound.NON_NEGATIVE)  # 0: max_position_embeddings

    def check(self) -> None:
        if self.cuda_graphs and self.device != "cuda":
            raise ValueError(
                "--cuda-graphs on needs --device cuda (a CPU has no graphs to capture)"
            )
        if self.paged_attention and self.device != "cuda":
            raise ValueError(
                "--paged-attention on needs --device cuda (a CPU reads the pool natively)"
            )
        if self.warmup and self.device != "cuda":
            raise ValueError("--warmup on needs --device cuda (a CPU runs no Triton kernels)")
        if self.adapt_threads and self.device != "cpu":
            raise ValueError(
                "--adapt-threads on needs --device cpu (it sizes the CPU's OpenMP team)"
            )
        if self.adapt_threads and self.async_scheduling:
            raise ValueError(
                "--adapt-threads sizes the engine thread's team; with "
                "--async-scheduling on the model runs on the device lane: choose one"
            )
        if self.quantization != Quantization.NONE.value and self.device != "cpu":
            raise ValueError(
                f"--quantization {self.quantization} runs on --device cpu only (torch's packed "
                "int8/int4 CPU kernels); use --quantization none on cuda"
            )

    @property
    def quantization_scheme(self) -> Quantization:
        """The quantization as its Enum."""
        return Quantization(self.quantization)

    @property
    def use_thread_governor(self) -> bool:
        """Whether the engine's thread count follows its steps (process/thread_governor.py;
        not with async scheduling, where the model runs on the device lane's thread)."""
        return self.device == "cpu" and self.adapt_threads is not False and not self.use_async

    @property
    def use_async(self) -> bool:
        """Whether the engine plans ahead of the device (server/engine/step_pipeline.py)."""
        if self.async_scheduling is None:
            return self.device == "cuda"
        return self.async_scheduling

    @property
    def use_output_thread(self) -> bool:
        """Whether outputs are made on the output processor's thread (output_processor.py):
        where the engine thread waits on the device inside each step (docs/benchmarks.md, the
        output processor's entry, measured a synchronous loop faster with it, the async one
        and the CPU slower)."""
        if self.output_thread is None:
            return self.device == "cuda" and not self.use_async
        return self.output_thread

    @property
    def use_paged_attention(self) -> bool:
        """Whether GPU attention runs the Triton kernels over the paged KV (model/paged/)."""
        return self.device == "cuda" and self.paged_attention is not False

    @property
    def use_warmup(self) -> bool:
        """Whether the Triton LoRA kernels are compiled at start-up (model/kernel_warmup.py)."""
        return self.device == "cuda" and self.warmup is not False

    @property
    def use_cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs (server/model/cuda_graphs.py)."""
        return self.device == "cuda" and self.cuda_graphs is not False
