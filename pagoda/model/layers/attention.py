"""Attention layer: declares its KV cache spec, stores its k/v through the KV pool and
hands q to the backend of the current forward context.

The layer owns no weights; it only knows its index (which layer of the KV pool is its
own), its head geometry and its sliding window (None: full attention), which it passes
to the backend on every call. A windowed layer's cache still holds every token (its
spec is a FullAttentionSpec): the block table is shared by all layers. Backends take
[T, heads, head_dim]; the model works in [T, heads * head_dim].
A layer may carry attention sinks (``sinks=True``, gpt-oss): a float32 parameter
[num_heads of this rank] of per-head logits that join the softmax denominator, passed
to the backend on every call like the window. It keeps float32 whatever the model's
dtype, and its loader takes this rank's heads of the checkpoint's [num_heads] tensor.
``kv_cache_specs(model, ...)`` collects every layer's spec, ordered by layer index, for
sizing and allocating the pool.

FP8 KV cache: each layer holds ``kv_scales`` (a float32 buffer [k_scale, v_scale],
1.0 unless the checkpoint carries ``...self_attn.k_scale`` / ``v_scale``; see
attention/kv_quant.py) and passes it to the pool's store and the backend when its
cache is float8. A checkpoint's scales load into it whatever the cache dtype (an
unscaled cache simply does not read them). The buffer is at a fixed address from load
on: CUDA graphs read its current values.

A model may write the layer's k/v itself with a kernel fused with what precedes the
store (kernels/qk_rope_store.py: q/k norm + rotary + store in one launch):
``kv_store_target()`` says whether and where (only where the pool would itself write
this layer with the Triton store_kv kernel), then ``forward_stored(q)`` attends.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from pagoda.attention.forward_context import get_forward_context
from pagoda.attention.kv_pool import FullAttentionLayout
from pagoda.attention.kv_quant import is_fp8
from pagoda.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec

# Checkpoint names of the KV cache scales, under the layer's attention block
# (model.layers.N.self_attn.k_scale), as compressed-tensors / FP8 checkpoints save them.
KV_SCALE_NAMES = {"k_scale": 0, "v_scale": 1}


class KVStoreTarget(NamedTuple):
    """Where a fused kernel writes one layer's k/v this step, as the pool would."""

    cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # int64 [>= T]; -1: a padding row, nothing written
    kv_scales: torch.Tensor | None  # float32 [k_scale, v_scale] of an FP8 cache, else None


class Attention(nn.Module):
    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        sinks: bool = False,
        tp_rank: int = 0,
    ) -> None:
        """sliding_window W: each query sees its last W keys, its own included (None:
        full causal attention); passed to the backend on every call. sinks: the layer
        holds a float32 ``sinks`` parameter for its num_heads heads (heads tp_rank *
        num_heads .. of the checkpoint's)."""
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.scale = head_dim, scale
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window
        # [k_scale, v_scale] of an FP8 cache; a buffer, not a parameter: never a weight
        # to fill (dummy weights) and never required of a checkpoint. Not persistent:
        # checkpoints name the scales their own way (load_kv_scale).
        self.register_buffer("kv_scales", torch.ones(2, dtype=torch.float32), persistent=False)
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32))
            self.sinks.keep_dtype = True  # a logit per head: float32 in any model dtype
            self.sinks.weight_loader = self._load_sinks
            self._sink_offset = tp_rank * num_heads

    def _load_sinks(self, param: nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
        """This rank's heads of the checkpoint's [total heads] sink logits."""
        if shard_id is not None:
            raise ValueError(f"sinks take no shard_id, got {shard_id!r}")
        start, count = self._sink_offset, param.shape[0]
        if tensor.dim() != 1 or tensor.shape[0] < start + count:
            raise ValueError(
                f"sinks must be [num_heads] covering heads {start}..{start + count - 1}, "
                f"got {tuple(tensor.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor[start : start + count].float())

    def reset_kv_scales(self) -> None:
        """Scales 1.0 (vLLM's default without checkpoint scales); after materializing."""
        with torch.no_grad():
            self.kv_scales.fill_(1.0)

    def load_kv_scale(self, name: str, tensor: torch.Tensor) -> None:
        """Loads a checkpoint's k_scale / v_scale (a positive finite scalar)."""
        if tensor.numel() != 1:
            raise ValueError(
                f"{name} must be a scalar (one per layer), got shape {tuple(tensor.shape)}"
            )
        value = float(tensor.reshape(()).float())
        if not 0.0 < value < float("inf"):
            raise ValueError(f"{name} must be a positive finite number, got {value}")
        with torch.no_grad():
            self.kv_scales[KV_SCALE_NAMES[name]] = value

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """What this layer keeps per token: a key and a value per KV head, in dtype."""
        return FullAttentionSpec(
            block_size, self.num_kv_heads, self.head_dim, str(dtype).removeprefix("torch.")
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]; also writes k/v into this layer's cache."""
        ctx = get_forward_context()
        num_tokens = q.shape[0]
        cache = ctx.kv_pool.cache(self.layer_idx)
        scales = self.kv_scales if is_fp8(cache.dtype) else None
        ctx.kv_pool.store(
            self.layer_idx,
            ctx.metadata.common,
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            scales=scales,
        )
        return self._attend(ctx, q, cache, scales)

    def _attend(
        self, ctx, q: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        window = self.sliding_window
        if self.sinks is not None:
            out = ctx.backend.forward(
                q, cache, ctx.metadata, kv_scales=scales, sliding_window=window, sinks=self.sinks
            )
        elif window is not None:
            out = ctx.backend.forward(
                q, cache, ctx.metadata, kv_scales=scales, sliding_window=window
            )
        elif scales is None:  # an unscaled cache: the backends' plain signature
            out = ctx.backend.forward(q, cache, ctx.metadata)
        else:
            out = ctx.backend.forward(q, cache, ctx.metadata, kv_scales=scales)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def kv_store_target(self) -> KVStoreTarget | None:
        """This layer's cache, the step's slot mapping and the FP8 scales when the KV
        pool writes this layer with the Triton store_kv kernel (exactly the
        FullAttentionLayout, use_triton: CUDA, or the interpreter in tests), so that a
        kernel writing the same [2, blocks, block_size, Hkv, D] bytes may stand in for
        it. None otherwise (torch stores, other layouts, subclasses): call forward."""
        if not self.pool_stores_with_triton(FullAttentionLayout):
            return None
        ctx = get_forward_context()
        cache = ctx.kv_pool.cache(self.layer_idx)
        if cache.dim() != 5:
            return None
        scales = self.kv_scales if is_fp8(cache.dtype) else None
        return KVStoreTarget(cache, ctx.metadata.common.slot_mapping, scales)

    def pool_stores_with_triton(self, layout_type: type) -> bool:
        """Whether the KV pool writes this layer with layout_type's Triton store (exactly
        that layout, use_triton): only then may a fused kernel that writes the same
        bytes stand in for the pool's store."""
        layout = get_forward_context().kv_pool.layout(self.layer_idx)
        return type(layout) is layout_type and layout.use_triton

    def forward_stored(self, q: torch.Tensor) -> torch.Tensor:
        """q [T, H*D] -> [T, H*D] when this step's k/v are already in this layer's cache
        (written where kv_store_target said)."""
        ctx = get_forward_context()
        cache = ctx.kv_pool.cache(self.layer_idx)
        return self._attend(ctx, q, cache, self.kv_scales if is_fp8(cache.dtype) else None)


def kv_cache_specs(model: nn.Module, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
    """Every attention layer's spec, index i for layer_idx i (0..n-1, each once)."""
    layers = sorted(
        (m for m in model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_idx
    )
    indices = [layer.layer_idx for layer in layers]
    if indices != list(range(len(layers))):
        raise ValueError(
            f"attention layer indices must be 0..{len(layers) - 1}, each once; got {indices}"
        )
    return [layer.get_kv_cache_spec(block_size, dtype) for layer in layers]


def reset_kv_scales(model: nn.Module) -> None:
    """Every attention layer's KV scales back to 1.0 (materializing leaves buffers
    uninitialised; a checkpoint's scales load over these)."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.reset_kv_scales()


def load_kv_scale(model: nn.Module, hf_name: str, tensor: torch.Tensor) -> bool:
    """Loads a checkpoint's ``<block>.k_scale`` / ``<block>.v_scale`` into the Attention
    layer ``<block>.attn``; False when hf_name is no KV scale name."""
    prefix, _, leaf = hf_name.rpartition(".")
    if leaf not in KV_SCALE_NAMES or not prefix:
        return False
    try:
        layer = model.get_submodule(f"{prefix}.attn")
    except AttributeError:
        layer = None
    if not isinstance(layer, Attention):
        raise ValueError(
            f"checkpoint tensor {hf_name!r} names a KV cache scale, but "
            f"{prefix!r} holds no attention layer"
        )
    try:
        layer.load_kv_scale(leaf, tensor)
    except ValueError as e:
        raise ValueError(f"loading {hf_name!r}: {e}") from e
    return True
