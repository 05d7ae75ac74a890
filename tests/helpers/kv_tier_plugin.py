"""A KV tier plugin for the tests: blocks in a dict, loaded by module path
(`--kv-offloading-tier kv_tier_plugin:DictTier`). Instances register themselves in
`INSTANCES` so a test can look inside."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagoda.kv_offload.tier_api import KVBlockFormat, KVTier

INSTANCES: list[DictTier] = []


class DictTier(KVTier):
    name = "dict"

    def __init__(self, block_format: KVBlockFormat) -> None:
        self.format = block_format
        self.blocks: dict[bytes, torch.Tensor] = {}
        self.counts = {"stores": 0, "loads": 0, "evictions": 0}
        INSTANCES.append(self)

    def capacity_blocks(self) -> int:
        return 64

    def store(self, block_hashes: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> None:
        for block_hash, block in zip(block_hashes, blocks):
            self.blocks[block_hash] = block.clone()
            self.counts["stores"] += 1

    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        count = 0
        while count < len(block_hashes) and block_hashes[count] in self.blocks:
            count += 1
        return count

    def load(self, block_hashes: Sequence[bytes], out: Sequence[torch.Tensor]) -> int:
        for index, (block_hash, target) in enumerate(zip(block_hashes, out)):
            block = self.blocks.get(block_hash)
            if block is None:
                return index
            target.copy_(block)
            self.counts["loads"] += 1
        return len(block_hashes)

    def evict(self, block_hashes: Sequence[bytes]) -> None:
        for block_hash in block_hashes:
            if self.blocks.pop(block_hash, None) is not None:
                self.counts["evictions"] += 1

    def stats(self) -> dict[str, float]:
        return {"blocks": float(len(self.blocks)), **{k: float(v) for k, v in self.counts.items()}}


class NotATier:
    def __init__(self, block_format) -> None:
        pass
