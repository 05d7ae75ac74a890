"""The interface a KV offload tier implements (CPU memory, disk, or a plugin named by
`--kv-offloading-tier module.path:ClassName`), and the loading of a plugin.

A tier stores whole KV blocks keyed by their block hash (sha256 of the prefix up to
and including the block: core/block_hash.py). A block travels as one 1-D uint8
tensor of `KVBlockFormat.block_bytes` bytes on the host: every layer's page of that
block, layer after layer, in the layout `KVBlockFormat.layout` names.

Who decides what: the engine's bookkeeping (pagoda/kv_offload/planning/tiers.py) is authoritative.
It sizes the tier from `capacity_blocks()`, picks what to store and what to evict
(LRU) and calls `evict()` itself; a tier never drops a block on its own accord,
except that a block it can no longer read back intact (corrupt, deleted behind its
back) makes `load()` stop there. A tier may start with contents (`contents()`, e.g. a
disk tier after a restart); the engine seeds its bookkeeping with them.

Threading: `store`, `load` and `evict` run on the worker's I/O threads (one writer
for store and evict, one reader for load, so a tier sees at most one call of each
kind at a time) and may block; `stats` may be called from any thread.

A plugin class is constructed as `ClassName(block_format, **options)`: it must accept
the block format (and refuse, with a clear ValueError, one it cannot hold).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVBlockFormat:
    """What one stored block is: the identity a tier must check before serving a block
    back (a disk tier writes it into every file header)."""

    model_id: str  # the weights: resolved model path or name (+ seed for dummy weights)
    dtype: str  # e.g. "bfloat16"
    block_size: int  # tokens per block
    layout: str  # the layers' specs, e.g. "30x[full:2x16x3x64]" (see kv_offload.block_layout)
    block_bytes: int  # bytes of one block over every layer

    def describe(self) -> dict:
        return {
            "model_id": self.model_id,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "layout": self.layout,
            "block_bytes": self.block_bytes,
        }


class KVTier(ABC):
    """A store of KV blocks keyed by block hash (bytes)."""

    name: str = "tier"

    @abstractmethod
    def capacity_blocks(self) -> int:
        """How many blocks the tier can hold (the engine never asks it to hold more)."""

    def contents(self) -> list[bytes]:
        """Block hashes it holds at start-up, least recently used first (default: none)."""
        return []

    @abstractmethod
    def store(self, block_hashes: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> None:
        """Stores blocks[i] (a 1-D uint8 host tensor, block_bytes long, to be copied:
        the caller reuses its memory afterwards) under block_hashes[i]; raises on
        failure (the engine then treats those blocks as not stored)."""

    @abstractmethod
    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading block_hashes the tier holds."""

    @abstractmethod
    def load(self, block_hashes: Sequence[bytes], out: Sequence[torch.Tensor]) -> int:
        """Copies the blocks into out[i] (1-D uint8 host tensors), in order, stopping at
        the first one missing or not intact; returns how many were copied intact."""

    @abstractmethod
    def evict(self, block_hashes: Sequence[bytes]) -> None:
        """Drops the blocks (those it does not hold are ignored)."""

    @abstractmethod
    def stats(self) -> dict[str, float]:
        """Counters for the logs and metrics; at least `blocks` (held now)."""

    def close(self) -> None:
        """Releases files, locks and connections (the engine is shutting down)."""


def load_tier_plugin(spec: str, block_format: KVBlockFormat) -> KVTier:
    """Builds the tier `module.path:ClassName` names, for this block format."""
    module_name, sep, class_name = spec.partition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(f"--kv-offloading-tier must be module.path:ClassName, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"--kv-offloading-tier {spec}: cannot import {module_name!r}: {err}"
        ) from err
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, KVTier):
        raise ValueError(
            f"--kv-offloading-tier {spec}: {class_name!r} in {module_name!r} is not "
            "a subclass of pagoda.kv_offload.tier_api.KVTier"
        )
    tier = cls(block_format)
    capacity = tier.capacity_blocks()
    if not isinstance(capacity, int) or capacity < 1:
        raise ValueError(
            f"--kv-offloading-tier {spec}: capacity_blocks() must be an integer "
            f">= 1, got {capacity!r}"
        )
    return tier
