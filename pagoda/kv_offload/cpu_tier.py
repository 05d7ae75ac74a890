"""CpuTier: the host-memory KV tier, and how a block of the KV pool is laid out as bytes.

The CPU tier is one uint8 tensor [num_slots, block_bytes] (pinned on CUDA, so copies
to and from the GPU are queued on a stream without the host waiting). Slot i holds
one block: every layer's page of that block, layer after layer (`BlockLayout`;
full-attention and MLA layers).

It is the hub of the offload tiers: the engine's bookkeeping (core/kv_tiers.py)
assigns slots, the copy engine (worker/kv_offload.py) moves blocks between slots and
the GPU pool, and the I/O threads between slots and the lower tiers. It also
implements the KVTier interface by hash (used by tools and tests, and what a plugin
wrapping host memory looks like): `bind` records which block a slot holds once its
data is in place, so `lookup`/`load` only ever see slots whose bytes are that block.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagoda.attention.kv_quant import as_bits
from pagoda.core.kv_cache_spec import (
    FullAttentionSpec,
    IndexerKeySpec,
    KVCacheSpec,
    MLAAttentionSpec,
)
from pagoda.kv_offload.tier_api import KVTier


@dataclass(frozen=True)
class LayerPage:
    """Where layer `index`'s page sits in a block's bytes, and how the pool holds it."""

    index: int
    offset: int
    nbytes: int
    dtype: torch.dtype
    block_dim: int  # the pool storage's block dimension
    block_shape: tuple[int, ...]  # one block of this layer, block dimension removed


def _page_of(spec: KVCacheSpec, index: int) -> tuple[str, int, tuple[int, ...]]:
    """(description, block dimension, block shape) of a layer kind the pool implements:
    full attention [2, num_blocks, block_size, kv_heads, head_dim] (block dim 1), MLA
    [num_blocks, block_size, entry] (block dim 0); other kinds are refused."""
    if type(spec) is FullAttentionSpec:
        shape = (2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        return f"full:{'x'.join(map(str, shape))}:{spec.dtype}", 1, shape
    if type(spec) is MLAAttentionSpec:
        shape = (spec.block_size, spec.entry_size)
        return f"mla:{'x'.join(map(str, shape))}:{spec.dtype}", 0, shape
    if type(spec) is IndexerKeySpec:
        shape = (spec.block_size, spec.head_dim)
        return f"indexer:{'x'.join(map(str, shape))}:{spec.dtype}", 0, shape
    raise ValueError(
        f"KV offloading supports full-attention, MLA and indexer-key layers; layer {index} "
        f"is {type(spec).__name__}"
    )


class BlockLayout:
    """A block's bytes: the layers' pages back to back, in layer order."""

    def __init__(self, specs: Sequence[KVCacheSpec]) -> None:
        pages, offset = [], 0
        runs: list[list] = []  # consecutive layers of one kind, e.g. 30x[full:2x16x3x64:float32]
        for index, spec in enumerate(specs):
            kind, block_dim, shape = _page_of(spec, index)
            pages.append(
                LayerPage(
                    index,
                    offset,
                    spec.page_size_bytes,
                    getattr(torch, spec.dtype),
                    block_dim,
                    shape,
                )
            )
            offset += spec.page_size_bytes
            if runs and runs[-1][0] == kind:
                runs[-1][1] += 1
            else:
                runs.append([kind, 1])
        self.pages = pages
        self.block_bytes = offset
        self.description = ",".join(f"{n}x[{kind}]" for kind, n in runs)

    def layer_view(self, blocks: torch.Tensor, page: LayerPage) -> torch.Tensor:
        """blocks [n, block_bytes] uint8 -> that layer's pages [n, *block_shape] (a view)."""
        raw = blocks[:, page.offset : page.offset + page.nbytes]
        return raw.view(page.dtype).view(blocks.shape[0], *page.block_shape)

    @staticmethod
    def gather(cache: torch.Tensor, page: LayerPage, ids: torch.Tensor) -> torch.Tensor:
        """The pool's blocks `ids` of one layer as [n, *block_shape] (an FP8 cache's
        picked as bytes: torch lacks float8 index kernels on some devices)."""
        picked = as_bits(cache).index_select(page.block_dim, ids).view(cache.dtype)
        return picked if page.block_dim == 0 else picked.movedim(page.block_dim, 0)

    @staticmethod
    def scatter(
        cache: torch.Tensor, page: LayerPage, ids: torch.Tensor, pages: torch.Tensor
    ) -> None:
        """Writes pages [n, *block_shape] into the pool's blocks `ids` of one layer."""
        source = pages if page.block_dim == 0 else pages.movedim(0, page.block_dim)
        as_bits(cache).index_copy_(page.block_dim, ids, as_bits(source))


class CpuTier(KVTier):
    name = "cpu"

    def __init__(self, num_slots: int, block_bytes: int, pin_memory: bool) -> None:
        if num_slots < 1:
            raise ValueError(f"the CPU tier must hold at least one block, got {num_slots} slots")
        # Unwritten slots hold garbage: nothing reads a slot before a block lands there
        # (the bookkeeping, and `bind` below). Pinned by registering the allocation, not
        # with pin_memory=True: torch's pinned allocator rounds a size up to a power of
        # two, which for a tier of tens of GiB can nearly double the host memory taken.
        self.data = torch.empty(num_slots, block_bytes, dtype=torch.uint8)
        self._num_slots = num_slots
        if pin_memory:
            status = int(
                torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), self.data.numel(), 0)
            )
            if status != 0:
                raise RuntimeError(
                    f"pinning {self.data.numel() / 2**30:.2f} GiB of host memory "
                    f"for the CPU KV tier failed (cudaError {status}); lower "
                    "--kv-offloading-size"
                )
            # Registered memory is unregistered before it is freed, by close() or when
            # the tier is collected (the finalizer holds the tensor until then).
            self._unpin = weakref.finalize(self, _unregister, self.data)
        else:
            self._unpin = None
        self.block_bytes = block_bytes
        self._guard = threading.Lock()
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # least recently bound first
        self._hash_in: dict[int, bytes] = {}

    def row(self, slot: int) -> torch.Tensor:
        return self.data[slot]

    def bind(self, block_hash: bytes, slot: int) -> None:
        """Slot `slot` now holds exactly block `block_hash` (its old block is gone)."""
        with self._guard:
            old = self._hash_in.pop(slot, None)
            if old is not None:
                self._slot_of.pop(old, None)
            stale = self._slot_of.pop(block_hash, None)
            if stale is not None:
                self._hash_in.pop(stale, None)
            self._slot_of[block_hash] = slot
            self._hash_in[slot] = block_hash

    def unbind_slot(self, slot: int) -> None:
        """Slot `slot` is about to be overwritten with bytes not yet known to be a block."""
        with self._guard:
            old = self._hash_in.pop(slot, None)
            if old is not None:
                self._slot_of.pop(old, None)

    # ---- KVTier -----------------------------------------------------------------------
    def capacity_blocks(self) -> int:
        return self._num_slots

    def store(self, block_hashes: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> None:
        """By hash, outside the engine's slot assignment: a free slot, else the least
        recently bound one. Never called by the engine on its own hub."""
        for block_hash, block in zip(block_hashes, blocks):
            with self._guard:
                slot = self._slot_of.get(block_hash)
                if slot is None:
                    free = [s for s in range(self.data.shape[0]) if s not in self._hash_in]
                    slot = free[0] if free else next(iter(self._slot_of.values()))
            self.unbind_slot(slot)
            self.data[slot].copy_(block)
            self.bind(block_hash, slot)

    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        with self._guard:
            count = 0
            for block_hash in block_hashes:
                if block_hash not in self._slot_of:
                    break
                count += 1
            return count

    def load(self, block_hashes: Sequence[bytes], out: Sequence[torch.Tensor]) -> int:
        for index, (block_hash, target) in enumerate(zip(block_hashes, out)):
            with self._guard:
                slot = self._slot_of.get(block_hash)
            if slot is None:
                return index
            target.copy_(self.data[slot])
        return len(block_hashes)

    def evict(self, block_hashes: Sequence[bytes]) -> None:
        with self._guard:
            for block_hash in block_hashes:
                slot = self._slot_of.pop(block_hash, None)
                if slot is not None:
                    self._hash_in.pop(slot, None)

    def stats(self) -> dict[str, float]:
        with self._guard:
            return {"blocks": float(len(self._slot_of)), "capacity": float(self._num_slots)}

    def close(self) -> None:
        """Unpins and frees the slots (idempotent); the tier holds nothing afterwards."""
        if self._unpin is not None:
            self._unpin()
        with self._guard:
            self._slot_of.clear()
            self._hash_in.clear()
        self.data = torch.empty(0, self.block_bytes, dtype=torch.uint8)


def _unregister(data: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(data.data_ptr())
