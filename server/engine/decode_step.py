"""One decode step of the running batch: a CUDA graph replay where one fits, else eager.

Each request of the step gets its next KV slot and contributes its last token. On CUDA with
graphs on (`EngineConfig.use_cuda_graphs`), `cuda_graphs.DecodeGraphs` replays the graph of the
step's bucket; steps it declines (a batch above the largest bucket, an adapter still loading)
and every step on a CPU build a `ForwardBatch` and a `LoraBatch` and run the model eagerly.
"""

from __future__ import annotations

import torch

from toppings.server.config import EngineConfig
from toppings.server.engine.adapters import AdapterManager
from toppings.server.memory.kv_cache import KVPool
from toppings.server.model.graph_buckets import GraphBuckets
from toppings.server.model.llama import ForwardBatch, LlamaModel


class DecodeStep:
    """The decode forward of one engine (graphs: None where they are off or not CUDA)."""

    def __init__(self, model: LlamaModel, kv: KVPool, lora: AdapterManager, graphs=None):
        self.model, self.kv, self.lora, self.graphs = model, kv, lora, graphs

    @classmethod
    def create(
        cls, config: EngineConfig, model: LlamaModel, kv: KVPool, lora: AdapterManager
    ) -> DecodeStep:
        graphs = None
        if config.use_cuda_graphs:
            from toppings.server.model.cuda_graphs import DecodeGraphs  # the device module

            buckets = GraphBuckets.for_engine(config.max_batch_size, kv.max_len)
            graphs = DecodeGraphs(model, kv, lora.pool, lora.kernels.decode, buckets)
        return cls(model, kv, lora, graphs)

    def forward(self, seqs: list) -> torch.Tensor:
        """Logits [B, V] float32 of the next token of each `server.sequence.Sequence`, in order
        (adapters side by side, as the engine sorts them); takes each one's next KV slot."""
        kv = self.kv
        rows = [s.kv_hold.row for s in seqs]
        positions = [kv.lengths[r] for r in rows]
        slots = kv.extend_each(rows)  # [B] int64; also written into req_to_slot
        ids = [s.output_ids[-1] for s in seqs]
        entries = [s.cache_entry for s in seqs]
        if self.graphs is not None:
            adapters = [e.resident if e else None for e in entries]
            loading = any(e is not None and not e.ticket.done for e in entries)
            logits = self.graphs.run(rows, ids, positions, adapters, loading)
            if logits is not None:
                return logits
        seg_starts = list(range(len(seqs) + 1))
        index, lengths = kv.decode_index(rows)  # [B, Lmax], [B]
        device = self.model.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            slots=slots,
            seg_starts=seg_starts,
            is_prefill=False,
            kv_index=index,
            kv_lengths=lengths,
            lora=self.lora.step(entries, seg_starts, is_prefill=False),
        )
        return self.model.forward(batch, kv)  # [B, V]
