"""The offload tiers' bookkeeping (pagoda/kv_offload/planning/tiers.py), with exact assertions."""

import pytest

from pagoda.core.block_hash import BlockHash
from pagoda.kv_offload.planning.tiers import (
    KVTransferPlan,
    LatencyHistogram,
    TierIndex,
    TierIOStats,
    TierIOTotals,
    TierStack,
    accumulate_io,
)


def h(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(32, "big"))


def test_slotted_tier_takes_lowest_free_slots_then_evicts_lru():
    tier = TierIndex("cpu", 3, slotted=True)
    slots = [tier.reserve(h(i), ready=True)[0].slot for i in range(3)]
    assert slots == [0, 1, 2]
    for i in range(3):
        tier.unpin(h(i))
    tier.touch(h(0))  # order now 1, 2, 0
    entry, evicted = tier.reserve(h(3), ready=True)
    assert evicted == [h(1)] and entry.slot == 1
    assert list(tier.entries) == [h(2), h(0), h(3)]
    assert tier.counters.evicted == 1


def test_pinned_entries_are_never_evicted():
    tier = TierIndex("cpu", 2, slotted=True)
    tier.reserve(h(0), ready=True)
    tier.reserve(h(1), ready=True)
    tier.unpin(h(1))
    entry, evicted = tier.reserve(h(2), ready=True)  # h(0) pinned: h(1) goes
    assert evicted == [h(1)] and entry.slot == 1
    assert tier.reserve(h(3), ready=True) is None  # both pinned now: nothing changes
    assert list(tier.entries) == [h(0), h(2)]


def test_pending_entries_are_invisible_until_committed():
    tier = TierIndex("disk", 4, slotted=False)
    entry, _ = tier.reserve(h(7), ready=False)
    assert entry.slot == -1 and not tier.is_ready(h(7)) and h(7) in tier
    tier.commit(h(7))
    assert tier.is_ready(h(7)) and tier.entry(h(7)).pins == 0
    with pytest.raises(ValueError, match="unpin"):
        tier.unpin(h(7))
    with pytest.raises(ValueError, match="already holds"):
        tier.reserve(h(7), ready=True)


def test_add_ready_seeds_a_keyed_tier_up_to_capacity():
    tier = TierIndex("disk", 2, slotted=False)
    assert tier.add_ready([h(1), h(2), h(3)]) == 2
    assert list(tier.entries) == [h(1), h(2)]
    with pytest.raises(ValueError):
        TierIndex("cpu", 2, slotted=True).add_ready([h(1)])


def test_lookup_is_the_longest_prefix_across_tiers_and_counts_per_tier():
    cpu, disk = TierIndex("cpu", 4, slotted=True), TierIndex("disk", 4, slotted=False)
    stack = TierStack([cpu, disk])
    cpu.reserve(h(1), ready=True)
    disk.add_ready([h(1), h(2), h(4)])
    disk.reserve(h(3), ready=False)  # still being written: not a hit
    assert stack.lookup([h(1), h(2), h(3), h(4)]) == [0, 1]
    # h1 hit in cpu; h2 missed cpu, hit disk; h3 missed both.
    assert (cpu.counters.queries, cpu.counters.hits) == (3, 1)
    assert (disk.counters.queries, disk.counters.hits) == (2, 1)


def test_stack_shape_is_checked():
    with pytest.raises(ValueError):
        TierStack([TierIndex("disk", 2, slotted=False)])
    with pytest.raises(ValueError):
        TierStack([TierIndex("cpu", 2, slotted=True), TierIndex("cpu2", 2, slotted=True)])
    with pytest.raises(ValueError, match="capacity"):
        TierIndex("cpu", 0, slotted=True)


def test_audit_checks_pins_against_transfers_in_flight():
    tier = TierIndex("cpu", 2, slotted=True)
    tier.reserve(h(1), ready=True)
    tier.audit({h(1): 1})
    with pytest.raises(AssertionError, match="pins"):
        tier.audit({})
    with pytest.raises(AssertionError, match="not held"):
        tier.audit({h(1): 1, h(2): 1})
    pending = TierIndex("disk", 2, slotted=False)
    pending.reserve(h(3), ready=False)
    pending.unpin(h(3))
    with pytest.raises(AssertionError, match="pending"):
        pending.audit({})


def test_plan_emptiness_and_histogram():
    assert KVTransferPlan().is_empty
    assert not KVTransferPlan(poll=True).is_empty
    assert not KVTransferPlan(poll=True).has_work
    hist = LatencyHistogram((0.01, 0.1))
    for seconds in (0.005, 0.05, 0.5):
        hist.observe(seconds)
    assert hist.snapshot() == {
        "buckets": [0.01, 0.1],
        "cumulative_counts": [1, 2],
        "count": 3,
        "sum": pytest.approx(0.555),
    }
    totals: dict[str, TierIOTotals] = {}
    accumulate_io(
        totals,
        TierIOStats(
            bytes_stored={"cpu": 10}, load_seconds={"disk": [0.2]}, invalid_files={"disk": 2}
        ),
    )
    accumulate_io(totals, TierIOStats(bytes_stored={"cpu": 5}))
    assert totals["cpu"].bytes_stored == 15
    assert totals["disk"].invalid_files == 2 and totals["disk"].load_seconds.count == 1


def test_reports_merge_without_losing_anything():
    from pagoda.kv_offload.planning.tiers import KVTransferReport

    first = KVTransferReport(
        stores_done=[1], loads_done={4: 2}, io=TierIOStats(bytes_loaded={"cpu": 8})
    )
    first.merge(
        KVTransferReport(
            stores_done=[2],
            writes_done={5: False},
            io=TierIOStats(bytes_loaded={"cpu": 8, "disk": 1}),
        )
    )
    assert first.stores_done == [1, 2] and first.loads_done == {4: 2}
    assert first.writes_done == {5: False} and first.io.bytes_loaded == {"cpu": 16, "disk": 1}
