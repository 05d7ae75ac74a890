"""AttentionBackend ABC and the metadata every backend reads.

Per step: the runner builds the common AttentionMetadata (attention/metadata.py), then
calls ``backend.build_metadata(common)`` exactly once; the result (a BackendMetadata:
the common metadata plus the backend's plan for the step) goes into the forward
context and every layer reads it, so no layer re-plans. Per layer, the Attention layer
first asks the KV pool (worker/kv_pool.py) to store its k/v, then calls
``backend.forward(q, kv_cache, metadata)`` on that layer's cache: backends never write
K/V.

Layout contract (all backends):
- The batch is flattened: tokens of request i occupy rows
  query_start_loc[i] : query_start_loc[i + 1] of q/k/v (num_tokens rows in all, maybe
  followed by padding rows when a CUDA graph runs at a padded size).
- A full-attention layer's cache (core/kv_cache_spec.py FullAttentionSpec) is one tensor
  [2, num_blocks, block_size, num_kv_heads, head_dim] (index 0 = K, 1 = V). Token t of request i lives in block
  block_tables[i, t // block_size] at offset t % block_size.
- slot_mapping[j] = block_id * block_size + offset for query row j; -1 marks a padding
  row whose K/V must not be written.
- Request i has seq_lens[i] tokens of context after this step; its query rows are the
  last query_lens[i] of them (context_lens[i] = seq_lens[i] - query_lens[i] tokens are
  already in the cache: earlier chunks, earlier decodes or prefix-cache hits).
- Attention is causal: query row for position p attends to positions 0..p; with a
  layer's sliding window W (``forward(..., sliding_window=W)``, a per-layer value the
  Attention layer passes on every call; None: full attention) only to positions
  p - W + 1..p (transformers' sliding_window: W keys, the query's own included). The
  cache still holds every position; a windowed layer simply reads fewer of them.
- Attention sinks (``forward(..., sinks=s)``, float32 [num_heads] on the device, a
  per-layer value passed like the window; None: none): head h's softmax denominator
  gets one more term exp(s[h]) with no value (gpt-oss), so a row's weights over its
  keys sum to less than 1.
- An FP8 cache (float8_e4m3fn, kv_cache_dtype fp8) holds entries divided by the layer's
  scales: ``forward`` then gets ``kv_scales`` (float32 [k_scale, v_scale] on the
  device) and reads K as stored * k_scale, V as stored * v_scale (attention/kv_quant.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], on device
    seq_lens: torch.Tensor  # int32 [num_reqs], on device
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks_per_req], on device
    slot_mapping: torch.Tensor  # int64 [num_tokens (padded)], on device; -1 = padding
    max_query_len: int
    max_seq_len: int
    block_size: int  # tokens per KV block, shared by every layer
    # Host copies, for backends that loop or size launches on the host. Present on an
    # eager step (build_attention_metadata), whose first num_actual_tokens slots are all
    # real; absent on CUDA-graph buffers, where padding requests (slot -1) may sit among
    # them.
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @property
    def has_host_copies(self) -> bool:
        return self.query_start_loc_cpu is not None and self.seq_lens_cpu is not None


@dataclass
class BackendMetadata:
    """What a backend plans once per step from the common metadata; backends extend it
    with their plan (launch sizes, gather indices) and every layer of the step reads it."""

    common: AttentionMetadata


class AttentionBackend(ABC):
    """A way to run paged attention. One instance serves every layer of a model."""

    name: str = "abstract"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @abstractmethod
    def build_metadata(self, common: AttentionMetadata) -> BackendMetadata:
        """The step's plan, built once per step before the first layer runs."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # this layer's cache, k/v of this step already stored
        metadata: BackendMetadata,  # from build_metadata / metadata_for_capture
        kv_scales: torch.Tensor | None = None,  # an FP8 cache's [k_scale, v_scale]
        sliding_window: int | None = None,  # this layer's window (None: full attention)
        sinks: torch.Tensor | None = None,  # float32 [num_heads] sink logits (None: none)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attends q to each request's context in kv_cache (its whole context, or the
        last sliding_window keys up to each row's position), with each head's sink logit
        in the softmax denominator when sinks is given."""

    # CUDA graph hooks. A backend that supports capture keeps its metadata tensors at
    # fixed addresses; capture/replay copy fresh values into them.
    def supports_cuda_graphs(self) -> bool:
        return False

    def init_cuda_graph_state(
        self,
        max_batch_size: int,
        max_blocks_per_req: int,
        block_size: int,
        device,
        max_num_tokens: int = 0,
    ) -> None:
        """Buffers for graphs of up to max_batch_size requests and max(max_batch_size,
        max_num_tokens) query rows."""
        raise NotImplementedError(f"{self.name} does not support CUDA graphs")

    def metadata_for_capture(
        self, batch_size: int, num_tokens: int | None = None, max_context: int | None = None
    ) -> BackendMetadata:
        """The plan a graph is captured with: launches sized from capture-time values only.
        num_tokens None: a decode graph (one query row per request); else a mixed graph
        of num_tokens rows over up to batch_size requests of any query lengths.
        max_context: a decode graph for steps whose contexts are all at most this long
        (the value short_context_graph gave); None: any context the block table holds."""
        raise NotImplementedError(f"{self.name} does not support CUDA graphs")

    def short_context_graph(self, batch_size: int) -> int | None:
        """The context bound of a second decode graph of batch_size requests worth
        capturing beside the one for any context (planned differently for short
        contexts), or None: one graph. Asked after init_cuda_graph_state."""
        return None

    def prepare_replay(
        self, metadata: AttentionMetadata, batch_size: int, num_tokens: int | None = None
    ) -> None:
        """Copies a real batch into the buffers of the graph (batch_size, num_tokens)."""
        raise NotImplementedError(f"{self.name} does not support CUDA graphs")
