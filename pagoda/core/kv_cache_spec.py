"""KV cache specs: what one attention layer stores per token, and sizing the pool from them.

Each attention layer declares a spec (``Attention.get_kv_cache_spec``). A spec is a
frozen dataclass that knows the bytes one block of that layer takes
(``page_size_bytes``); the worker's KV pool allocates each layer's storage from it and
the start-up code sizes the pool by summing the specs. A new kind of layer storage (a
latent MLA entry, a sparse-attention indexer key, a sliding window) is a new subclass
here plus its storage layout in the worker's pool; nothing else sizes KV memory.

Every layer shares the block size: one block id of the block manager names the same
token range in every layer's storage.

No torch: dtypes are named by string ("bfloat16"), as in the engine config.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

# Bytes per element of the dtypes a KV cache may be stored in. float8_e4m3fn: FP8 KV
# (kv_cache_dtype fp8), whose values are scaled by per-layer K/V scales that the
# attention layers hold (a few bytes per layer, not per block: not in the page size).
FP8_KV_DTYPE = "float8_e4m3fn"
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, FP8_KV_DTYPE: 1}


def _require_positive(owner: object, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{type(owner).__name__}.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class KVCacheSpec(ABC):
    """What one layer keeps per block of ``block_size`` tokens."""

    block_size: int

    def __post_init__(self) -> None:
        _require_positive(self, block_size=self.block_size)

    @property
    @abstractmethod
    def page_size_bytes(self) -> int:
        """Bytes one block of this layer takes."""


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """A key and a value vector per token and KV head, every token kept: storage
    [2, num_blocks, block_size, num_kv_heads, head_dim] in ``dtype``."""

    num_kv_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive(self, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(
                f"FullAttentionSpec.dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}"
            )

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class MLAAttentionSpec(KVCacheSpec):
    """Multi-head latent attention: one latent entry per token, shared by every head:
    kv_lora_rank values (compressed keys and values) then qk_rope_head_dim (the rotated
    key part); no separate K and V. Storage [num_blocks, block_size, entry_size] in
    ``dtype``."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive(
            self, kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim
        )
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(
                f"MLAAttentionSpec.dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}"
            )
        if self.dtype == FP8_KV_DTYPE:
            raise ValueError(
                "an FP8 KV cache (kv_cache_dtype fp8) is not supported for MLA "
                "yet; use kv_cache_dtype auto"
            )

    @property
    def entry_size(self) -> int:
        """Values one token keeps in one layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.entry_size * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class IndexerKeySpec(KVCacheSpec):
    """DeepSeek Sparse Attention's lightning-indexer keys: one head_dim vector per token,
    the scores' keys (the latent cache beside it holds what is attended). Storage
    [num_blocks, block_size, head_dim] in ``dtype``."""

    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive(self, head_dim=self.head_dim)
        if self.dtype not in DTYPE_BYTES or self.dtype == FP8_KV_DTYPE:
            raise ValueError(
                f"IndexerKeySpec.dtype must be one of float32, float16, bfloat16, got {self.dtype!r}"
            )

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.head_dim * DTYPE_BYTES[self.dtype]


def common_block_size(specs: Sequence[KVCacheSpec]) -> int:
    """The block size every layer shares; raises if there are no layers or they differ."""
    if not specs:
        raise ValueError("a KV cache needs at least one layer spec")
    sizes = {spec.block_size for spec in specs}
    if len(sizes) != 1:
        raise ValueError(f"every layer must use one block size, got {sorted(sizes)}")
    return specs[0].block_size


def bytes_per_block(specs: Sequence[KVCacheSpec]) -> int:
    """Bytes one block id takes over all layers: the sum of the layers' page sizes."""
    common_block_size(specs)
    return sum(spec.page_size_bytes for spec in specs)


def num_blocks_for_budget(
    budget_bytes: int, specs: Sequence[KVCacheSpec], max_model_len: int
) -> int:
    """Blocks that fit in the budget; at least enough for one full-length sequence."""
    block_size = common_block_size(specs)
    num_blocks = budget_bytes // bytes_per_block(specs)
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache budget ({budget_bytes / 2**20:.1f} MiB) holds {num_blocks} blocks of "
            f"{block_size} tokens, fewer than one sequence of max_model_len={max_model_len} "
            f"needs ({needed}); raise kv_cache_memory / gpu_memory_utilization or lower max_model_len"
        )
    return int(num_blocks)


@dataclass(frozen=True)
class KVCacheConfig:
    """The pool to allocate: ``num_blocks`` blocks in every layer, layer i stored as
    ``layer_specs[i]`` describes."""

    num_blocks: int
    layer_specs: tuple[KVCacheSpec, ...]

    def __post_init__(self) -> None:
        _require_positive(self, num_blocks=self.num_blocks)
        object.__setattr__(self, "layer_specs", tuple(self.layer_specs))  # frozen, hashable
        common_block_size(self.layer_specs)

    @property
    def block_size(self) -> int:
        return self.layer_specs[0].block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * bytes_per_block(self.layer_specs)
