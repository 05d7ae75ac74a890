"""Write-through (kv_offload/planning/manager.py): a finished request's cached blocks go
to the CPU tier and on to the lower tiers without waiting for the GPU pool to evict
them; exact plans for the order, the step budget, blocks a tier already holds, blocks
evicted or forgotten while queued, and a CPU tier whose slots are all in use."""

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.outputs import ModelRunnerOutput
from pagoda.core.request import Request
from pagoda.core.scheduler import Scheduler
from pagoda.kv_offload.planning.manager import KVOffloadManager
from pagoda.kv_offload.planning.tiers import KVTransferReport, TierIndex, TierStack
from pagoda.sampling_params import SamplingParams

BS = 4


def make(num_blocks=8, cpu=4, disk=8, per_step=64, write_through=True):
    manager = KVCacheManager(num_blocks, BS)
    tiers = [TierIndex("cpu", cpu, slotted=True)]
    if disk:
        tiers.append(TierIndex("disk", disk, slotted=False))
    offload = KVOffloadManager(manager, TierStack(tiers), per_step, write_through=write_through)
    return manager, offload


def req(rid, tokens, max_tokens=4):
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0))


def computed(manager, offload, request):
    """The request computed its whole prompt and finished (as the scheduler frees it)."""
    manager.allocate_slots(request, request.num_tokens)
    offload.request_finished(request)
    manager.free(request)


def report_all(offload, plan):
    offload.apply_report(
        KVTransferReport(
            stores_done=[] if plan.store_id is None else [plan.store_id],
            writes_done={w.op_id: True for w in plan.writes},
        )
    )


def test_a_finished_request_is_stored_last_block_first_and_written_down():
    manager, offload = make()
    a = req("a", list(range(10)))  # two full blocks and a partial one
    computed(manager, offload, a)
    assert offload.has_in_flight  # queued until the next schedule()
    offload.write_through()
    plan = offload.take_plan()
    assert plan.store_gpu_block_ids == [1, 0]  # the head is the most recently stored
    assert plan.store_hashes == [a.block_hashes[1], a.block_hashes[0]]
    assert plan.store_cpu_slots == [0, 1]
    assert [(w.tier, w.block_hash, w.cpu_slot) for w in plan.writes] == [
        (1, a.block_hashes[1], 0),
        (1, a.block_hashes[0], 1),
    ]
    offload.audit()
    report_all(offload, plan)
    cpu, disk = offload.tiers.tiers
    assert list(cpu.entries) == [a.block_hashes[1], a.block_hashes[0]]
    assert all(disk.is_ready(h) for h in a.block_hashes)
    assert not offload.has_in_flight
    # The blocks stay cached on the GPU, and their later eviction copies nothing.
    assert manager.get_computed_blocks(req("a2", list(range(10))))[1] == 8
    manager.allocate_slots(req("b", list(range(100, 132))), 32)
    assert offload.take_plan() is None
    offload.audit()


def test_blocks_a_tier_holds_are_not_copied_again():
    manager, offload = make()
    cpu, disk = offload.tiers.tiers
    a = req("a", list(range(8)))
    computed(manager, offload, a)
    offload.write_through()
    report_all(offload, offload.take_plan())
    other = req("o", list(range(50, 54)))  # a block stored after a's: now the newest
    computed(manager, offload, other)
    offload.write_through()
    report_all(offload, offload.take_plan())
    disk.remove(a.block_hashes[0])  # the disk lost one (its LRU, or a failed write)
    again = req("a3", list(range(8)) + [7, 7])  # the same prefix, finished again
    hits, _ = manager.get_computed_blocks(again)
    manager.allocate_slots(again, 2, new_computed_blocks=hits)
    offload.request_finished(again)
    manager.free(again)
    offload.write_through()
    plan = offload.take_plan()
    assert plan.store_gpu_block_ids == []  # the CPU tier holds both: no GPU copy
    assert [(w.tier, w.block_hash, w.cpu_slot) for w in plan.writes] == [
        (1, a.block_hashes[0], cpu.entry(a.block_hashes[0]).slot)
    ]
    assert list(cpu.entries)[-2:] == [a.block_hashes[1], a.block_hashes[0]]  # used again
    offload.audit()
    report_all(offload, plan)
    assert disk.is_ready(a.block_hashes[0]) and not offload.has_in_flight


def test_the_step_budget_is_half_the_store_cap_and_the_rest_waits():
    manager, offload = make(num_blocks=8, cpu=8, disk=None, per_step=4)
    a = req("a", list(range(20)))  # five full blocks
    computed(manager, offload, a)
    stored = []
    for _ in range(3):
        offload.write_through()
        plan = offload.take_plan()
        stored.append(plan.store_gpu_block_ids)
        report_all(offload, plan)
    assert stored == [[4, 3], [2, 1], [0]]
    assert offload.tiers.cpu.counters.dropped == 0 and not offload.has_in_flight


def test_a_queued_block_the_pool_evicts_is_stored_once_by_the_eviction():
    manager, offload = make(num_blocks=4, cpu=4, disk=None)
    a = req("a", list(range(8)))
    computed(manager, offload, a)
    manager.allocate_slots(req("b", list(range(100, 116))), 16)  # evicts both of a's
    offload.write_through()  # nothing left to do: the evictions stored them
    plan = offload.take_plan()
    assert plan.store_gpu_block_ids == [1, 0]
    assert plan.store_hashes == [a.block_hashes[1], a.block_hashes[0]]
    offload.audit()


def test_blocks_forgotten_by_a_prefix_cache_reset_are_not_stored():
    manager, offload = make()
    computed(manager, offload, req("a", list(range(8))))
    assert manager.reset_prefix_cache()
    offload.write_through()
    assert offload.take_plan() is None and not offload.has_in_flight


def test_a_cpu_tier_with_every_slot_in_use_makes_the_queue_wait():
    manager, offload = make(num_blocks=8, cpu=2, disk=None)
    a = req("a", list(range(8)))
    b = req("b", list(range(50, 58)))
    computed(manager, offload, a)
    offload.write_through()
    first = offload.take_plan()  # a's stores pin both slots until reported
    computed(manager, offload, b)
    offload.write_through()
    assert offload.take_plan().store_gpu_block_ids == []  # waits (a poll)
    assert offload.tiers.cpu.counters.dropped == 0 and offload.has_in_flight
    report_all(offload, first)
    offload.write_through()
    plan = offload.take_plan()
    assert plan.store_hashes == [b.block_hashes[1], b.block_hashes[0]]
    offload.audit()


def test_write_through_off_stores_only_evictions():
    manager, offload = make(write_through=False)
    computed(manager, offload, req("a", list(range(8))))
    offload.write_through()
    assert offload.take_plan() is None and not offload.has_in_flight


def test_the_scheduler_queues_a_finished_request_and_plans_it_next_step():
    manager, offload = make(num_blocks=8, cpu=4, disk=4)
    scheduler = Scheduler(
        manager, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32, kv_offload=offload
    )
    r = req("r", list(range(9)), max_tokens=1)
    scheduler.add_request(r)
    out = scheduler.schedule()
    assert out.kv_transfers is None
    runner = ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[5]])
    assert scheduler.update_from_output(out, runner)[0].finish_reason == "length"
    assert offload.has_in_flight  # queued: the engine keeps stepping
    nxt = scheduler.schedule()
    assert nxt.total_num_scheduled_tokens == 0
    assert nxt.kv_transfers.store_hashes == [r.block_hashes[1], r.block_hashes[0]]
    assert len(nxt.kv_transfers.writes) == 2
    offload.audit()
