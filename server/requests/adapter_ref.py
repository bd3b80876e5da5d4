"""An adapter as the layers below the HTTP API know it: a typed reference with an id.

The API resolves the name a client gives (`model`, `adapter`) once, into the `AdapterRef` of
the adapter registered under that name now (SGLang's `LoRARef`, vLLM's `lora_int_id`); the
request carries the reference, and the scheduler, the engine, the memory manager and the prefix
tree key on it. A reference compares, hashes and orders by its id alone, so a dict keyed by
references is keyed by ids. Ids are never reused within a process: an adapter unloaded and
loaded again under the same name gets a new id, so nothing keyed by the old one (cached KV, an
in-flight count) can ever be taken for the new one. Names stay what users see.

The same weights registered under several names (one directory loaded as `a` and as `b`) are
one copy on the device as on the host: each name's reference keeps its own id (its KV, its
in-flight count, its activated-LoRA invocation are its own) and carries the `weights_id` under
which the device adapter cache holds the rows it computes with: the id of the first name that
registered those weights, for as long as any name holds them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

_ids = itertools.count(1)


@dataclass(frozen=True, order=True)
class AdapterRef:
    """One registration of an adapter: `id` unique in the process, the `name` it was registered
    under, its `rank` (the largest over its projections), `nbytes`, what it is charged in the
    device adapter memory while resident, and `weights_id`, the key of its rows in the device
    adapter cache (its own id unless another name registered the same weights first)."""

    id: int
    name: str = field(compare=False)
    rank: int = field(compare=False)
    nbytes: int = field(compare=False)
    weights_id: int = field(compare=False, default=0)

    def __post_init__(self) -> None:
        if not self.weights_id:
            object.__setattr__(self, "weights_id", self.id)

    @classmethod
    def new(cls, name: str, rank: int, nbytes: int, weights_id: int = 0) -> AdapterRef:
        """A reference with an id no other reference of this process has had; its rows are
        those of `weights_id` (0: its own)."""
        return cls(next(_ids), name, rank, nbytes, weights_id)
