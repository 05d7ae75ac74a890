"""KVCacheManager: which physical blocks each request holds, and prefix-cache lookups.

The scheduler asks it, per step, for prefix hits of a new request
(`get_computed_blocks`), for room for the tokens it schedules (`allocate_slots`,
all-or-nothing) and to release a finished or preempted request (`free`). Token
position t of a request lives in its block list at index t // block_size.

The manager never changes request.num_computed_tokens: the scheduler owns it, and
adds the prefix-hit tokens itself after a successful allocation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagoda.core.block_hash import extend_block_hashes
from pagoda.core.block_pool import BlockPool, BlockPoolAudit, KVCacheBlock
from pagoda.core.request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Monotonic counters of prefix-cache lookups, in tokens."""

    queries: int = 0
    hits: int = 0
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def reset(self) -> None:
        self.queries = self.hits = self.requests = 0


class KVCacheManager:
    """Per-request block lists over one BlockPool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        recompute_last_hit_block: bool = False,
    ) -> None:
        """recompute_last_hit_block: a prefix hit gives back one block fewer, for layers
        whose entry at a position also depends on the token after it (an MTP layer's
        input is the next token's embedding): the last cached block's final entry was
        written with the next token of whichever request wrote it."""
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.recompute_last_hit_block = recompute_last_hit_block
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.prefix_cache_stats = PrefixCacheStats()
        self._req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's leading blocks are already registered in the cache.
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._req_to_blocks.get(request_id, ())]

    def num_blocks_needed(self, request: Request, num_total_tokens: int) -> int:
        """Blocks the request must still take to hold num_total_tokens tokens."""
        held = len(self._req_to_blocks.get(request.request_id, ()))
        return max(0, _cdiv(num_total_tokens, self.block_size) - held)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in whole blocks, and its token count.

        At least one token is always left to compute (its logits are needed), so a
        full-prompt hit gives back fewer blocks. Requests asking for prompt logprobs
        skip the cache: every prompt position must go through the model.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        extend_block_hashes(request, self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_index, block_hash in enumerate(request.block_hashes[:max_hit_blocks]):
            block = self.block_pool.get_cached_block(
                block_hash, self._block_tokens(request, block_index)
            )
            if block is None:
                break
            hits.append(block)
        if self.recompute_last_hit_block and hits:
            hits.pop()
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_stats.requests += 1
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Gives the request blocks for num_computed_tokens + hits + num_new_tokens +
        num_lookahead_tokens tokens; returns the ids of the blocks added to it (prefix
        hits first), or None, changing nothing, when too few blocks are free.

        new_computed_blocks are the prefix hits from get_computed_blocks, allowed only
        while the request holds no blocks. Every block full of the request's real
        tokens (not draft or lookahead ones) after this step is registered in the cache.
        """
        hits = list(new_computed_blocks or ())
        self._check_allocation_args(request, num_new_tokens, hits, num_lookahead_tokens)
        req_blocks = self._req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_total = num_computed + num_new_tokens + num_lookahead_tokens
        num_fresh = max(0, _cdiv(num_total, self.block_size) - len(req_blocks) - len(hits))
        # Hits that sit on the free list stop being available once touched.
        num_evictable_hits = sum(1 for block in hits if block.ref_cnt == 0)
        if num_fresh > self.block_pool.num_free_blocks - num_evictable_hits:
            return None

        self.block_pool.touch(hits)
        fresh = self.block_pool.get_new_blocks(num_fresh)
        req_blocks.extend(hits)
        req_blocks.extend(fresh)
        self._req_to_blocks[request.request_id] = req_blocks
        if self.enable_caching:
            self._cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return [block.block_id for block in hits + fresh]

    def _check_allocation_args(
        self,
        request: Request,
        num_new_tokens: int,
        hits: list[KVCacheBlock],
        num_lookahead_tokens: int,
    ) -> None:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be >= 0, got {num_lookahead_tokens}")
        if not hits:
            return
        if not self.enable_caching:
            raise ValueError("new_computed_blocks given but prefix caching is disabled")
        if self._req_to_blocks.get(request.request_id):
            raise ValueError(
                f"request {request.request_id!r} already holds blocks; "
                "new_computed_blocks are only for its first allocation"
            )
        for block_index, block in enumerate(hits):
            # A hit evicted between lookup and allocation would hand out stale KV.
            if (
                block_index >= len(request.block_hashes)
                or block.block_hash != request.block_hashes[block_index]
            ):
                raise ValueError(
                    f"new_computed_blocks[{block_index}] ({block}) no longer holds "
                    f"block {block_index} of request {request.request_id!r}"
                )

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Registers the request's blocks that num_tokens real tokens fill."""
        extend_block_hashes(request, self.block_size)
        req_blocks = self._req_to_blocks[request.request_id]
        num_full = num_tokens // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        for block_index in range(start, num_full):
            block = req_blocks[block_index]
            if block.block_hash is None:  # prefix hits are registered already
                self.block_pool.cache_full_block(
                    block,
                    request.block_hashes[block_index],
                    self._block_tokens(request, block_index),
                )
        self._num_cached_blocks[request.request_id] = max(start, num_full)

    def _block_tokens(self, request: Request, block_index: int) -> tuple[int, ...]:
        start = block_index * self.block_size
        return tuple(request.all_token_ids[start : start + self.block_size])

    def free(self, request: Request, num_valid_tokens: int | None = None) -> None:
        """Releases the request's blocks, last first, so its tail is evicted first;
        its hashed blocks stay cached. Unknown requests are ignored.

        num_valid_tokens: the tokens whose KV is written or being written. Blocks past
        them were registered for a step that will not run (a request preempted in the
        step that scheduled it): those held by this request alone are unregistered
        first, so no later request hits KV that was never computed."""
        blocks = self._req_to_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if not blocks:
            return
        if num_valid_tokens is not None:
            for block in blocks[num_valid_tokens // self.block_size :]:
                if block.block_hash is not None and block.ref_cnt == 1:
                    self.block_pool.uncache(block)
        self.block_pool.free_blocks(reversed(blocks))

    def trim(self, request: Request, num_tokens: int) -> int | None:
        """Returns the request's blocks past those num_tokens tokens need, unused (they
        were taken for slots no step writes: core/optimistic_drafts.py); the number of
        blocks it keeps, or None when it had none to spare."""
        blocks = self._req_to_blocks.get(request.request_id)
        keep = _cdiv(max(num_tokens, 0), self.block_size)
        if not blocks or len(blocks) <= keep:
            return None
        if keep < self._num_cached_blocks.get(request.request_id, 0):
            raise ValueError(
                f"cannot trim request {request.request_id!r} to {keep} blocks: "
                "its cached blocks hold real tokens"
            )
        self.block_pool.return_unused(blocks[keep:])
        del blocks[keep:]
        return keep

    def reset_prefix_cache(self) -> bool:
        """Forgets all cached prefixes; False (nothing done) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def audit(self, extra_holders: Sequence[Sequence[KVCacheBlock]] = ()) -> BlockPoolAudit:
        """The pool's audit, plus: ref counts add up to the (request, block) pairs held,
        and to one reference per block of each of extra_holders (KV loads in flight)."""
        pool_audit = self.block_pool.audit()
        num_pairs = sum(len(blocks) for blocks in extra_holders)
        for request_id, blocks in self._req_to_blocks.items():
            if len({block.block_id for block in blocks}) != len(blocks):
                raise AssertionError(f"kv cache audit failed: {request_id!r} holds a block twice")
            num_pairs += len(blocks)
        total_refs = sum(block.ref_cnt for block in self.block_pool.blocks)
        if total_refs != num_pairs:
            raise AssertionError(
                f"kv cache audit failed: ref counts sum to {total_refs} "
                f"but requests hold {num_pairs} blocks"
            )
        return pool_audit
