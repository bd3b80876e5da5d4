"""A checkpoint's tensors by Hugging Face name, read one at a time when the model asks for them.

`LlamaModel` takes each tensor by name (`weights[name]`), converts it to its dtype and device
and drops the read copy, so the peak host memory of a load is the model's own copy plus one
tensor, however many shards the checkpoint has. Two sources behave the same way:

- `SafetensorsWeights`: `*.safetensors` files, one or several (`model.safetensors.index.json`
  maps each name to its shard). Every shard is opened and its header checked against the index
  before anything is read, so a missing shard or tensor is one error naming the file, raised
  before the model is built.
- `DummyWeights`: random tensors of the checkpoint's shapes (`--load-format dummy`), drawn per
  name from a seed, so a benchmark runs a real-size shape with nothing but config.json. For a
  model off the CPU they are drawn where the model keeps them (`DummyWeights.placed`): drawing
  billions of values on the host and copying them over the link is what a 7B shape's start-up
  would otherwise wait for.

Every tensor of the checkpoint is there by its own name (biases, q/k norms, whatever the family
has), so model code reads what it needs without the loader knowing the family.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
DUMMY_STD = 0.02  # as transformers' default initializer_range: activations stay finite


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is on disk; the message is one line naming the
    file at fault."""


def _tensor_names(path: Path) -> list[str]:
    """Names in a safetensors file's header (the tensors themselves are not read)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # the Rust reader raises its own error type for a corrupt header
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from e


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    """Tensors of safetensors files, each read from its file when asked for, in its stored
    dtype, on the CPU."""

    def __init__(self, files: Mapping[str, Path]):
        """files: tensor name -> the file that holds it (checked by `from_dir`)."""
        self.files = dict(files)

    @classmethod
    def from_dir(cls, model_dir: Path) -> SafetensorsWeights:
        """The weights of a checkpoint directory: shards listed by model.safetensors.index.json,
        else every *.safetensors file. Raises CheckpointError (one line, naming the file) for a
        missing or unreadable shard, a tensor the index places in a shard that lacks it, or a
        name found in two files; FileNotFoundError when there are no safetensors at all."""
        index = model_dir / INDEX_FILE
        if index.is_file():
            return cls(_files_from_index(index))
        paths = sorted(model_dir.glob("*.safetensors"))
        if not paths:
            raise FileNotFoundError(
                f"{model_dir} holds no .safetensors weights (pickles are not read)"
            )
        files: dict[str, Path] = {}
        for path in paths:
            for name in _tensor_names(path):
                if name in files:
                    raise CheckpointError(
                        f"{path}: tensor {name!r} is also in {files[name].name} (no {INDEX_FILE} "
                        "says which one to read)"
                    )
                files[name] = path
        return cls(files)

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self.files[name]
        # get_tensor's tensor is a view of the file's memory map: cloned, the model owns its
        # weights and does not change if the file is rewritten in place while it serves. The
        # file is opened per tensor so that no shard stays mapped once its tensor is copied.
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(name).clone()

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def __contains__(self, name: object) -> bool:
        return name in self.files


def _files_from_index(index: Path) -> dict[str, Path]:
    """The name -> shard map of a safetensors index, each shard checked to exist and to hold
    every tensor the index places in it."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index} is not a safetensors index with a weight_map: {e}") from e
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    files: dict[str, Path] = {}
    for shard, names in sorted(by_shard.items()):
        if Path(shard).name != shard:
            raise CheckpointError(f"{index}: shard {shard!r} is not a file name in the directory")
        path = index.parent / shard
        if not path.is_file():
            raise CheckpointError(
                f"missing shard {path}: {index.name} places {len(names)} tensors there "
                f"(e.g. {names[0]!r})"
            )
        held = set(_tensor_names(path))
        absent = [n for n in names if n not in held]
        if absent:
            raise CheckpointError(
                f"{path} lacks {len(absent)} tensors that {index.name} places there "
                f"(e.g. {absent[0]!r})"
            )
        files.update(dict.fromkeys(names, path))
    return files


class DummyWeights(Mapping[str, torch.Tensor]):
    """Random tensors of given shapes (a benchmark's stand-in for real weights), on `device`
    in `dtype`.

    A name ending in `norm.weight` (layer norms, q/k norms) is all ones; every other tensor is
    N(0, 0.02). Each tensor is drawn from its own generator on `device`, seeded by `seed` and
    its name, so a tensor is the same whatever order the model asks for the others in. Devices
    draw different values from one seed (their generators differ).
    """

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        dtype: torch.dtype,
        seed: int = 0,
        device: str | torch.device = "cpu",
    ):
        self.shapes, self.dtype, self.seed = dict(shapes), dtype, seed
        self.device = torch.device(device)

    @classmethod
    def for_config(cls, hf_config, dtype: torch.dtype, seed: int = 0) -> DummyWeights:
        """The tensors transformers' own model of `hf_config` has (built on the meta device:
        names and shapes only, no memory)."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        # named_parameters lists a tied lm_head once, as the embedding: not a tensor of its own.
        return cls({n: tuple(p.shape) for n, p in model.named_parameters()}, dtype, seed)

    def placed(self, device: str | torch.device, dtype: torch.dtype) -> DummyWeights:
        """These weights as a model on `device` in `dtype` takes them. On a CPU they stay as
        drawn here (the checkpoint's dtype, converted by the model), so a host-side peer of the
        same seed holds the engine's very tensors; elsewhere each is drawn there, in `dtype`,
        and nothing crosses the link."""
        if torch.device(device).type == "cpu":
            return self
        return DummyWeights(self.shapes, dtype, self.seed, device)

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        weight = torch.empty(shape, dtype=self.dtype, device=self.device)
        return weight.normal_(0.0, DUMMY_STD, generator=gen)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def __contains__(self, name: object) -> bool:
        return name in self.shapes
