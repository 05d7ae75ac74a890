"""KVOffloadManager and the scheduler's load/store hooks (no torch), with exact
assertions, plus a randomized workload against a simulated worker that checks the
KV contents every forward reads and audits every tier after every step."""

import random

import pytest

from pagoda.core.block_hash import extend_block_hashes
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.outputs import ModelRunnerOutput
from pagoda.core.request import Request
from pagoda.core.scheduler import Scheduler
from pagoda.kv_offload.planning.manager import KVOffloadManager
from pagoda.kv_offload.planning.tiers import KVTransferReport, TierIndex, TierStack
from pagoda.sampling_params import SamplingParams

BS = 4


def make(num_blocks=8, cpu=4, disk=None, per_step=64, inline=0):
    manager = KVCacheManager(num_blocks, BS)
    tiers = [TierIndex("cpu", cpu, slotted=True)]
    if disk:
        tiers.append(TierIndex("disk", disk, slotted=False))
    return manager, KVOffloadManager(
        manager, TierStack(tiers), per_step, max_inline_blocks_per_step=inline
    )


def req(rid, tokens, max_tokens=4):
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0))


def fill_and_free(manager, request):
    """The request computed its whole prompt; its full blocks stay cached."""
    manager.allocate_slots(request, request.num_tokens)
    manager.free(request)


def test_gpu_eviction_stores_to_cpu_and_writes_through_to_disk():
    manager, offload = make(num_blocks=4, cpu=4, disk=8)
    a = req("a", list(range(8)))  # two full blocks
    fill_and_free(manager, a)
    b = req("b", list(range(100, 116)))  # four blocks: evicts both of a's
    manager.allocate_slots(b, 16)
    plan = offload.take_plan()
    assert plan.store_gpu_block_ids == [1, 0]  # a's tail was freed (and evicted) first
    assert plan.store_cpu_slots == [0, 1]
    assert plan.store_hashes == [a.block_hashes[1], a.block_hashes[0]]
    assert [(w.tier, w.block_hash, w.cpu_slot) for w in plan.writes] == [
        (1, a.block_hashes[1], 0),
        (1, a.block_hashes[0], 1),
    ]
    offload.audit()
    cpu, disk = offload.tiers.tiers
    assert cpu.entry(a.block_hashes[0]).pins == 2  # its store and its disk write
    assert not disk.is_ready(a.block_hashes[0])
    offload.apply_report(
        KVTransferReport(
            stores_done=[plan.store_id], writes_done={w.op_id: True for w in plan.writes}
        )
    )
    assert disk.is_ready(a.block_hashes[0]) and cpu.entry(a.block_hashes[0]).pins == 0
    assert offload.take_plan() is None  # nothing in flight any more
    offload.audit()


def test_store_cap_drops_blocks_beyond_it():
    manager, offload = make(num_blocks=4, cpu=4, per_step=1)
    fill_and_free(manager, req("a", list(range(8))))
    manager.allocate_slots(req("b", list(range(100, 116))), 16)
    plan = offload.take_plan()
    assert len(plan.store_gpu_block_ids) == 1
    assert offload.tiers.cpu.counters.dropped == 1


def test_load_plan_reads_disk_blocks_into_reserved_cpu_slots():
    manager, offload = make(num_blocks=8, cpu=4, disk=8)
    cpu, disk = offload.tiers.tiers
    r = req("r", list(range(13)))
    extend_block_hashes(r, BS)
    h0, h1, h2 = r.block_hashes
    cpu.reserve(h0, ready=True)
    cpu.unpin(h0)  # slot 0
    disk.add_ready([h1, h2])
    assert offload.start_load(r, [])
    plan = offload.take_plan()
    (job,) = plan.loads
    assert job.cpu_slots == [0, 1, 2]
    assert [(rd.tier, rd.block_hash, rd.cpu_slot) for rd in job.reads] == [(1, h1, 1), (1, h2, 2)]
    assert job.gpu_block_ids == [0, 1, 2]
    assert offload.is_loading("r") and not offload.start_load(r, [])
    offload.audit()
    # The second disk read fails: block 1 loads, block 2 is recomputed and its disk
    # copy is forgotten.
    offload.apply_report(KVTransferReport(loads_done={job.job_id: 2}))
    assert offload.take_ready() == [r]
    assert cpu.is_ready(h1) and h2 not in cpu and h2 not in disk
    assert disk.counters.failed_reads == 1
    hits, num_hit_tokens = manager.get_computed_blocks(r)
    assert [b.block_id for b in hits] == [0, 1] and num_hit_tokens == 8
    offload.audit()
    manager.allocate_slots(r, 5, new_computed_blocks=hits)
    offload.release(r)
    assert manager.get_block_ids("r")[:2] == [0, 1]
    offload.audit()


def test_abort_while_loading_releases_blocks_only_when_the_load_is_done():
    manager, offload = make(num_blocks=8, cpu=4)
    r = req("r", list(range(9)))
    extend_block_hashes(r, BS)
    for block_hash in r.block_hashes:
        offload.tiers.cpu.reserve(block_hash, ready=True)
        offload.tiers.cpu.unpin(block_hash)
    assert offload.start_load(r, [])
    (job,) = offload.take_plan().loads
    offload.abort(r)
    assert manager.num_free_blocks == 6  # still written by the load
    offload.audit()
    offload.apply_report(KVTransferReport(loads_done={job.job_id: 2}))
    assert manager.num_free_blocks == 8 and offload.take_ready() == []
    assert offload.audit().cached == 2  # the loaded blocks stay in the prefix cache


def test_offload_needs_prefix_caching():
    with pytest.raises(ValueError, match="prefix caching"):
        KVOffloadManager(
            KVCacheManager(4, BS, enable_caching=False),
            TierStack([TierIndex("cpu", 2, slotted=True)]),
            8,
        )


# ------------------------------------------------------------------ randomized


class FakeWorker:
    """Executes plans on simulated memory, completing each transfer after a random
    delay, and checks that every position a forward treats as computed holds the
    request's own token. An inline load is copied at once (before the forward, after the
    stores' gathers) and reported after a random delay; its slots must not change
    until then."""

    def __init__(self, num_blocks, cpu_slots, rng, fail_rate):
        self.gpu = [[None] * BS for _ in range(num_blocks)]
        self.cpu = [None] * cpu_slots
        self.disk: dict[bytes, tuple] = {}
        self.rng, self.fail_rate = rng, fail_rate
        self.pending: list[tuple[int, object]] = []  # (due step, callable -> report part)
        self.step = 0
        self.tables: dict[str, list[int]] = {}

    def execute(self, plan, report):
        for block_id, slot in zip(plan.store_gpu_block_ids, plan.store_cpu_slots):
            self.cpu[slot] = tuple(self.gpu[block_id])  # gathered before the forward
        if plan.store_id is not None:
            self._later(lambda r, sid=plan.store_id: r.stores_done.append(sid))
        if plan.evictions or plan.writes:
            self._later(lambda r, p=plan: self._write(p, r))
        for job in plan.loads:
            if job.inline:
                assert not job.reads
                copied = [self.cpu[slot] for slot in job.cpu_slots]
                for data, block_id in zip(copied, job.gpu_block_ids):
                    self.gpu[block_id] = list(data)
                self._later(lambda r, j=job, c=copied: self._inline_done(j, c, r))
            else:
                self._later(lambda r, j=job: self._load(j, r))
        due, self.pending = (
            [p for p in self.pending if p[0] <= self.step],
            [p for p in self.pending if p[0] > self.step],
        )
        for _, fn in due:
            fn(report)

    def _later(self, fn):
        self.pending.append((self.step + self.rng.randrange(3), fn))

    def _write(self, plan, report):
        for _, block_hash in plan.evictions:
            self.disk.pop(block_hash, None)
        for write in plan.writes:
            self.disk[write.block_hash] = self.cpu[write.cpu_slot]
            report.writes_done[write.op_id] = True

    def _inline_done(self, job, copied, report):
        assert [self.cpu[slot] for slot in job.cpu_slots] == copied, "a slot changed under its copy"
        report.loads_done[job.job_id] = len(job.cpu_slots)

    def _load(self, job, report):
        intact = len(job.cpu_slots)
        for read in job.reads:
            data = self.disk.get(read.block_hash)
            if data is None or self.rng.random() < self.fail_rate:
                intact = job.cpu_slots.index(read.cpu_slot)
                break
            self.cpu[read.cpu_slot] = data
        for slot, block_id in zip(job.cpu_slots[:intact], job.gpu_block_ids[:intact]):
            self.gpu[block_id] = list(self.cpu[slot])
        report.loads_done[job.job_id] = intact

    def forward(self, out, scheduler):
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.tables.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids)
        starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        for cached in out.scheduled_cached_reqs:
            self.tables[cached.req_id].extend(cached.new_block_ids)
            starts[cached.req_id] = cached.num_computed_tokens
        for rid, n in out.num_scheduled_tokens.items():
            tokens = scheduler.requests[rid].all_token_ids
            table, start = self.tables[rid], starts[rid]
            for pos in range(start):
                assert self.gpu[table[pos // BS]][pos % BS] == tokens[pos], (rid, pos)
            for pos in range(start, start + n):
                self.gpu[table[pos // BS]][pos % BS] = tokens[pos]
        sampled = [
            [self.rng.randrange(50)] if rid in out.sampling_req_ids else []
            for rid in out.num_scheduled_tokens
        ]
        return ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled)


def random_step(scheduler, rng, documents, step, abort_rate=0.08):
    if step < 300 and rng.random() < 0.4:
        prompt = rng.choice(documents) + [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
        scheduler.add_request(
            Request(
                f"r{step}",
                prompt,
                SamplingParams(max_tokens=rng.randrange(1, 8), temperature=0.0),
                priority=rng.randrange(3),
            )
        )
    if scheduler.requests and rng.random() < abort_rate:
        scheduler.abort_requests(rng.choice(sorted(scheduler.requests)))
    return scheduler.schedule()


# FCFS only: see test_priority_preemption_of_a_request_scheduled_this_step below.
# Without aborts the backlog must still drain: nothing may wait forever on blocks that
# loads hold (a request put back in front of a loaded one once needed exactly those).
# inline 3: CPU-only loads of up to 3 blocks a step are loaded inline, the rest async.
# Finished requests' blocks are written through to the tiers, or only evicted ones are.
@pytest.mark.parametrize("write_through", [True, False], ids=["write-through", "evictions"])
@pytest.mark.parametrize("inline", [0, 3], ids=["async", "inline"])
@pytest.mark.parametrize("abort_rate", [0.08, 0.0], ids=["aborts", "no-aborts"])
@pytest.mark.parametrize("seed", range(4, 10))  # seeds whose runs preempt in every variant
def test_random_workload_with_aborts_and_preemptions_never_leaks_or_serves_stale_kv(
    seed, abort_rate, inline, write_through
):
    rng = random.Random(seed)
    num_blocks, cpu_slots = 14, 6
    manager = KVCacheManager(num_blocks, BS)
    tiers = TierStack(
        [TierIndex("cpu", cpu_slots, slotted=True), TierIndex("disk", 10, slotted=False)]
    )
    offload = KVOffloadManager(
        manager,
        tiers,
        max_blocks_per_step=5,
        max_inline_blocks_per_step=inline,
        write_through=write_through,
    )
    scheduler = Scheduler(
        manager, max_num_seqs=3, max_num_batched_tokens=12, max_model_len=48, kv_offload=offload
    )
    worker = FakeWorker(num_blocks, cpu_slots, rng, fail_rate=0.1)
    documents = [[rng.randrange(50) for _ in range(rng.randrange(8, 24))] for _ in range(4)]
    preemptions = loads = inline_loads = 0
    for step in range(2000):  # arrivals stop at 300; then the backlog drains
        out = random_step(scheduler, rng, documents, step, abort_rate)
        loads += len(out.kv_transfers.loads) if out.kv_transfers else 0
        inline_loads += sum(job.inline for job in out.kv_transfers.loads) if out.kv_transfers else 0
        preemptions += len(out.preempted_req_ids)
        report = KVTransferReport()
        worker.step = step
        if out.kv_transfers is not None:
            worker.execute(out.kv_transfers, report)
        runner = worker.forward(out, scheduler)
        runner.kv_transfers = report if out.kv_transfers is not None else None
        scheduler.update_from_output(out, runner)
        offload.audit()
        if step >= 300 and not scheduler.requests and not offload.has_in_flight:
            break
    assert not scheduler.requests and not offload.has_in_flight
    audit = offload.audit()
    assert audit.in_use == 0 and audit.free + audit.cached == num_blocks
    assert all(entry.pins == 0 for tier in tiers.tiers for entry in tier.entries.values())
    assert loads > 0 and preemptions > 0 and tiers.cpu.counters.stored > 0
    assert (inline_loads > 0) == bool(inline) and inline_loads < loads


# Found by this file's fuzz: under the priority policy a request scheduled earlier in
# the same step can be preempted; the blocks allocate_slots had registered for its
# unscheduled tokens must not stay in the prefix cache (KVCacheManager.free's
# num_valid_tokens), or a later request hits KV that was never computed.
def test_priority_preemption_of_a_request_scheduled_this_step():
    rng = random.Random(16)
    manager = KVCacheManager(14, BS)
    scheduler = Scheduler(
        manager, max_num_seqs=3, max_num_batched_tokens=12, max_model_len=48, policy="priority"
    )
    worker = FakeWorker(14, 6, rng, fail_rate=0.0)
    documents = [[rng.randrange(50) for _ in range(rng.randrange(8, 24))] for _ in range(4)]
    for step in range(400):
        out = random_step(scheduler, rng, documents, step)
        scheduler.update_from_output(out, worker.forward(out, scheduler))
