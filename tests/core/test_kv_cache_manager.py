"""Tests of KVCacheManager: prefix hits, all-or-nothing allocation, sharing, freeing, audit."""

import random

import pytest

import pagoda.core.block_hash as block_hash_module
from pagoda.core.block_hash import BlockHash, extend_block_hashes, hash_block_tokens
from pagoda.core.block_pool import BlockPoolAudit
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request
from pagoda.sampling_params import SamplingParams

BLOCK = 4


def make_request(request_id: str, tokens, **sampling) -> Request:
    return Request(request_id, list(tokens), SamplingParams(**sampling))


def schedule_prompt(manager: KVCacheManager, request: Request):
    """What the scheduler does for a waiting request: look up hits, allocate the rest."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new_ids = manager.allocate_slots(
        request, request.num_tokens - num_hit_tokens, new_computed_blocks=hits
    )
    if new_ids is not None:
        request.num_computed_tokens = request.num_tokens
    return hits, num_hit_tokens, new_ids


def test_extend_block_hashes_is_incremental_and_chained():
    request = make_request("r", range(10))
    extend_block_hashes(request, BLOCK)
    first = hash_block_tokens(None, [0, 1, 2, 3])
    assert request.block_hashes == [first, hash_block_tokens(first, [4, 5, 6, 7])]
    request.append_output_token_ids([10, 11])
    extend_block_hashes(request, BLOCK)
    assert len(request.block_hashes) == 3
    assert request.block_hashes[2] == hash_block_tokens(request.block_hashes[1], [8, 9, 10, 11])


def test_manager_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)


def test_repeated_prompt_hits_the_cache():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    prompt = list(range(100, 110))  # two full blocks and two tokens
    first = make_request("a", prompt)
    assert schedule_prompt(manager, first) == ([], 0, [0, 1, 2])
    manager.free(first)

    second = make_request("b", prompt)
    hits, num_hit_tokens, new_ids = schedule_prompt(manager, second)
    assert ids_of(hits) == [0, 1] and num_hit_tokens == 8
    # Hits come first, then a fresh block from the head of the free list.
    assert new_ids == [0, 1, 3]
    assert manager.get_block_ids("b") == [0, 1, 3]
    assert (manager.prefix_cache_stats.queries, manager.prefix_cache_stats.hits) == (20, 8)
    assert manager.prefix_cache_stats.requests == 2
    assert manager.prefix_cache_stats.hit_rate == 0.4
    manager.prefix_cache_stats.reset()
    assert (manager.prefix_cache_stats.queries, manager.prefix_cache_stats.hits) == (0, 0)


def test_recompute_last_hit_block_gives_back_one_block_fewer():
    """Under MTP speculation the last cached block's final entry depends on the token
    after it: a hit of n blocks gives back n - 1 (and none of one block)."""
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK, recompute_last_hit_block=True)
    prompt = list(range(100, 114))  # three full blocks and two tokens
    first = make_request("a", prompt)
    schedule_prompt(manager, first)
    manager.free(first)
    hits, num_hit_tokens, _ = schedule_prompt(manager, make_request("b", prompt))
    assert len(hits) == 2 and num_hit_tokens == 8
    hits, num_hit_tokens, _ = schedule_prompt(manager, make_request("c", prompt[:6]))
    assert (hits, num_hit_tokens) == ([], 0)


def ids_of(blocks):
    return [block.block_id for block in blocks]


def test_at_least_one_token_is_left_to_compute():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    prompt = list(range(8))  # exactly two full blocks
    schedule_prompt(manager, make_request("a", prompt))
    twin = make_request("b", prompt)
    hits, num_hit_tokens = manager.get_computed_blocks(twin)
    # 8 cached tokens but at most 7 may be skipped: whole blocks only, so one block.
    assert ids_of(hits) == [0] and num_hit_tokens == 4
    longer = make_request("c", prompt + [99])
    hits, num_hit_tokens = manager.get_computed_blocks(longer)
    assert ids_of(hits) == [0, 1] and num_hit_tokens == 8
    single = make_request("d", [0])
    assert manager.get_computed_blocks(single) == ([], 0)


def test_hash_collision_with_other_tokens_is_a_miss(monkeypatch):
    forged = BlockHash(b"\x01" * 32)
    monkeypatch.setattr(
        block_hash_module, "hash_block_tokens", lambda parent, tokens, extra=(): forged
    )
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    schedule_prompt(manager, make_request("a", [1, 2, 3, 4, 5]))
    other = make_request("b", [9, 9, 9, 9, 5])
    hits, num_hit_tokens, new_ids = schedule_prompt(manager, other)
    assert other.block_hashes == [forged]
    assert (hits, num_hit_tokens) == ([], 0)
    assert new_ids == [2, 3]
    # The colliding block is not registered, so the first owner keeps the hash.
    assert manager.block_pool.cached_blocks[forged].block_id == 0
    assert manager.block_pool.blocks[2].block_hash is None
    assert manager.audit() == BlockPoolAudit(total=8, free=4, cached=0, in_use=4)


def test_failed_allocation_changes_nothing():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)
    holder = make_request("a", range(12))
    assert manager.allocate_slots(holder, 12) == [0, 1, 2]
    holder.num_computed_tokens = 12
    before = (
        manager.audit(),
        list(ids_of(manager.block_pool.free_queue)),
        dict(manager.block_pool.cached_blocks),
    )
    greedy = make_request("b", range(50, 58))
    assert manager.allocate_slots(greedy, 8) is None
    assert manager.get_block_ids("b") == []
    assert manager.allocate_slots(holder, 8) is None  # needs two more blocks
    assert manager.get_block_ids("a") == [0, 1, 2]
    after = (
        manager.audit(),
        list(ids_of(manager.block_pool.free_queue)),
        dict(manager.block_pool.cached_blocks),
    )
    assert after == before


def test_touched_hits_are_not_counted_as_free():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)
    prefix = list(range(8))
    first = make_request("a", prefix + [100])
    schedule_prompt(manager, first)
    manager.free(first)
    assert manager.audit() == BlockPoolAudit(total=4, free=2, cached=2, in_use=0)
    free_order = ids_of(manager.block_pool.free_queue)

    # 20 tokens = 5 blocks: 2 hits + 3 fresh, but touching the hits leaves only 2.
    too_long = make_request("b", prefix + list(range(200, 212)))
    hits, num_hit_tokens = manager.get_computed_blocks(too_long)
    assert num_hit_tokens == 8 and manager.num_free_blocks == 4
    assert manager.allocate_slots(too_long, 12, new_computed_blocks=hits) is None
    assert [block.ref_cnt for block in hits] == [0, 0]
    assert ids_of(manager.block_pool.free_queue) == free_order
    assert manager.audit() == BlockPoolAudit(total=4, free=2, cached=2, in_use=0)

    fits = make_request("c", prefix + list(range(200, 208)))
    hits, num_hit_tokens, new_ids = schedule_prompt(manager, fits)
    assert num_hit_tokens == 8 and len(new_ids) == 4
    assert manager.audit() == BlockPoolAudit(total=4, free=0, cached=0, in_use=4)


def test_requests_sharing_a_prompt_share_blocks():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK)
    prompt = list(range(9))
    requests = [make_request(f"r{i}", prompt) for i in range(3)]
    for request in requests:
        schedule_prompt(manager, request)
    assert [manager.get_block_ids(r.request_id) for r in requests] == [
        [0, 1, 2],
        [0, 1, 3],
        [0, 1, 4],
    ]
    shared = manager.block_pool.blocks[:2]
    assert [block.ref_cnt for block in shared] == [3, 3]
    assert manager.audit() == BlockPoolAudit(total=16, free=11, cached=0, in_use=5)
    for request in requests:
        manager.free(request)
    audit = manager.audit()
    assert audit.in_use == 0 and audit.free + audit.cached == audit.total
    assert audit == BlockPoolAudit(total=16, free=14, cached=2, in_use=0)
    assert manager.num_free_blocks == 16 and manager.usage == 0.0


def test_free_releases_last_block_first_and_is_idempotent():
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK)
    request = make_request("a", range(12))
    manager.allocate_slots(request, 12)
    manager.free(request)
    assert ids_of(manager.block_pool.free_queue) == [3, 4, 5, 2, 1, 0]
    manager.free(request)
    manager.free(make_request("never-seen", [1]))
    assert manager.get_block_ids("a") == []
    assert manager.audit() == BlockPoolAudit(total=6, free=3, cached=3, in_use=0)


def test_free_unregisters_blocks_past_the_valid_tokens_of_an_undone_step():
    # BLOCK = 4: 12 tokens fill blocks 0-2, all registered at allocation; only the
    # first 5 tokens' KV is valid (the step that was to compute the rest is undone).
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK)
    request = make_request("a", range(12))
    manager.allocate_slots(request, 12)
    assert len(manager.block_pool.cached_blocks) == 3
    manager.free(request, num_valid_tokens=5)
    assert len(manager.block_pool.cached_blocks) == 1  # block 0 only: tokens 0-3
    assert manager.audit() == BlockPoolAudit(total=6, free=5, cached=1, in_use=0)
    again = make_request("b", range(12))
    hits, num_hit_tokens = manager.get_computed_blocks(again)
    assert [b.block_id for b in hits] == [0] and num_hit_tokens == 4


def test_decode_caches_blocks_as_they_fill():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    request = make_request("a", range(6))
    assert manager.allocate_slots(request, 6) == [0, 1]
    request.num_computed_tokens = 6
    assert len(manager.block_pool.cached_blocks) == 1
    for token in (6, 7):
        request.append_output_token_ids([token])
        assert manager.allocate_slots(request, 1) == []
        request.num_computed_tokens += 1
    assert len(manager.block_pool.cached_blocks) == 2
    assert manager.block_pool.blocks[1].token_ids == (4, 5, 6, 7)
    assert manager.block_pool.blocks[1].block_hash == request.block_hashes[1]
    request.append_output_token_ids([8])
    assert manager.allocate_slots(request, 1) == [2]
    assert manager.usage == 3 / 8


def test_draft_and_lookahead_tokens_get_slots_but_are_not_cached():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    request = make_request("a", range(6))
    request.spec_token_ids = [6, 7]
    # 6 real + 2 draft tokens fill two blocks, 3 lookahead tokens need a third.
    assert manager.allocate_slots(request, 8, num_lookahead_tokens=3) == [0, 1, 2]
    assert [block.block_hash is not None for block in manager.block_pool.blocks[:3]] == [
        True,
        False,
        False,
    ]
    assert manager.num_blocks_needed(request, 13) == 1
    assert manager.num_blocks_needed(request, 12) == 0


def test_prompt_logprobs_requests_skip_the_cache():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    schedule_prompt(manager, make_request("a", range(9)))
    request = make_request("b", range(9), prompt_logprobs=1)
    assert manager.get_computed_blocks(request) == ([], 0)
    assert manager.prefix_cache_stats.queries == 9


def test_caching_disabled():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_caching=False)
    prompt = list(range(9))
    schedule_prompt(manager, make_request("a", prompt))
    assert manager.block_pool.cached_blocks == {}
    twin = make_request("b", prompt)
    assert manager.get_computed_blocks(twin) == ([], 0)
    assert (manager.prefix_cache_stats.queries, manager.prefix_cache_stats.hits) == (0, 0)
    with pytest.raises(ValueError, match="prefix caching is disabled"):
        manager.allocate_slots(twin, 1, new_computed_blocks=manager.block_pool.blocks[:1])


def test_stale_or_misplaced_hits_are_rejected():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)
    first = make_request("a", range(9))
    schedule_prompt(manager, first)
    manager.free(first)
    twin = make_request("b", range(9))
    hits, _ = manager.get_computed_blocks(twin)
    # Another allocation evicts every cached block before the twin is allocated.
    manager.allocate_slots(make_request("c", range(50, 66)), 16)
    with pytest.raises(ValueError, match="no longer holds"):
        manager.allocate_slots(twin, 1, new_computed_blocks=hits)
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots(twin, -1)


def test_reset_prefix_cache_through_the_manager():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)
    request = make_request("a", range(9))
    schedule_prompt(manager, request)
    assert manager.reset_prefix_cache() is False
    manager.free(request)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request("b", range(9))) == ([], 0)


def test_audit_catches_a_leaked_reference():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)
    manager.allocate_slots(make_request("a", range(4)), 4)
    manager.block_pool.touch(manager.block_pool.blocks[:1])  # a reference nobody holds
    with pytest.raises(AssertionError, match="ref counts sum to 2 but requests hold 1"):
        manager.audit()


# --- randomized stress test -----------------------------------------------------


def _check_cached_contents(manager: KVCacheManager, running: dict) -> None:
    """Every hashed block a request holds must hold exactly that request's tokens."""
    for request in running.values():
        blocks = manager._req_to_blocks.get(request.request_id, [])
        assert len(blocks) * BLOCK >= request.num_computed_tokens
        for index, block in enumerate(blocks):
            if block.block_hash is not None:
                assert block.block_hash == request.block_hashes[index]
                assert block.token_ids == tuple(
                    request.all_token_ids[index * BLOCK : (index + 1) * BLOCK]
                )


def _stress_step(
    manager: KVCacheManager, rng: random.Random, running: dict, prefixes, counter: list
) -> None:
    op = rng.random()
    if op < 0.35 or not running:
        counter[0] += 1
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
        request = make_request(f"r{counter[0]}", prompt)
        if schedule_prompt(manager, request)[2] is not None:
            running[request.request_id] = request
    elif op < 0.75:
        request = rng.choice(list(running.values()))
        request.append_output_token_ids([rng.randrange(50)])
        lookahead = rng.choice([0, 0, 2])
        if manager.allocate_slots(request, 1, num_lookahead_tokens=lookahead) is None:
            manager.free(request)  # preempt: recompute from scratch later
            del running[request.request_id]
        else:
            request.num_computed_tokens = request.num_tokens
    else:
        request = running.pop(rng.choice(sorted(running)))
        manager.free(request)


def test_randomized_allocate_and_free_keep_the_audit_clean():
    rng = random.Random(1234)
    manager = KVCacheManager(num_blocks=24, block_size=BLOCK)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(0, 14))] for _ in range(4)]
    running: dict[str, Request] = {}
    counter = [0]
    for _ in range(600):
        _stress_step(manager, rng, running, prefixes, counter)
        audit = manager.audit()
        assert audit.total == 24
        assert audit.in_use == len({bid for r in running for bid in manager.get_block_ids(r)})
        _check_cached_contents(manager, running)
    assert manager.prefix_cache_stats.hits > 0
    for request in list(running.values()):
        manager.free(request)
    audit = manager.audit()
    assert audit.in_use == 0 and audit.free + audit.cached == 24
    assert manager.num_free_blocks == 24
