"""Inline KV loads (core/kv_offload.py): a load whose blocks all sit in CPU slots and fit
the step's inline budget is registered in the GPU prefix cache at once, so the scheduler
admits its request in the very step that plans it; exact bookkeeping (GPU references
until the step's plan is taken, CPU pins until the worker reports the copy), and exact
step counts against the asynchronous path."""

import pytest

from pagoda.core.block_hash import extend_block_hashes
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.outputs import ModelRunnerOutput
from pagoda.core.request import Request
from pagoda.core.scheduler import Scheduler
from pagoda.kv_offload.planning.manager import KVOffloadManager, LoadStart
from pagoda.kv_offload.planning.tiers import KVTransferReport, TierIndex, TierStack
from pagoda.sampling_params import SamplingParams

BS = 4


def make(num_blocks=8, cpu=4, disk=None, inline=8):
    manager = KVCacheManager(num_blocks, BS)
    tiers = [TierIndex("cpu", cpu, slotted=True)]
    if disk:
        tiers.append(TierIndex("disk", disk, slotted=False))
    return manager, KVOffloadManager(
        manager, TierStack(tiers), 64, max_inline_blocks_per_step=inline
    )


def req(rid, tokens, max_tokens=4):
    r = Request(rid, tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    extend_block_hashes(r, BS)
    return r


def in_cpu(offload, hashes):
    """The blocks sit ready in CPU slots (as after their stores were reported)."""
    for block_hash in hashes:
        offload.tiers.cpu.reserve(block_hash, ready=True)
        offload.tiers.cpu.unpin(block_hash)


def test_inline_load_is_a_hit_at_once_and_pins_its_slots_until_reported():
    manager, offload = make()
    cpu = offload.tiers.cpu
    r = req("r", list(range(13)))  # 3 full blocks, all of them in CPU slots 0-2
    in_cpu(offload, r.block_hashes)
    assert offload.start_load(r, []) == LoadStart.INLINE
    assert not offload.is_loading("r") and offload.num_loading == 0
    hits, num_hit_tokens = manager.get_computed_blocks(r)
    assert [b.block_id for b in hits] == [0, 1, 2] and num_hit_tokens == 12
    assert manager.num_free_blocks == 5  # the job holds its blocks until take_plan
    offload.audit()
    assert manager.allocate_slots(r, 1, new_computed_blocks=hits) == [0, 1, 2, 3]
    offload.release(r)
    plan = offload.take_plan()
    (job,) = plan.loads
    assert job.inline and job.reads == []
    assert job.cpu_slots == [0, 1, 2] and job.gpu_block_ids == [0, 1, 2]
    assert [b.ref_cnt for b in hits] == [1, 1, 1]  # the request's own references only
    assert [cpu.entry(h).pins for h in r.block_hashes] == [1, 1, 1]
    assert offload.has_in_flight
    offload.audit()
    offload.apply_report(KVTransferReport(loads_done={job.job_id: 3}))
    assert [cpu.entry(h).pins for h in r.block_hashes] == [0, 0, 0]
    assert not offload.has_in_flight and offload.take_ready() == []
    assert offload.take_plan() is None
    audit = offload.audit()
    assert audit.in_use == 4 and audit.free == 4


def test_blocks_loaded_inline_are_not_evicted_in_the_step_that_loads_them():
    # The step's other allocations find them held: the request they were loaded for may
    # still be admitted in this step.
    manager, offload = make(num_blocks=4, cpu=8)
    r = req("r", list(range(9)))
    in_cpu(offload, r.block_hashes)
    assert offload.start_load(r, []) == LoadStart.INLINE
    other = req("other", list(range(100, 108)))
    assert manager.allocate_slots(other, 8) == [2, 3]
    assert manager.allocate_slots(req("third", list(range(200, 204))), 4) is None
    plan = offload.take_plan()
    assert plan.store_gpu_block_ids == []
    # From the next step on they are ordinary cached blocks (the prefix's tail evicted
    # first), and the CPU tier still holds them: nothing to store.
    assert manager.allocate_slots(req("third", list(range(200, 204))), 4) == [1]
    assert offload.take_plan().store_gpu_block_ids == []
    offload.apply_report(KVTransferReport(loads_done={plan.loads[0].job_id: 2}))
    offload.abort(r)
    assert not offload.has_in_flight
    offload.audit()


def test_inline_needs_cpu_sources_and_room_in_the_step_budget():
    manager, offload = make(num_blocks=16, cpu=8, disk=8, inline=3)
    cpu, disk = offload.tiers.tiers
    a = req("a", list(range(9)))
    b = req("b", list(range(100, 109)))
    c = req("c", list(range(200, 209)))
    d = req("d", list(range(300, 305)))
    in_cpu(offload, a.block_hashes + b.block_hashes + c.block_hashes[:1] + d.block_hashes)
    disk.add_ready(c.block_hashes[1:])
    assert offload.start_load(a, []) == LoadStart.INLINE  # 2 of the step's 3
    assert offload.start_load(b, []) == LoadStart.WAIT  # 2 more do not fit
    assert offload.start_load(c, []) == LoadStart.WAIT  # a disk read: never inline
    plan = offload.take_plan()
    assert [(job.inline, len(job.reads)) for job in plan.loads] == [
        (True, 0),
        (False, 0),
        (False, 1),
    ]
    assert offload.is_loading("b") and offload.is_loading("c") and offload.num_loading == 2
    assert offload.start_load(d, []) == LoadStart.INLINE  # the budget is per step
    offload.audit()
    next_plan = offload.take_plan()
    offload.apply_report(
        KVTransferReport(
            loads_done={job.job_id: len(job.cpu_slots) for job in plan.loads + next_plan.loads}
        )
    )
    assert offload.take_ready() == [b, c]
    for r in (a, b, c, d):
        offload.abort(r)
    assert offload.audit().in_use == 0
    assert all(entry.pins == 0 for tier in (cpu, disk) for entry in tier.entries.values())


def test_an_inline_job_reported_short_is_an_internal_error():
    manager, offload = make()
    r = req("r", list(range(9)))
    in_cpu(offload, r.block_hashes)
    offload.start_load(r, [])
    (job,) = offload.take_plan().loads
    with pytest.raises(RuntimeError, match="inline KV load"):
        offload.apply_report(KVTransferReport(loads_done={job.job_id: 1}))


def test_max_inline_blocks_per_step_is_checked():
    with pytest.raises(ValueError, match="max_inline_blocks_per_step"):
        make(inline=-1)


# ------------------------------------------------------------------ step counts


def run_revisit(inline: int, report_delay: int):
    """A running request decodes while `rev` arrives with its 3-block prefix in CPU slots.
    The worker reports each load `report_delay` steps after executing it (0: in the same
    step, the asynchronous path's best case). Returns the step (1 = the first schedule
    after the arrival) at which `rev` is scheduled and its computed tokens then, and the
    step at which its first token is sampled."""
    manager, offload = make(num_blocks=32, cpu=8, inline=inline)
    scheduler = Scheduler(
        manager, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, kv_offload=offload
    )
    scheduler.add_request(
        Request(
            "bg",
            list(range(500, 506)),
            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        )
    )
    rev = req("rev", list(range(14)))
    in_cpu(offload, rev.block_hashes)
    pending: list[tuple[int, int, int]] = []  # (due step, job id, blocks)
    scheduled = first_token = None
    for step in range(20):
        if step == 1:
            scheduler.add_request(rev)
        out = scheduler.schedule()
        for job in out.kv_transfers.loads if out.kv_transfers else ():
            pending.append((step + report_delay, job.job_id, len(job.cpu_slots)))
        report = KVTransferReport(loads_done={j: n for due, j, n in pending if due <= step})
        pending = [p for p in pending if p[0] > step]
        if "rev" in out.num_scheduled_tokens and scheduled is None:
            scheduled = (step, rev.num_computed_tokens - out.num_scheduled_tokens["rev"])
        sampled = [[7] if rid in out.sampling_req_ids else [] for rid in out.num_scheduled_tokens]
        if "rev" in out.sampling_req_ids and first_token is None:
            first_token = step
        scheduler.update_from_output(
            out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled, kv_transfers=report)
        )
        offload.audit()
    return scheduled, first_token


@pytest.mark.parametrize("report_delay", [0, 1, 2])
def test_a_revisit_loaded_inline_is_scheduled_in_the_step_that_plans_its_load(report_delay):
    # Inline: scheduled (on its 12 loaded tokens) in the step of its arrival, whenever
    # the worker reports the copy.
    assert run_revisit(inline=8, report_delay=report_delay) == ((1, 12), 1)
    # Asynchronous: a step spent waiting, plus the report's delay.
    assert run_revisit(inline=0, report_delay=report_delay) == (
        (2 + report_delay, 12),
        2 + report_delay,
    )
