"""The Triton MLA backend: latent rows through kernels/mla_decode.py, on the GPU.

Owns `MLATritonBackend`. Eager steps are planned as the reference plans them
(pagoda/attention/mla_backend.py: decodes on the latent path, prefill chunks
decompressed); the latent kernel's context slices are chosen on the host from the
step's host copies. Prefill chunks, all of them, run one launch of
kernels/mla_prefill.py in the model's dtype: it reads the layer's pieces in place
(queries through the prefill rows, k_nope and v as views of kv_b_proj's output, the
rope key once for every head) and writes the prefill rows of the layer's output. Its
tile table (tiles of BLOCK_M rows per chunk) is built here once per step, from the
plan's host-side chunk list, and copied to the device once. Head widths that are not
powers of two (no DeepSeek model has them) fall back to torch's SDPA per chunk.

CUDA graphs (decode graphs and mixed graphs, as the CudaGraphRunner captures them):
a plan without host copies sends every row of the step through the latent kernel,
which serves any query length (a row's context ends at its own position). The
metadata lives in buffers at fixed addresses: `init_cuda_graph_state` allocates them,
`metadata_for_capture` plans over views of them (slices chosen for the longest
context the block table holds), `prepare_replay` copies a real batch in and computes
each row's request and context length on the device. Padding rows get length 0:
the kernel writes zeros for them and the KV pool skips their slot -1. Sparse MLA's
graphs score each row's context up to its own length (read on the device) into a
buffer as wide as the longest context the block table holds, then select and attend
as eager steps do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.attention.backend import AttentionMetadata
from pagoda.attention.graph_buffers import (
    GraphBuffers,
    allocate_graph_buffers,
    capture_metadata,
    checked_graph_buffers,
    copy_batch_into_graph,
)
from pagoda.attention.mla_backend import MLAPlan, MLATorchBackend, plan_eager, sdpa_prefill
from pagoda.kernels.attention.dsa_config import DSAKernelConfig
from pagoda.kernels.attention.mla_config import MLAKernelConfig
from pagoda.kernels.launch.capability import sm_count
from pagoda.kernels.launch.host_copy import host_to_device

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class _MLAGraphBuffers(GraphBuffers):
    """The shared graph buffers plus each row's request and context length."""

    row_req: torch.Tensor  # int32 [rows]
    row_len: torch.Tensor  # int32 [rows]


def row_context(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_reqs: int, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, context length) of rows 0..num_rows-1, on the device, without a sync:
    row j of a request of query length q and seq_len s sees s - q + j + 1 tokens;
    rows past the last request's end get length 0."""
    device = query_start_loc.device
    rows = torch.arange(num_rows, dtype=torch.int32, device=device)
    ends = query_start_loc[1 : num_reqs + 1]
    req = torch.searchsorted(ends, rows, right=True).clamp_(max=num_reqs - 1)
    length = seq_lens[req] - (ends[req] - rows) + 1
    length = torch.where(rows < query_start_loc[num_reqs], length, 0).clamp_(min=0)
    return req.to(torch.int32), length.to(torch.int32)


@dataclass
class MLATritonPlan(MLAPlan):
    num_splits: int = 1
    min_split: int = 1  # the shortest slice (tokens) the latent kernel gives a program
    # The prefill kernel's tiles (kernels/mla_prefill.prefill_tile_table, int32
    # [num_tiles, 4] on the device) of at most prefill_tile_rows rows; None: no chunks.
    prefill_tiles: torch.Tensor | None = None
    prefill_tile_rows: int = 0


class MLATritonBackend(MLATorchBackend):
    name = "triton"
    uses_triton_kernels = True

    def __init__(
        self,
        num_heads: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        scale: float,
        *,
        num_decode_splits: int | None = None,
        config: MLAKernelConfig | None = None,
        latent_rows: str = "decode",
        dsa_config: DSAKernelConfig | None = None,
    ) -> None:
        """num_decode_splits fixes the latent kernel's context slices (tests, tuning);
        None chooses them per batch. config: the kernels' tiles on this backend's
        device (the selector builds it; None: MLAKernelConfig.for_device of the CPU,
        Hopper's tiles, as the interpreter tests run them). latent_rows: as the
        reference's ("all" for sparse MLA). dsa_config: the sparse-attention kernels' tiles
        (as config: default Hopper's)."""
        super().__init__(num_heads, kv_lora_rank, qk_rope_head_dim, scale, latent_rows)
        if num_decode_splits is not None and not 1 <= num_decode_splits <= 1024:
            raise ValueError(f"num_decode_splits must be in [1, 1024], got {num_decode_splits}")
        self.num_decode_splits = num_decode_splits
        self.config = config or MLAKernelConfig.for_device(torch.device("cpu"))
        self.dsa_config = dsa_config or DSAKernelConfig.for_device(torch.device("cpu"))
        # The same for every dtype (MLAKernelConfig): the plan tiles by it.
        self.prefill_tile_rows = self.config.prefill_tile_rows
        self._graph: _MLAGraphBuffers | None = None

    def build_metadata(self, common: AttentionMetadata) -> MLATritonPlan:
        if common.has_host_copies:
            plan = plan_eager(common, self.latent_rows)
            longest = plan.max_row_len
        else:  # graph mode: every row latent, launches sized from capture-time values
            req, length = row_context(
                common.query_start_loc,
                common.seq_lens,
                common.num_reqs,
                common.slot_mapping.shape[0],
            )
            longest = common.block_tables.shape[1] * common.block_size
            plan = MLAPlan(
                common, None, common.slot_mapping.shape[0], req, length, max_row_len=longest
            )
        return MLATritonPlan(
            **vars(plan), **self._split_plan(plan, longest), **self._prefill_plan(plan)
        )

    def _prefill_plan(self, plan: MLAPlan) -> dict:
        """The prefill kernel's tile table for the plan's chunks (host lists, one copy)."""
        from pagoda.kernels.attention.mla_prefill import prefill_tile_table  # Triton: CUDA only

        if not plan.prefill_chunks:
            return {}
        table = prefill_tile_table(
            [(c.row_start, c.row_end, c.ctx_start, c.ctx_end) for c in plan.prefill_chunks],
            self.prefill_tile_rows,
        )
        return {
            "prefill_tiles": host_to_device(table, torch.int32, plan.prefill_rows.device),
            "prefill_tile_rows": self.prefill_tile_rows,
        }

    def _split_plan(self, plan: MLAPlan, longest: int) -> dict:
        """num_splits and min_split of the latent kernel (a fixed split count spreads
        even short contexts over every slice)."""
        from pagoda.kernels.attention.paged_decode import (  # Triton: CUDA only
            choose_num_splits,
            min_split_tokens,
        )

        if self.num_decode_splits is not None:
            return {"num_splits": self.num_decode_splits, "min_split": 1}
        sms = self._sm_count(plan.common.query_start_loc.device)
        head_blocks = -(-self.num_heads // self.config.decode_tiles(torch.bfloat16).block_h)
        return {
            "num_splits": choose_num_splits(plan.num_latent_rows, head_blocks, longest, sms),
            "min_split": min_split_tokens(plan.num_latent_rows, head_blocks, sms),
        }

    def forward(
        self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: MLATritonPlan
    ) -> torch.Tensor:
        from pagoda.kernels.attention.mla_decode import mla_decode  # Triton: CUDA only

        if q.dtype not in _SUPPORTED_DTYPES or q.dtype != kv_cache.dtype:
            raise ValueError(
                f"q ({q.dtype}) and the latent cache ({kv_cache.dtype}) must share "
                f"one of float16, bfloat16, float32"
            )
        out = q.new_empty(q.shape[0], q.shape[1], self.kv_lora_rank)
        mla_decode(
            out,
            q,
            kv_cache,
            metadata.common.block_tables,
            metadata.row_req,
            metadata.row_len,
            self.scale,
            self.kv_lora_rank,
            metadata.num_splits,
            min_split_tokens=metadata.min_split,
            config=self.config,
        )
        return out

    def forward_sparse(
        self, q: torch.Tensor, kv_cache: torch.Tensor, positions: torch.Tensor, metadata: MLAPlan
    ) -> torch.Tensor:
        """As the reference's, with the Triton kernel (pagoda.kernels.attention.sparse_mla);
        a row reads at most row_len positions (a short row's list ends in -1s)."""
        from pagoda.kernels.attention.sparse_mla import sparse_latent_attention  # Triton

        return sparse_latent_attention(
            q,
            kv_cache,
            metadata.common.block_tables,
            metadata.row_req,
            positions,
            self.scale,
            self.kv_lora_rank,
            count=metadata.row_len,
            config=self.dsa_config,
        )

    def forward_prefill(
        self,
        out: torch.Tensor,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        k_nope: torch.Tensor,
        k_rope: torch.Tensor,
        v: torch.Tensor,
        metadata: MLATritonPlan,
    ) -> None:
        """As the reference's (MLATorchBackend.forward_prefill), in one kernel launch;
        head widths the kernel does not take (not powers of two) go through torch's
        scaled_dot_product_attention per chunk, in the model's dtype."""
        from pagoda.kernels.attention.mla_prefill import (  # Triton: CUDA only
            mla_prefill_attention,
            supports_widths,
        )

        if not supports_widths(q_nope.shape[-1], q_rope.shape[-1], v.shape[-1]):
            sdpa_prefill(out, q_nope, q_rope, k_nope, k_rope, v, metadata, self.scale, upcast=False)
            return
        mla_prefill_attention(
            out,
            q_nope,
            q_rope,
            k_nope,
            k_rope,
            v,
            metadata.prefill_rows,
            metadata.prefill_tiles,
            metadata.prefill_tile_rows,
            self.scale,
            config=self.config,
        )

    def _sm_count(self, device: torch.device) -> int:
        return sm_count(device)

    # ---- CUDA graphs -------------------------------------------------------------------

    def supports_cuda_graphs(self) -> bool:
        return True

    def init_cuda_graph_state(
        self,
        max_batch_size: int,
        max_blocks_per_req: int,
        block_size: int,
        device,
        max_num_tokens: int = 0,
    ) -> None:
        shared = allocate_graph_buffers(
            max_batch_size, max_blocks_per_req, block_size, device, max_num_tokens
        )
        rows = shared["slot_mapping"].shape[0]
        self._graph = _MLAGraphBuffers(
            **shared,
            row_req=torch.zeros(rows, dtype=torch.int32, device=device),
            row_len=torch.zeros(rows, dtype=torch.int32, device=device),
        )

    def metadata_for_capture(
        self, batch_size: int, num_tokens: int | None = None, max_context: int | None = None
    ) -> MLATritonPlan:
        if max_context is not None:  # short_context_graph is None: never asked
            raise ValueError("the MLA backend plans one decode graph for any context")
        g = checked_graph_buffers(self._graph, batch_size, num_tokens)
        rows = batch_size if num_tokens is None else num_tokens
        longest = g.block_tables.shape[1] * g.block_size
        plan = MLAPlan(
            capture_metadata(g, batch_size, num_tokens),
            None,
            rows,
            g.row_req[:rows],
            g.row_len[:rows],
            max_row_len=longest,
        )
        return MLATritonPlan(**vars(plan), **self._split_plan(plan, longest))

    def prepare_replay(
        self, metadata: AttentionMetadata, batch_size: int, num_tokens: int | None = None
    ) -> None:
        """Copies a real batch (num_reqs <= batch_size, at most the graph's rows) into
        the buffers and computes each row's request and context length."""
        g = checked_graph_buffers(self._graph, batch_size, num_tokens)
        copy_batch_into_graph(g, metadata, batch_size, num_tokens)
        rows = batch_size if num_tokens is None else num_tokens
        req, length = row_context(
            metadata.query_start_loc, metadata.seq_lens, metadata.num_reqs, rows
        )
        g.row_req[:rows].copy_(req)
        g.row_len[:rows].copy_(length)
