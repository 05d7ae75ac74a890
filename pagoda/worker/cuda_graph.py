"""CUDA graphs for steps: captured once at start-up, replayed every step.

Two kinds, in one memory pool, largest first so smaller graphs reuse its blocks:
- decode graphs, at padded batch sizes (the LM head's row buckets up to max_num_seqs):
  one query row per request, the split-K decode kernel only; where the backend asks
  (short_context_graph: small batches), a second one of the size planned for steps
  whose contexts are all short (fewer context slices), replayed when the step's
  longest context fits;
- mixed graphs, at padded row counts (MIXED_GRAPH_TOKENS up to the step's token
  budget), each over up to min(rows, max_num_seqs) requests of any query lengths:
  small prefills and prefill chunks beside decodes. An eager forward of such a step
  costs far more host time launching its kernels than the device spends running them,
  which is what a short prompt's time to first token pays.
Inputs live in static buffers; the attention backend keeps its metadata at fixed
addresses (init_cuda_graph_state / metadata_for_capture / prepare_replay). Each graph
records the backend's plan from metadata_for_capture (launches sized from capture-time
values only), so replay plans nothing; the KV pool's writes are recorded with it.
Padding rows have slot -1 and padding requests query length 0: they write no KV and
every kernel skips them; every other layer works row by row, so padding rows do not
touch the real ones.
"""

from __future__ import annotations

import logging
import time

import torch

from pagoda.attention.backend import AttentionBackend, AttentionMetadata
from pagoda.attention.forward_context import forward_context
from pagoda.attention.kv_pool import KVCachePool
from pagoda.progress import progress
from pagoda.worker.shape_buckets import logits_row_buckets

logger = logging.getLogger(__name__)


def capture_sizes(max_batch_size: int) -> list[int]:
    """The LM head's row buckets up to max_batch_size (shape_buckets), then
    max_batch_size itself: the decode graphs and the LM head share their sizes."""
    sizes = [s for s in logits_row_buckets(max_batch_size) if s <= max_batch_size]
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


# Row counts of the mixed graphs (capped by the step's token budget).
MIXED_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512)

# (requests, rows, context bound): rows None for a decode graph; the bound (decode
# graphs only) None for the graph of any context.
GraphKey = tuple[int, int | None, int | None]


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        kv_pool: KVCachePool,
        max_batch_size: int,
        max_blocks_per_req: int,
        device: torch.device,
        max_num_tokens: int = 0,
    ) -> None:
        """max_num_tokens: the step's token budget; mixed graphs are captured for the
        MIXED_GRAPH_TOKENS up to it (0: decode graphs only)."""
        if not backend.supports_cuda_graphs():
            raise ValueError(f"attention backend {backend.name} does not support CUDA graphs")
        self.model, self.backend, self.kv_pool = model, backend, kv_pool
        self.device = device
        self.sizes = capture_sizes(max_batch_size)
        self.max_batch_size = self.sizes[-1]
        self.mixed_sizes = [t for t in MIXED_GRAPH_TOKENS if t <= max_num_tokens]
        self.max_mixed_tokens = max(self.mixed_sizes, default=0)
        self.max_blocks_per_req = max_blocks_per_req
        rows = max(self.max_batch_size, self.max_mixed_tokens)
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.short_bounds: dict[int, int] = {}  # batch size -> its short graph's bound

    def _keys(self) -> list[GraphKey]:
        """Every graph to capture, the largest (in rows) first."""
        keys = [(bs, None, None) for bs in self.sizes]
        keys += [
            (bs, None, bound)
            for bs in self.sizes
            if (bound := self.backend.short_context_graph(bs)) is not None
        ]
        keys += [(min(t, self.max_batch_size), t, None) for t in self.mixed_sizes]
        return sorted(
            keys, key=lambda k: (k[1] or k[0], k[1] is not None, k[2] is None), reverse=True
        )

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        self.backend.init_cuda_graph_state(
            self.max_batch_size,
            self.max_blocks_per_req,
            self.kv_pool.block_size,
            self.device,
            max_num_tokens=self.max_mixed_tokens,
        )
        pool = torch.cuda.graph_pool_handle()
        keys = self._keys()
        self.short_bounds = {bs: bound for bs, rows, bound in keys if bound is not None}
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        for key in progress(keys, "capturing CUDA graphs", len(keys), "graph", rank):
            num_reqs, num_tokens, bound = key
            metadata = self.backend.metadata_for_capture(num_reqs, num_tokens, bound)
            rows = num_tokens or num_reqs
            ids, pos = self.input_ids[:rows], self.positions[:rows]
            for _ in range(2):  # warm up: lazy caches, Triton compilation, cuBLAS handles
                with forward_context(self.backend, metadata, self.kv_pool):
                    self.model(ids, pos)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                with forward_context(self.backend, metadata, self.kv_pool):
                    self.outputs[key] = self.model(ids, pos)
            self.graphs[key] = graph
        # Replay each graph once: the first launch of an instantiated graph uploads it
        # to the device, which would otherwise land on the first real step of each size.
        # The buffers still hold the capture metadata: slots -1 (no KV is written), and
        # at most one token of context in block 0 (only read).
        for graph in self.graphs.values():
            graph.replay()
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info(
            "captured %d CUDA graphs (decode batch sizes %s, of which %s also for short "
            "contexts; mixed-step rows %s) in %.1fs",
            len(self.graphs),
            self.sizes,
            sorted(self.short_bounds),
            self.mixed_sizes,
            self.capture_seconds,
        )

    def graph_for(
        self, num_tokens: int, num_reqs: int, longest_context: int | None = None
    ) -> GraphKey | None:
        """The graph a step of num_reqs requests and num_tokens rows replays, if any: a
        decode graph for a decode-only step (its short-context one where the step's
        longest context is known and fits), else the smallest mixed graph that fits."""
        if num_tokens == num_reqs and num_tokens <= self.max_batch_size:
            bs = next(s for s in self.sizes if s >= num_tokens)
            bound = self.short_bounds.get(bs)
            if bound is not None and longest_context is not None and longest_context <= bound:
                return bs, None, bound
            return bs, None, None
        if num_tokens <= self.max_mixed_tokens:
            rows = next(t for t in self.mixed_sizes if t >= num_tokens)
            return min(rows, self.max_batch_size), rows, None
        return None

    def takes(self, num_tokens: int, num_reqs: int) -> bool:
        return self.graph_for(num_tokens, num_reqs) is not None

    def can_run(self, metadata: AttentionMetadata, num_tokens: int) -> bool:
        return (
            self.takes(num_tokens, metadata.num_reqs)
            and metadata.block_tables.shape[1] <= self.max_blocks_per_req
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Replays the step's graph over these inputs: its hidden states [n, hidden]."""
        return self.replay(self.stage(positions, metadata, input_ids), positions.shape[0])

    def stage(
        self,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        input_ids: torch.Tensor | None = None,
    ) -> GraphKey:
        """Copies a step's positions, attention metadata and (if given) token ids into
        the static buffers of its graph (the caller checked can_run); returns the graph's
        key for replay."""
        n = positions.shape[0]
        key = self.graph_for(n, metadata.num_reqs, metadata.max_seq_len)
        rows = key[1] or key[0]
        if input_ids is not None:
            self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        if rows > n:
            self.input_ids[n:rows].zero_()
            self.positions[n:rows].zero_()
        self.backend.prepare_replay(metadata, key[0], key[1])
        return key

    def replay(self, key: GraphKey, n: int, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replays the staged graph key (first copying in the token ids, if given): the
        hidden states of its first n rows."""
        if input_ids is not None:
            self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.graphs[key].replay()
        return self.outputs[key][:n]
