"""The pool of physical KV cache blocks: ref counts, the free list, the prefix cache.

A block is in exactly one of three states:
- in use: ref_cnt > 0, held by one or more requests, never on the free list;
- cached: ref_cnt == 0 and it holds a hash, so a later request with the same prefix
  can take it back (from the middle of the free list, in O(1));
- free: ref_cnt == 0 and no hash.
Every block with ref_cnt == 0 is on the free list, in eviction order: new blocks are
taken from its head, and taking a cached block from there evicts its hash.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import cast

from pagoda.core.block_hash import BlockHash


class KVCacheBlock:
    """Bookkeeping of one physical block; prev_free/next_free link it into the free list."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is in the prefix cache (full, hashed, maybe in use).
        self.block_hash: BlockHash | None = None
        # The tokens the hashed block holds, compared on lookup so that a hash
        # collision is a miss rather than wrong KV.
        self.token_ids: tuple[int, ...] | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={cached})"


class FreeBlockQueue:
    """Intrusive doubly-linked list of blocks: O(1) popleft, append and remove.

    Two sentinel blocks bound the list, so a block is on it exactly when its
    prev_free link is set, and no operation needs a special case for the ends.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail and node is not None:
            yield node
            node = node.next_free

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None:
            raise ValueError(f"{block} is already on the free list")
        last = cast(KVCacheBlock, self._tail.prev_free)  # the sentinels are always linked
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None:
            raise ValueError(f"{block} is already on the free list")
        first = cast(KVCacheBlock, self._head.next_free)
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self._len += 1

    def popleft(self) -> KVCacheBlock:
        if self._len == 0:
            raise IndexError("pop from an empty free block queue")
        block = cast(KVCacheBlock, self._head.next_free)
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None:
            raise ValueError(f"{block} is not on the free list")
        after = cast(KVCacheBlock, block.next_free)  # a listed block has both links
        block.prev_free.next_free = after
        after.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self._len -= 1


@dataclass(frozen=True)
class BlockPoolAudit:
    """Counts by state; total == free + cached + in_use always holds."""

    total: int
    free: int
    cached: int
    in_use: int


def _fail(message: str) -> None:
    # Explicit raise rather than `assert`, so audits still run under python -O.
    raise AssertionError(f"block pool audit failed: {message}")


class BlockPool:
    """All physical blocks of the KV cache, with the free list and the hash table."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # One block per hash: a second block filled with the same content (two
        # requests computing the same prefix at once) stays unhashed.
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        # Called with (hash, block id) when a cached block is taken for new use, before
        # its hash is dropped: the KV offload tiers store it (core/kv_offload.py).
        self.on_evict: Callable[[BlockHash, int], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take: free ones and evictable cached ones."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes num_blocks from the head of the free list, each returned with ref_cnt 1."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot take {num_blocks} blocks: only {self.num_free_blocks} free")
        taken = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
            if self.on_evict is not None:
                self.on_evict(block.block_hash, block.block_id)
        block.block_hash = None
        block.token_ids = None

    def get_cached_block(
        self, block_hash: BlockHash, token_ids: tuple[int, ...]
    ) -> KVCacheBlock | None:
        """The cached block holding exactly these tokens under this hash, else None."""
        block = self.cached_blocks.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache_full_block(
        self, block: KVCacheBlock, block_hash: BlockHash, token_ids: tuple[int, ...]
    ) -> bool:
        """Registers a full block under its hash; False if the hash is already taken."""
        if not self.enable_caching:
            raise ValueError("cache_full_block called on a pool with enable_caching=False")
        if block.ref_cnt < 1:
            raise ValueError(f"only a block in use can be cached, got {block}")
        if block.block_hash is not None:
            raise ValueError(f"{block} is already cached")
        if block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached_blocks[block_hash] = block
        return True

    def uncache(self, block: KVCacheBlock) -> None:
        """Unregisters a block in use whose KV will never be written (its step was
        undone); unlike an eviction, no tier is told to keep its contents."""
        if block.ref_cnt < 1:
            raise ValueError(f"only a block in use can be uncached, got {block}")
        if block.block_hash is not None and self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
        block.block_hash = None
        block.token_ids = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes one more reference on each block (prefix hits), unlinking free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference on each block; those reaching 0 go to the free-list tail
        in the given order (so the first given is evicted first)."""
        for block in ordered_blocks:
            if block.ref_cnt < 1:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def return_unused(self, blocks: list[KVCacheBlock]) -> None:
        """Gives back blocks a request took but never wrote (slots for drafts that were
        rejected): held by it alone and never cached, they go to the head of the free
        list in their order, so the next allocation takes them first, as if they had
        never been taken."""
        for block in blocks:
            if block.ref_cnt != 1 or block.block_hash is not None:
                raise ValueError(
                    f"only a block in use by one request and not cached can "
                    f"be returned unused, got {block}"
                )
        for block in reversed(blocks):
            block.ref_cnt = 0
            self.free_queue.appendleft(block)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
            block.token_ids = None
        self.cached_blocks.clear()
        return True

    def audit(self) -> BlockPoolAudit:
        """Counts blocks by state, raising AssertionError on any broken invariant."""
        on_list = 0
        for block in self.free_queue:
            on_list += 1
            if block.ref_cnt != 0:
                _fail(f"{block} is on the free list with ref_cnt {block.ref_cnt}")
        if on_list != len(self.free_queue):
            _fail(f"free list holds {on_list} blocks but records {len(self.free_queue)}")
        free = cached = in_use = 0
        for block in self.blocks:
            if block.ref_cnt < 0:
                _fail(f"{block} has a negative ref_cnt")
            if (block.ref_cnt == 0) != (block in self.free_queue):
                _fail(f"{block} ref_cnt disagrees with free-list membership")
            if (
                block.block_hash is not None
                and self.cached_blocks.get(block.block_hash) is not block
            ):
                _fail(f"{block} holds a hash the table does not map to it")
            if block.ref_cnt > 0:
                in_use += 1
            elif block.block_hash is not None:
                cached += 1
            else:
                free += 1
        for block_hash, block in self.cached_blocks.items():
            if block.block_hash != block_hash:
                _fail(f"hash table maps a hash to {block}, which holds another")
        if free + cached + in_use != self.num_blocks:
            _fail(f"free {free} + cached {cached} + in_use {in_use} != total {self.num_blocks}")
        if free + cached != on_list:
            _fail(f"{free + cached} blocks have ref_cnt 0 but {on_list} are on the free list")
        return BlockPoolAudit(total=self.num_blocks, free=free, cached=cached, in_use=in_use)
