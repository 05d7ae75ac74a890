"""KVCachePool: every attention layer's KV storage, allocated from the layers' specs, and
the writes into it.

The layers' specs (pagoda/core/kv_cache_spec.py) say what each layer keeps per token;
a KVLayout per spec kind says how that is held in memory and written. The pool
allocates layer i's storage from spec i (zero-initialised: a masked-out slot must
never hold NaN/Inf, since 0 * NaN poisons a sum) and checks it takes exactly the bytes
the spec sized it at, so the start-up sizing and the allocation cannot drift apart.

Per layer and step, the Attention layer calls ``pool.store(layer_idx, metadata, ...)``
with what that layer's kind stores (full attention: k and v; MLA: one latent row per
token), then the backend attends to ``pool.cache(layer_idx)``. Layouts are looked up by the spec's exact class: a
subclass is a different kind and needs its own layout.

Full attention keeps the layout [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 = K, 1 = V), in the model's dtype or in float8 e4m3 (kv_cache_dtype fp8:
entries divided by the layer's K / V scale on the way in, attention/kv_quant.py; the
layer passes its scales with every store). Its writes: on CUDA the Triton kernel (kernels/store_kv.py),
which skips padding rows (slot -1) on the device; on CPU an index_copy of the first
num_actual_tokens rows, which on an eager step are all real (padding rows exist only
for CUDA-graph buffers and padded CUDA steps; graph-mode metadata, without host copies,
is filtered by slot).

MLA keeps [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]: one latent entry
per token, written by the Triton kernel kernels/mla_store.py on CUDA (padding rows
skipped on the device), by index_copy on CPU, under the same rules. A sparse-attention
indexer's keys ([num_blocks, block_size, head_dim], one row per token) are held and
written the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

import torch

from pagoda.attention.backend import AttentionMetadata
from pagoda.attention.kv_quant import as_bits, check_scales, is_fp8, quantize_kv
from pagoda.core.kv_cache_spec import (
    FullAttentionSpec,
    IndexerKeySpec,
    KVCacheConfig,
    KVCacheSpec,
    MLAAttentionSpec,
)


class KVLayout(ABC):
    """How one kind of KV cache spec is held in memory and written."""

    @abstractmethod
    def allocate(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> torch.Tensor:
        """Zeroed storage for num_blocks blocks of one layer."""

    @abstractmethod
    def store(
        self,
        cache: torch.Tensor,
        metadata: AttentionMetadata,
        *entries: torch.Tensor,
        scales: torch.Tensor | None = None,
    ) -> None:
        """Writes this step's rows of entries into cache at metadata.slot_mapping
        (scales: the layer's [k_scale, v_scale], for an FP8 cache)."""


def store_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scales: torch.Tensor | None = None,
) -> None:
    """Writes the step's real k/v rows into a full-attention cache with index_copy
    (an FP8 cache: quantized with scales, copied as bytes)."""
    n = metadata.num_actual_tokens
    slots = metadata.slot_mapping[:n]
    if k.shape[0] != n:
        k, v = k[:n], v[:n]
    if not metadata.has_host_copies:  # graph buffers: padding requests among the rows
        real = slots >= 0
        slots, k, v = slots[real], k[real], v[real]
    if is_fp8(kv_cache.dtype):
        k, v = quantize_kv(k, scales[0]), quantize_kv(v, scales[1])
    elif k.dtype != kv_cache.dtype:
        k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    flat = as_bits(kv_cache).view(2, -1, *kv_cache.shape[3:])
    flat[0].index_copy_(0, slots, as_bits(k))
    flat[1].index_copy_(0, slots, as_bits(v))


class FullAttentionLayout(KVLayout):
    """Storage [2, num_blocks, block_size, num_kv_heads, head_dim]; stores (k, v).
    use_triton: write with the Triton kernel (CUDA, or the interpreter in tests)."""

    def __init__(self, use_triton: bool) -> None:
        self.use_triton = use_triton
        if use_triton:  # imported here, not at module level: the CPU path needs no Triton
            from pagoda.kernels.attention.store_kv import store_kv  # Triton: CUDA only

            self._store_kv_triton = store_kv

    def allocate(
        self, spec: FullAttentionSpec, num_blocks: int, device: torch.device
    ) -> torch.Tensor:
        return torch.zeros(
            2,
            num_blocks,
            spec.block_size,
            spec.num_kv_heads,
            spec.head_dim,
            dtype=getattr(torch, spec.dtype),
            device=device,
        )

    def store(
        self,
        cache: torch.Tensor,
        metadata: AttentionMetadata,
        *entries: torch.Tensor,
        scales: torch.Tensor | None = None,
    ) -> None:
        k, v = entries
        if is_fp8(cache.dtype):
            check_scales(scales, cache)
        if self.use_triton:
            self._store_kv_triton(k, v, cache, metadata.slot_mapping, scales)
        else:
            store_kv_torch(k, v, cache, metadata, scales)


class MLALatentLayout(KVLayout):
    """Storage [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]; stores one
    latent row per token. use_triton: write with kernels/mla_store.py."""

    def __init__(self, use_triton: bool) -> None:
        self.use_triton = use_triton
        if use_triton:
            from pagoda.kernels.attention.mla_store import store_latent  # Triton: CUDA only

            self._store_triton = store_latent

    def allocate(
        self, spec: MLAAttentionSpec, num_blocks: int, device: torch.device
    ) -> torch.Tensor:
        return torch.zeros(
            num_blocks,
            spec.block_size,
            spec.entry_size,
            dtype=getattr(torch, spec.dtype),
            device=device,
        )

    def store(
        self,
        cache: torch.Tensor,
        metadata: AttentionMetadata,
        *entries: torch.Tensor,
        scales: torch.Tensor | None = None,
    ) -> None:
        if scales is not None:  # the spec refuses FP8 for MLA: nothing here scales
            raise ValueError("MLA latent entries are not scaled (no FP8 MLA cache yet)")
        (latent,) = entries
        if self.use_triton:
            self._store_triton(latent, cache, metadata.slot_mapping)
            return
        n = metadata.num_actual_tokens
        slots = metadata.slot_mapping[:n]
        latent = latent[:n]
        if not metadata.has_host_copies:  # graph buffers: padding requests among the rows
            real = slots >= 0
            slots, latent = slots[real], latent[real]
        cache.view(-1, cache.shape[-1]).index_copy_(0, slots, latent.to(cache.dtype))


class IndexerKeyLayout(MLALatentLayout):
    """Storage [num_blocks, block_size, head_dim]: one indexer key row per token, written
    as MLA latent rows are."""

    def allocate(self, spec: IndexerKeySpec, num_blocks: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(
            num_blocks,
            spec.block_size,
            spec.head_dim,
            dtype=getattr(torch, spec.dtype),
            device=device,
        )


def default_kv_layouts(device: torch.device | str) -> dict[type[KVCacheSpec], KVLayout]:
    """The layouts of the spec kinds Pagoda implements, writing as suits the device."""
    use_triton = torch.device(device).type == "cuda"
    return {
        FullAttentionSpec: FullAttentionLayout(use_triton=use_triton),
        MLAAttentionSpec: MLALatentLayout(use_triton=use_triton),
        IndexerKeySpec: IndexerKeyLayout(use_triton=use_triton),
    }


class KVCachePool:
    """Every layer's KV storage: layer i is stored as config.layer_specs[i] says."""

    def __init__(
        self,
        config: KVCacheConfig,
        device: torch.device | str,
        layouts: Mapping[type[KVCacheSpec], KVLayout] | None = None,
    ) -> None:
        layouts = default_kv_layouts(device) if layouts is None else layouts
        self.config = config
        self._layouts: list[KVLayout] = []
        self.caches: list[torch.Tensor] = []
        for layer_idx, spec in enumerate(config.layer_specs):
            layout = layouts.get(type(spec))
            if layout is None:
                raise ValueError(
                    f"layer {layer_idx}: no KV storage layout for "
                    f"{type(spec).__name__} (known: "
                    f"{', '.join(t.__name__ for t in layouts)})"
                )
            cache = layout.allocate(spec, config.num_blocks, torch.device(device))
            expected = spec.page_size_bytes * config.num_blocks
            if cache.numel() * cache.element_size() != expected:
                raise RuntimeError(
                    f"layer {layer_idx}: {type(layout).__name__} allocated "
                    f"{cache.numel() * cache.element_size()} bytes, its spec "
                    f"sizes {expected}"
                )
            self._layouts.append(layout)
            self.caches.append(cache)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def nbytes(self) -> int:
        return self.config.total_bytes

    def cache(self, layer_idx: int) -> torch.Tensor:
        """Layer layer_idx's storage, as its layout shapes it."""
        return self.caches[layer_idx]

    def layout(self, layer_idx: int) -> KVLayout:
        """How layer layer_idx's storage is shaped and written (a fused kernel may stand
        in for its store only where it writes the same bytes)."""
        return self._layouts[layer_idx]

    def store(
        self,
        layer_idx: int,
        metadata: AttentionMetadata,
        *entries: torch.Tensor,
        scales: torch.Tensor | None = None,
    ) -> None:
        """Writes this step's entries of one layer (full attention: k, v, each
        [num_tokens, num_kv_heads, head_dim]; MLA: latent [num_tokens, entry_size]) at
        metadata.slot_mapping. scales: the layer's float32 [k_scale, v_scale], needed
        by an FP8 cache (the Attention layer passes them only then)."""
        layout, cache = self._layouts[layer_idx], self.caches[layer_idx]
        if scales is None:  # layouts of unscaled kinds need not take the keyword
            layout.store(cache, metadata, *entries)
        else:
            layout.store(cache, metadata, *entries, scales=scales)
