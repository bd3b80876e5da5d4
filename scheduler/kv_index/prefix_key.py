"""A request's prompt as the KV blocks a server will announce for it: the token ids the server
will compute under one adapter (or the base model), hashed block by block with
`prompt_hashes`, the rule the servers hash by (server/kv_events/block_hash.py).

An activated LoRA's blocks before its invocation are the base model's on a server (its prefix
tree keeps them under the base model, and announces them so), and its blocks from the one that
holds the invocation on are never cached: its key is the prompt up to the last occurrence of
the invocation sequence (found by the server's own function, gpu_lora/alora.py, which imports
nothing), under no adapter. A request that names an adapter otherwise hashes
under the adapter's name, the base model under none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from toppings.gpu_lora.alora import activation_start
from toppings.server.kv_events.block_hash import prompt_hashes


@dataclass(frozen=True)
class PrefixKey:
    """The tokens a server may hold KV for, and the adapter name their hashes are salted by."""

    token_ids: tuple[int, ...]
    adapter: str | None
    _hashes: dict[int, list[int]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(
        cls, prompt_ids: Sequence[int], adapter: str | None, invocation: Sequence[int] = ()
    ) -> PrefixKey | None:
        """The key of a prompt for `adapter` (None: the base model) whose activated-LoRA
        invocation sequence is `invocation` (empty: a plain adapter); None when an activated
        adapter's prompt lacks its invocation (the server refuses it)."""
        # The server matches at most (len - 1) // block tokens blocks: the last token is
        # always computed. Dropping it here keeps every block the key hashes matchable.
        ids = tuple(prompt_ids[:-1])
        if invocation:
            start = activation_start(prompt_ids, invocation)
            if start is None:
                return None
            return cls(tuple(prompt_ids[:start]), None)
        return cls(ids, adapter)

    def hashes(self, block_size: int) -> list[int]:
        """The hashes of the key's full blocks of `block_size` tokens, first block first
        (computed once per block size)."""
        found = self._hashes.get(block_size)
        if found is None:
            found = self._hashes[block_size] = prompt_hashes(
                self.token_ids, block_size, self.adapter
            )
        return found
