"""Tests of the block pool: the intrusive free list, eviction order, the hash table, audit."""

import pytest

from pagoda.core.block_hash import BlockHash, hash_block_tokens
from pagoda.core.block_pool import BlockPool, BlockPoolAudit, FreeBlockQueue, KVCacheBlock


def ids(blocks):
    return [block.block_id for block in blocks]


def fake_hash(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(32, "little"))


# --- hashing -----------------------------------------------------------------


def test_hash_is_stable_and_chained():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    # Fixed across processes and runs: the digest of a pinned encoding.
    assert first == hash_block_tokens(None, (1, 2, 3, 4))
    assert len(first) == 32
    assert hash_block_tokens(first, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])
    assert hash_block_tokens(None, [1, 2], extra=("lora-a",)) != hash_block_tokens(None, [1, 2])
    # Large and negative ids pack without loss.
    assert hash_block_tokens(None, [2**40]) != hash_block_tokens(None, [0])
    assert hash_block_tokens(None, [-1]) != hash_block_tokens(None, [2**63 - 1])


def test_hash_value_is_pinned():
    # Offload tiers key stored blocks on these values: changing the encoding must be deliberate.
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first.hex() == "3e83eaeab0f90bb410bf4a42728437b4bc19e5463566f6a71c83deeb4c8d0dbc"
    second = hash_block_tokens(first, [5, 6, 7, 8], ("x", 1))
    assert second.hex() == "72264c15172f4ae324d52b12f3f8c5d6468779d880d124c56e447ac9f5074b76"


# --- free list ---------------------------------------------------------------


def test_free_queue_remove_from_middle_relinks_neighbours():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4]
    assert len(queue) == 4
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert blocks[2] not in queue and blocks[3] in queue
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue) == [1, 3]
    queue.append(blocks[2])
    assert ids(queue) == [1, 3, 2]
    assert ids([queue.popleft(), queue.popleft(), queue.popleft()]) == [1, 3, 2]
    assert len(queue) == 0 and ids(queue) == []
    with pytest.raises(IndexError):
        queue.popleft()


def test_free_queue_rejects_double_membership():
    block = KVCacheBlock(0)
    queue = FreeBlockQueue([block])
    with pytest.raises(ValueError, match="already on the free list"):
        queue.append(block)
    queue.remove(block)
    with pytest.raises(ValueError, match="not on the free list"):
        queue.remove(block)


# --- pool ----------------------------------------------------------------------


def test_new_blocks_come_from_the_head_with_one_reference():
    pool = BlockPool(4)
    taken = pool.get_new_blocks(3)
    assert ids(taken) == [0, 1, 2]
    assert [b.ref_cnt for b in taken] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    assert pool.usage == 0.75
    with pytest.raises(ValueError, match="only 1 free"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    assert pool.get_new_blocks(0) == []


def test_pool_rejects_bad_size():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_eviction_order_is_exact():
    pool = BlockPool(10)
    a = pool.get_new_blocks(3)
    b = pool.get_new_blocks(2)
    assert ids(a) == [0, 1, 2] and ids(b) == [3, 4]
    for i, block in enumerate(a + b):
        assert pool.cache_full_block(block, fake_hash(i), (i,))
    # Requests free their blocks last first, so their tails are evicted first.
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    assert ids(pool.free_queue) == [5, 6, 7, 8, 9, 2, 1, 0, 4, 3]
    assert pool.audit() == BlockPoolAudit(total=10, free=5, cached=5, in_use=0)

    # Never-used blocks go first and evict nothing.
    assert ids(pool.get_new_blocks(5)) == [5, 6, 7, 8, 9]
    assert sorted(pool.cached_blocks) == [fake_hash(i) for i in range(5)]
    # Then A's tail: hashes 2 and 1 are evicted, A's head (hash 0) survives.
    assert ids(pool.get_new_blocks(2)) == [2, 1]
    assert sorted(pool.cached_blocks) == [fake_hash(0), fake_hash(3), fake_hash(4)]
    assert pool.blocks[2].block_hash is None and pool.blocks[2].token_ids is None
    assert ids(pool.get_new_blocks(3)) == [0, 4, 3]
    assert pool.cached_blocks == {}
    assert pool.audit() == BlockPoolAudit(total=10, free=0, cached=0, in_use=10)


def test_cached_lookup_compares_tokens():
    pool = BlockPool(2)
    [block] = pool.get_new_blocks(1)
    pool.cache_full_block(block, fake_hash(7), (1, 2, 3, 4))
    assert pool.get_cached_block(fake_hash(7), (1, 2, 3, 4)) is block
    assert pool.get_cached_block(fake_hash(7), [1, 2, 3, 4]) is block
    # Same hash, other tokens: a forged collision is a miss.
    assert pool.get_cached_block(fake_hash(7), (1, 2, 3, 5)) is None
    assert pool.get_cached_block(fake_hash(8), (1, 2, 3, 4)) is None


def test_second_block_with_a_taken_hash_stays_unhashed():
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    assert pool.cache_full_block(first, fake_hash(1), (1,)) is True
    assert pool.cache_full_block(second, fake_hash(1), (1,)) is False
    assert second.block_hash is None
    assert pool.cached_blocks == {fake_hash(1): first}
    with pytest.raises(ValueError, match="already cached"):
        pool.cache_full_block(first, fake_hash(2), (2,))


def test_touch_takes_a_cached_block_from_the_middle_of_the_free_list():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(5)
    pool.cache_full_block(blocks[2], fake_hash(2), (2,))
    pool.free_blocks(blocks)
    assert ids(pool.free_queue) == [0, 1, 2, 3, 4]
    hit = pool.get_cached_block(fake_hash(2), (2,))
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert ids(pool.free_queue) == [0, 1, 3, 4]
    # A second holder only bumps the count.
    pool.touch([hit])
    assert hit.ref_cnt == 2 and pool.num_free_blocks == 4
    pool.free_blocks([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 4
    pool.free_blocks([hit])
    assert ids(pool.free_queue) == [0, 1, 3, 4, 2]
    assert pool.audit() == BlockPoolAudit(total=5, free=4, cached=1, in_use=0)


def test_double_free_is_rejected():
    pool = BlockPool(2)
    [block] = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([block])


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_block(blocks[0], fake_hash(0), (0,))
    assert pool.reset_prefix_cache() is False
    assert len(pool.cached_blocks) == 1
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_blocks == {} and blocks[0].block_hash is None
    assert pool.audit() == BlockPoolAudit(total=3, free=3, cached=0, in_use=0)


def test_cache_full_block_refused_without_caching():
    pool = BlockPool(2, enable_caching=False)
    [block] = pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="enable_caching"):
        pool.cache_full_block(block, fake_hash(0), (0,))


def test_audit_catches_ref_count_and_free_list_disagreement():
    pool = BlockPool(4)
    pool.get_new_blocks(1)
    assert pool.audit() == BlockPoolAudit(total=4, free=3, cached=0, in_use=1)
    pool.blocks[2].ref_cnt = 1  # on the free list but claimed in use
    with pytest.raises(AssertionError, match="on the free list with ref_cnt 1"):
        pool.audit()
    pool.blocks[2].ref_cnt = 0
    pool.blocks[0].ref_cnt = 0  # not on the free list but unreferenced
    with pytest.raises(AssertionError, match="disagrees with free-list membership"):
        pool.audit()


def test_audit_catches_a_stale_hash_table():
    pool = BlockPool(2)
    [block] = pool.get_new_blocks(1)
    pool.cache_full_block(block, fake_hash(0), (0,))
    block.block_hash = fake_hash(9)
    with pytest.raises(AssertionError, match="hash"):
        pool.audit()
