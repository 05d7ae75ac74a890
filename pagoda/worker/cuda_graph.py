"""CUDA graphs for decode-only steps: captured once at start-up, replayed every step.

Captured at padded batch sizes (1, 2, 4, 8, then every 16 up to max_num_seqs) in one
memory pool, largest first so smaller graphs reuse its blocks. Inputs live in static
buffers; the attention backend keeps its metadata at fixed addresses
(init_cuda_graph_state / metadata_for_capture / prepare_replay). Each graph records
the backend's plan from metadata_for_capture (launches sized from capture-time values
only), so replay plans nothing; the KV pool's writes are recorded with it. Padding rows have
slot -1 and context length 0: they write no KV and every kernel skips them.
"""

from __future__ import annotations

import logging
import time

import torch

from pagoda.attention.backend import AttentionBackend, AttentionMetadata
from pagoda.attention.forward_context import forward_context
from pagoda.worker.kv_pool import KVCachePool
from pagoda.worker.shape_buckets import logits_row_buckets

logger = logging.getLogger(__name__)


def capture_sizes(max_batch_size: int) -> list[int]:
    """The LM head's row buckets up to max_batch_size (shape_buckets), then
    max_batch_size itself: the decode graphs and the LM head share their sizes."""
    sizes = [s for s in logits_row_buckets(max_batch_size) if s <= max_batch_size]
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend,
                 kv_pool: KVCachePool, max_batch_size: int, max_blocks_per_req: int,
                 device: torch.device) -> None:
        if not backend.supports_cuda_graphs():
            raise ValueError(f"attention backend {backend.name} does not support CUDA graphs")
        self.model, self.backend, self.kv_pool = model, backend, kv_pool
        self.device = device
        self.sizes = capture_sizes(max_batch_size)
        self.max_batch_size = self.sizes[-1]
        self.max_blocks_per_req = max_blocks_per_req
        self.input_ids = torch.zeros(self.max_batch_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_batch_size, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        self.backend.init_cuda_graph_state(self.max_batch_size, self.max_blocks_per_req,
                                           self.kv_pool.block_size, self.device)
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):
            metadata = self.backend.metadata_for_capture(bs)
            ids, pos = self.input_ids[:bs], self.positions[:bs]
            for _ in range(2):  # warm up: lazy caches, Triton compilation, cuBLAS handles
                with forward_context(self.backend, metadata, self.kv_pool):
                    self.model(ids, pos)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                with forward_context(self.backend, metadata, self.kv_pool):
                    self.outputs[bs] = self.model(ids, pos)
            self.graphs[bs] = graph
        # Replay each graph once: the first launch of an instantiated graph uploads it
        # to the device, which would otherwise land on the first real step of each size
        # (the suspect behind slow first steps per size on the H200: 27 ms for the
        # first batch-256 decode step against 15, 32 ms when the batch shrank). The
        # buffers still hold the capture metadata: slots -1 (no KV is written), and
        # one token of context in block 0 (only read).
        for bs in self.sizes:
            self.graphs[bs].replay()
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d CUDA graphs (batch sizes %s) in %.1fs", len(self.graphs),
                    self.sizes, self.capture_seconds)

    def takes(self, num_tokens: int, num_reqs: int) -> bool:
        """Whether a step of num_reqs requests and num_tokens rows fits a graph: decode
        only (one token per request), at most the largest captured batch."""
        return num_tokens == num_reqs and num_tokens <= self.max_batch_size

    def can_run(self, metadata: AttentionMetadata, num_tokens: int) -> bool:
        return (self.takes(num_tokens, metadata.num_reqs)
                and metadata.block_tables.shape[1] <= self.max_blocks_per_req)

    def padded_size(self, num_tokens: int) -> int:
        return next(s for s in self.sizes if s >= num_tokens)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        bs = self.padded_size(n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        if bs > n:
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
        self.backend.prepare_replay(metadata, bs)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
