"""The Triton attention backend: paged attention over a full-attention cache, on the GPU.

Owns `TritonBackend`. Once per step, `build_metadata` plans the launches (a
TritonMetadata): how many requests are decodes, the decode kernel's number of context
slices (chosen on the host from the batch's host copies, metadata.query_start_loc_cpu /
seq_lens_cpu / max_seq_len, without a device sync) and whether padding rows of the
output are zeroed. Per layer, after the KV pool has stored the step's k/v:
1. requests with more than one query row (prefill chunks, spec-decode verification)
   go through the chunk kernel, grid (query tiles, kv heads);
2. requests with one query row (decodes) go through the split-K decode kernel and its
   merge.
An FP8 cache (kv_cache_dtype fp8) is read by the same kernels with the layer's
kv_scales (attention/kv_quant.py); q and the output stay in the model's dtype. A
sliding-window layer passes its window, which both kernels take per launch (the plan
is the same for every layer: decode slices split the window instead of the context).
A layer with attention sinks passes them the same way (float32 [num_heads]); the
decode merge counts each head's sink once whatever the number of slices.

CUDA graphs: decode graphs (one query row per request) and mixed graphs (a fixed
number of rows over up to a fixed number of requests of any query lengths: small
prefills, prefill chunks beside decodes). `init_cuda_graph_state` allocates metadata
buffers of the largest size; `metadata_for_capture(bs[, num_tokens])` plans over views
of them with no host copies (query_start_loc_cpu / seq_lens_cpu = None). A plan built without host copies
sizes its launches from fixed values only: the number of slices is chosen for the
longest context the block table can hold, and the kernels read the real lengths from
the tensors, so programs past a request's end exit at once. `prepare_replay`
copies a real batch into the buffers; requests past num_reqs get query length 0 and
are skipped. Output rows of padding tokens are left unwritten in graph mode (eager
mode zeroes them, as torch_ref does). At small batches a second decode graph is planned
for steps whose contexts are all short (`short_context_graph`: fewer slices, as
paged_decode.short_context_splits says); the graph runner picks it by the step's
longest context.

The decode kernels' tiles and the short-context plan come from the backend's
DecodeAttentionConfig (pagoda.kernels.attention.decode_config), built for its device
by the selector and passed to every decode launch.

The kernels are imported on first use, so importing this module needs no GPU and
does not fix TRITON_INTERPRET for the process.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pagoda.attention.backend import AttentionBackend, AttentionMetadata, BackendMetadata
from pagoda.attention.graph_buffers import (
    GraphBuffers,
    allocate_graph_buffers,
    capture_metadata,
    checked_graph_buffers,
    copy_batch_into_graph,
)
from pagoda.kernels.attention.decode_config import DecodeAttentionConfig
from pagoda.kernels.launch.capability import sm_count

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class TritonMetadata(BackendMetadata):
    """The step's launch plan, shared by every layer."""

    num_decodes: int  # requests with one query row (an upper bound without host copies)
    num_splits: int  # context slices of the decode kernel
    zero_padding_rows: bool
    min_split: int  # the shortest slice (tokens) the decode kernel gives a program


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        *,
        num_decode_splits: int | None = None,
        config: DecodeAttentionConfig | None = None,
    ) -> None:
        """num_decode_splits fixes the decode kernel's context slices (tests, tuning);
        None chooses them per batch. config: the decode kernels' tiles and graph plan
        on this backend's device (the selector builds it; None: for_device of the first
        step's device)."""
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        if head_dim < 16 or head_dim & (head_dim - 1):
            raise ValueError(
                f"head_dim must be a power of two >= 16 for the Triton kernels, got {head_dim}"
            )
        if num_decode_splits is not None and not 1 <= num_decode_splits <= 1024:
            raise ValueError(f"num_decode_splits must be in [1, 1024], got {num_decode_splits}")
        self.num_decode_splits = num_decode_splits
        self.config = config
        self._graph: GraphBuffers | None = None

    def decode_config(self, device: torch.device) -> DecodeAttentionConfig:
        """The backend's DecodeAttentionConfig (built for device when none was given)."""
        if self.config is None:
            self.config = DecodeAttentionConfig.for_device(device)
        return self.config

    def build_metadata(self, common: AttentionMetadata) -> TritonMetadata:
        from pagoda.kernels.attention.paged_decode import (  # Triton: CUDA only
            choose_num_splits,
            min_split_tokens,
        )

        if common.has_host_copies:
            if common.max_query_len == 1:
                num_decodes = common.num_reqs
            else:
                qsl = common.query_start_loc_cpu[: common.num_reqs + 1]
                num_decodes = int(((qsl[1:] - qsl[:-1]) == 1).sum())
            longest = common.max_seq_len
        else:  # graph mode: only values fixed at capture may size the launch
            num_decodes = common.num_reqs
            longest = common.block_tables.shape[1] * common.block_size
        if self.num_decode_splits is not None:
            # A fixed split count spreads even short contexts over every slice.
            num_splits, min_split = self.num_decode_splits, 1
        else:
            sms = self._sm_count(common.query_start_loc.device)
            num_splits = choose_num_splits(num_decodes, self.num_kv_heads, longest, sms)
            min_split = min_split_tokens(num_decodes, self.num_kv_heads, sms)
        return TritonMetadata(
            common,
            num_decodes,
            num_splits,
            zero_padding_rows=common.has_host_copies,
            min_split=min_split,
        )

    def forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonMetadata,
        out: torch.Tensor | None = None,
        kv_scales: torch.Tensor | None = None,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As AttentionBackend.forward; `out` ([T, H, D] like q) receives the result if given."""
        from pagoda.kernels.attention.paged_attention import (
            paged_attention_chunks,  # Triton: CUDA only
        )
        from pagoda.kernels.attention.paged_decode import paged_attention_decode

        self._check_inputs(q, kv_cache, out)
        common = metadata.common
        if out is None:
            out = torch.empty_like(q)
        if metadata.zero_padding_rows and out.shape[0] > common.num_actual_tokens:
            out[common.num_actual_tokens :].zero_()
        if common.max_query_len > 1:
            paged_attention_chunks(
                out,
                q,
                kv_cache,
                common.block_tables,
                common.query_start_loc,
                common.seq_lens,
                common.num_reqs,
                common.num_actual_tokens,
                self.scale,
                skip_single_token=metadata.num_decodes > 0,
                kv_scales=kv_scales,
                sliding_window=sliding_window,
                sinks=sinks,
            )
        if metadata.num_decodes > 0:
            paged_attention_decode(
                out,
                q,
                kv_cache,
                common.block_tables,
                common.query_start_loc,
                common.seq_lens,
                common.num_reqs,
                self.scale,
                metadata.num_splits,
                min_split_tokens=metadata.min_split,
                config=self.decode_config(q.device),
                kv_scales=kv_scales,
                sliding_window=sliding_window,
                sinks=sinks,
            )
        return out

    def _check_inputs(
        self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor | None
    ) -> None:
        if q.dim() != 3 or q.shape[1:] != (self.num_heads, self.head_dim):
            raise ValueError(
                f"q must be [num_tokens, {self.num_heads}, {self.head_dim}], got {tuple(q.shape)}"
            )
        if q.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"q dtype {q.dtype} is not supported (float16, bfloat16, float32)")
        if kv_cache.dtype != q.dtype and kv_cache.dtype != torch.float8_e4m3fn:
            raise ValueError(
                f"kv_cache dtype {kv_cache.dtype} must equal q dtype {q.dtype} "
                f"(or be float8_e4m3fn: an FP8 cache)"
            )
        if q.stride(2) != 1:
            raise ValueError("q needs a contiguous last (head_dim) dimension")
        if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1):
            raise ValueError(
                f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dimension"
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
        self._graph = GraphBuffers(
            **allocate_graph_buffers(
                max_batch_size, max_blocks_per_req, block_size, device, max_num_tokens
            )
        )

    def metadata_for_capture(
        self, batch_size: int, num_tokens: int | None = None, max_context: int | None = None
    ) -> TritonMetadata:
        """Metadata over the persistent buffers, planned from capture-time values only (no
        host copies). Decode graph (num_tokens None): one query row per request. Mixed
        graph: num_tokens rows over batch_size requests; the chunk kernel's grid covers
        num_tokens rows (requests read their real query lengths on the device) and the
        decode kernel serves the requests whose query length is 1. max_context (decode
        graphs, short_context_graph's bound): the decode kernel's short-context slices."""
        g = checked_graph_buffers(self._graph, batch_size, num_tokens)
        metadata = self.build_metadata(capture_metadata(g, batch_size, num_tokens))
        if max_context is None:
            return metadata
        splits = self._short_context_splits(batch_size)
        short_tokens = self.decode_config(g.block_tables.device).short_context_tokens
        if num_tokens is not None or splits is None or max_context != short_tokens:
            raise ValueError(
                f"no short-context decode graph of {batch_size} requests "
                f"(rows {num_tokens}) for contexts up to {max_context}"
            )
        return replace(metadata, num_splits=splits)

    def short_context_graph(self, batch_size: int) -> int | None:
        """The config's short_context_tokens where its plan has fewer slices than the
        graph for the block table's longest context (small batches)."""
        if self._short_context_splits(batch_size) is None:
            return None
        return self.decode_config(self._graph.block_tables.device).short_context_tokens

    def _short_context_splits(self, batch_size: int) -> int | None:
        from pagoda.kernels.attention.paged_decode import short_context_splits  # Triton: CUDA only

        if self._graph is None or self.num_decode_splits is not None:
            return None
        device = self._graph.block_tables.device
        longest = self._graph.block_tables.shape[1] * self._graph.block_size
        return short_context_splits(
            batch_size,
            self.num_kv_heads,
            longest,
            self._sm_count(device),
            self.decode_config(device),
        )

    def prepare_replay(
        self, metadata: AttentionMetadata, batch_size: int, num_tokens: int | None = None
    ) -> None:
        """Copies a real batch (num_reqs <= batch_size; decode-only for a decode graph,
        at most num_tokens rows for a mixed one) into the buffers."""
        g = checked_graph_buffers(self._graph, batch_size, num_tokens)
        copy_batch_into_graph(g, metadata, batch_size, num_tokens)
