"""KVOffloadManager: the scheduler's side of the KV offload tiers (no torch).

It ties the GPU block pool to the tier bookkeeping (kv_offload/planning/tiers.py):
- GPU evictions: the pool calls `_on_gpu_evict` when it takes a cached block for new
  use; the block is stored to a CPU slot (and written through to the lower tiers)
  unless the CPU tier has it already. The store is planned in the same schedule()
  that hands the block to its new owner; the worker gathers the block's contents on
  the compute stream before that step's forward, so the copy always reads the old
  contents (see worker/kv_offload.py for the ordering invariant).
- Loads: at admission the scheduler calls `start_load(request, gpu_hits)`. It looks up
  the blocks after the GPU prefix hits in the tiers (longest prefix, each block from
  the highest tier holding it), takes fresh GPU blocks for them and plans a LoadJob.
  The job holds a reference on the GPU hits and on its new blocks while the load is in
  flight, so none of them is evicted or reused meanwhile; the request waits out of
  the queue. When the worker reports the job done, the intact blocks are registered
  in the GPU prefix cache, the job's references are dropped (the blocks stay cached,
  at the tail of the free list: evicted last) and the request goes back to the head
  of the waiting queue, where the ordinary prefix-cache lookup finds them. Holding
  them until admission instead could deadlock: a request put back in front of it
  (a preemption) may need exactly those blocks. A request is loaded once per wait:
  `release` at its admission ends that.
- Inline loads: a job whose blocks all sit in CPU slots (no lower-tier read) and that
  fits in `max_inline_blocks_per_step` is copied by the worker on the compute stream
  before this step's forward (worker/kv_offload.py). Stream order makes its blocks
  valid for this step's forward, so `start_load` registers them in the GPU prefix
  cache at once and the scheduler admits the request in the same schedule() (no step
  spent waiting, no report to wait for). The job keeps its GPU references until
  `take_plan` ends the schedule(), so no other allocation of that step takes a block
  it just loaded (its request may yet fail to be admitted in it). The worker's report
  then only releases the CPU slots' pins: a slot must not be rewritten while the copy
  from it may still be in flight (and while pinned, the CPU tier keeps the block, so
  evicting a loaded block from the GPU never plans a store of it).
- Aborts: a job in flight still writes its GPU blocks, so an aborted request's job is
  orphaned and its blocks are released only when the worker reports it done.
- Write-through: when a request finishes (or is aborted), the scheduler calls
  `request_finished` before freeing its blocks; its full blocks in the GPU prefix cache
  are queued, last block first, so a prefix's head is the most recently stored (the
  last a tier evicts, as when the GPU pool evicts a request's tail first). At the start
  of each schedule() `write_through` stores queued blocks the CPU tier lacks, in at most
  half the step's store budget (the other half stays free for the blocks that step
  evicts, whose contents its forward overwrites); the rest wait for the next step. A
  block already in the CPU tier costs no copy: it is made most recent there and written
  down from its slot to a lower tier lacking it once no transfer uses the slot. Queuing
  at finish rather than when a block fills: a block is registered in the cache when its
  step is scheduled, before its KV is computed, while at the start of a schedule every
  registered block was computed by a step already launched, whose forward precedes the
  store's gather on the compute stream; and a request's blocks go in one batch. A queued
  block that the GPU pool evicts meanwhile is stored by the eviction instead.

Cost-aware loads (kv_offload/planning/cost.py): given a LoadCostModel, `start_load` loads only the
leading blocks of the hit whose load is expected to beat recomputing them; the
blocks dropped are counted per tier as `skipped` (the tier keeps them). The model
learns from the worker's load timings (`apply_report`) and from the steps' timing:
the scheduler calls `step_scheduled` when it builds a step and `step_done` when its
results arrive; a step's seconds run from the later of its scheduling and the previous
step's results (with async scheduling the device starts a step when the previous one
ends) to its results. Without a model every hit is loaded.

Per step at most `max_blocks_per_step` blocks are stored and as many loaded (the
worker's staging for one step is bounded); evicted blocks beyond that are dropped
(counted per tier as `dropped`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

from pagoda.core.block_hash import BlockHash
from pagoda.core.block_pool import KVCacheBlock
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request
from pagoda.kv_offload.planning.cost import LoadCostModel
from pagoda.kv_offload.planning.tiers import (
    KVTransferPlan,
    KVTransferReport,
    LoadJob,
    TierIOTotals,
    TierRead,
    TierStack,
    TierWrite,
    accumulate_io,
    tier_snapshot,
)

logger = logging.getLogger(__name__)
# step_scheduled entries kept at most (each is dropped by its step_done; a bound in case
# a step's results never come, e.g. after a failed step).
_MAX_STEPS_TIMED = 64


class LoadStart(IntEnum):
    """What `start_load` did (falsy: nothing)."""

    NONE = 0  # no load: admit the request now
    WAIT = 1  # a load in flight: the request waits for it out of the queue
    INLINE = 2  # its blocks are in the GPU prefix cache from this step on: admit it now


@dataclass
class _Job:
    job: LoadJob
    request: Request
    hashes: list[BlockHash]
    tokens: list[tuple[int, ...]]
    sources: list[int]  # tier of each block
    held: list[KVCacheBlock]  # GPU references: the prefix hits, then the job's blocks
    load_blocks: list[KVCacheBlock]
    gpu_ready: bool = False  # its blocks are registered in the GPU prefix cache
    done: bool = False  # the worker reported it (its tier pins are released)
    orphaned: bool = False  # nobody waits for it: forgotten once reported

    @property
    def inline(self) -> bool:
        return self.job.inline


class KVOffloadManager:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        tiers: TierStack,
        max_blocks_per_step: int,
        cost: LoadCostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_inline_blocks_per_step: int = 0,
        write_through: bool = True,
    ) -> None:
        """cost: decides which hits are worth loading (None: every hit is loaded).
        clock: the step timing's time source (tests pass their own).
        max_inline_blocks_per_step: blocks per step that CPU-only jobs may load inline
        (0: every load is asynchronous).
        write_through: finished requests' blocks go to the tiers (False: only blocks
        the GPU pool evicts do; benchmarks compare the two)."""
        if not kv_cache_manager.enable_caching:
            raise ValueError("KV offloading needs prefix caching (enable_prefix_caching=True)")
        if not isinstance(max_blocks_per_step, int) or max_blocks_per_step < 1:
            raise ValueError(
                f"max_blocks_per_step must be an integer >= 1, got {max_blocks_per_step!r}"
            )
        if not isinstance(max_inline_blocks_per_step, int) or max_inline_blocks_per_step < 0:
            raise ValueError(
                "max_inline_blocks_per_step must be an integer >= 0, got "
                f"{max_inline_blocks_per_step!r}"
            )
        self.manager = kv_cache_manager
        self.pool = kv_cache_manager.block_pool
        self.block_size = kv_cache_manager.block_size
        self.tiers = tiers
        self.max_blocks_per_step = max_blocks_per_step
        self.max_inline_blocks_per_step = max_inline_blocks_per_step
        self._step_inline = 0  # blocks loaded inline in the step being scheduled
        self._inline_this_step: list[_Job] = []  # their GPU references go at take_plan
        self.pool.on_evict = self._on_gpu_evict
        self._ids = itertools.count()
        self._plan = KVTransferPlan()
        self._step_store_hashes: list[BlockHash] = []
        self.write_through_enabled = write_through
        # Finished requests' cached blocks not stored yet, in the order to store them.
        self._write_queue: dict[BlockHash, KVCacheBlock] = {}
        self.max_write_through_per_step = max(1, max_blocks_per_step // 2)
        self._step_loads = 0
        self._store_batches: dict[int, list[BlockHash]] = {}  # store_id -> CPU hashes pinned
        self._writes: dict[int, TierWrite] = {}
        self._jobs: dict[int, _Job] = {}
        self._job_of: dict[str, int] = {}  # request id -> its job
        self._ready: list[Request] = []  # loaded, to go back to the waiting queue
        self.io_totals: dict[str, TierIOTotals] = {}
        self.cost = cost
        if cost is not None and cost.tier_names != [t.name for t in tiers.tiers]:
            raise ValueError("the cost model's tiers must be the tier stack's, in order")
        self._clock = clock
        self._scheduled_at: dict[int, float] = {}  # id(SchedulerOutput) -> when built
        self._last_step_done: float = float("-inf")

    # ------------------------------------------------------------ scheduler's calls

    def is_loading(self, request_id: str) -> bool:
        job_id = self._job_of.get(request_id)
        return job_id is not None and not self._jobs[job_id].gpu_ready

    @property
    def num_loading(self) -> int:
        return sum(1 for job in self._jobs.values() if not job.gpu_ready and not job.orphaned)

    @property
    def has_in_flight(self) -> bool:
        return bool(
            self._write_queue
            or self._store_batches
            or self._writes
            or any(not job.done for job in self._jobs.values())
        )

    def start_load(self, request: Request, gpu_hits: list[KVCacheBlock]) -> LoadStart:
        """Plans loading the request's blocks that follow its GPU prefix hits from the
        tiers. WAIT: the request must wait for the load, out of the queue; INLINE: the
        blocks are in the GPU prefix cache now (look the request up again and admit it);
        NONE: nothing to load."""
        if (
            request.request_id in self._job_of
            or request.sampling_params.prompt_logprobs is not None
        ):
            return LoadStart.NONE  # loaded once already, or every prompt position must run
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        start = len(gpu_hits)
        budget = self.max_blocks_per_step - self._step_loads
        num_free = self.pool.num_free_blocks - sum(1 for b in gpu_hits if b.ref_cnt == 0)
        if start >= max_hit_blocks or budget < 1 or num_free < 1:
            return LoadStart.NONE
        hashes = list(request.block_hashes[start:max_hit_blocks])
        sources = self._worth_loading(request, self.tiers.lookup(hashes)[: min(budget, num_free)])
        slots, reads = self._pin_sources(hashes, sources)
        sources = sources[: len(slots)]
        if not sources:
            return LoadStart.NONE
        hashes = hashes[: len(sources)]
        self.pool.touch(gpu_hits)
        load_blocks = self.pool.get_new_blocks(len(sources))  # may evict: stores planned
        inline = not reads and len(sources) <= self.max_inline_blocks_per_step - self._step_inline
        job = LoadJob(next(self._ids), slots, [b.block_id for b in load_blocks], reads, inline)
        tokens = [
            tuple(
                request.all_token_ids[
                    (start + i) * self.block_size : (start + i + 1) * self.block_size
                ]
            )
            for i in range(len(sources))
        ]
        entry = _Job(
            job, request, hashes, tokens, sources, list(gpu_hits) + load_blocks, load_blocks
        )
        self._jobs[job.job_id] = entry
        self._job_of[request.request_id] = job.job_id
        self._plan.loads.append(job)
        self._step_loads += len(sources)
        for tier_index in sources:
            self.tiers.tiers[tier_index].counters.loaded += 1
        if not inline:
            return LoadStart.WAIT
        self._step_inline += len(sources)
        self._register_blocks(entry, len(sources))
        self._inline_this_step.append(entry)
        return LoadStart.INLINE

    def _worth_loading(self, request: Request, sources: list[int]) -> list[int]:
        """The leading sources whose load beats recompute (all without a cost model);
        the others are counted as skipped in their tiers."""
        if self.cost is None or not sources:
            return sources
        decision = self.cost.choose(sources)
        for tier_index, count in decision.skipped.items():
            self.tiers.tiers[tier_index].counters.skipped += count
        if decision.skipped and logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "request %s: %d of %d tier hits recomputed (%s): a block loads in %s, "
                "recomputes in %.2f ms",
                request.request_id,
                len(sources) - decision.num_load,
                len(sources),
                ", ".join(f"{self.tiers.tiers[t].name} {n}" for t, n in decision.skipped.items()),
                ", ".join(
                    f"{self.tiers.tiers[t].name} {self.cost.load_seconds(t) * 1e3:.2f} ms"
                    for t in sorted(set(sources))
                ),
                self.cost.recompute_seconds() * 1e3,
            )
        elif decision.explored:
            logger.debug(
                "request %s: %d tier hits loaded to measure a tier again",
                request.request_id,
                len(sources),
            )
        return sources[: decision.num_load]

    def _pin_sources(
        self, hashes: list[BlockHash], sources: list[int]
    ) -> tuple[list[int], list[TierRead]]:
        """Pins each source block, and reserves a CPU slot for each read from a lower
        tier; stops at the first block for which no CPU slot can be had. The CPU sources
        are pinned first, so that reserving a slot for a read never evicts one of them.
        Returns the CPU slot of each block kept, and the reads."""
        cpu = self.tiers.cpu
        for block_hash, tier_index in zip(hashes, sources):
            if tier_index == 0:
                cpu.pin(block_hash)
                cpu.touch(block_hash)
        slots: list[int] = []
        reads: list[TierRead] = []
        for index, (block_hash, tier_index) in enumerate(zip(hashes, sources)):
            if tier_index == 0:
                slots.append(cpu.entry(block_hash).slot)
                continue
            # Pending in CPU (another job reads it into a slot): not twice.
            reserved = None if block_hash in cpu else cpu.reserve(block_hash, ready=False)
            if reserved is None:
                for later_hash, later_tier in zip(hashes[index:], sources[index:]):
                    if later_tier == 0:
                        cpu.unpin(later_hash)
                break
            lower = self.tiers.tiers[tier_index]
            lower.pin(block_hash)
            lower.touch(block_hash)
            slots.append(reserved[0].slot)
            reads.append(TierRead(tier_index, bytes(block_hash), reserved[0].slot))
        return slots, reads

    def take_ready(self) -> list[Request]:
        """Requests whose loads finished since the last call, in the order they did."""
        ready, self._ready = self._ready, []
        return ready

    def release(self, request: Request) -> None:
        """The request was admitted: its job is forgotten (a later wait, after a
        preemption, may load again); an inline job not reported yet is kept until it is
        (its CPU slots stay pinned meanwhile)."""
        job_id = self._job_of.pop(request.request_id, None)
        if job_id is None:
            return
        job = self._jobs[job_id]
        if not job.gpu_ready:
            raise RuntimeError(
                f"internal error: request {request.request_id!r} admitted "
                "while its KV load is in flight"
            )
        if job.done:
            del self._jobs[job_id]
        else:
            job.orphaned = True

    def abort(self, request: Request) -> None:
        """The request finished without being admitted again (aborted): a job in flight
        keeps its blocks (an inline one, its CPU pins) until the worker reports it done."""
        job_id = self._job_of.pop(request.request_id, None)
        if job_id is None:
            return
        job = self._jobs[job_id]
        if job.done:
            del self._jobs[job_id]
            if request in self._ready:
                self._ready.remove(request)
        else:
            job.orphaned = True

    # ------------------------------------------------------------ stores

    def _on_gpu_evict(self, block_hash: BlockHash, block_id: int) -> None:
        self._write_queue.pop(block_hash, None)  # stored here, or dropped
        if block_hash in self.tiers.cpu:
            return
        if len(self._step_store_hashes) >= self.max_blocks_per_step or not self._store(
            block_hash, block_id
        ):
            self.tiers.cpu.counters.dropped += 1

    def request_finished(self, request: Request) -> None:
        """Queues the request's blocks in the GPU prefix cache for write-through, last
        first; called before its blocks are freed."""
        if not self.write_through_enabled:
            return
        blocks = self.pool.blocks
        for block_id in reversed(self.manager.get_block_ids(request.request_id)):
            block = blocks[block_id]
            block_hash = block.block_hash
            if block_hash is not None and self.pool.cached_blocks.get(block_hash) is block:
                self._write_queue.pop(block_hash, None)  # queued again: stored in this order
                self._write_queue[block_hash] = block

    def write_through(self) -> None:
        """Plans this step's share of the queued write-through (called at the start of
        schedule(), when every block in the GPU prefix cache holds computed KV)."""
        cpu = self.tiers.cpu
        budget = self.max_write_through_per_step - len(self._step_store_hashes)
        while self._write_queue:
            block_hash, block = next(iter(self._write_queue.items()))
            if self.pool.cached_blocks.get(block_hash) is not block:
                del self._write_queue[block_hash]  # no longer cached (a prefix-cache reset)
                continue
            if block_hash in cpu:
                del self._write_queue[block_hash]
                self._refresh(block_hash)
                continue
            if budget < 1 or not self._store(block_hash, block.block_id):
                return  # the rest waits for a later step (or for a pinned CPU slot to go)
            del self._write_queue[block_hash]
            budget -= 1

    def _refresh(self, block_hash: BlockHash) -> None:
        """A finished request used a block the CPU tier holds: most recent in every tier
        holding it, and written down to the lower tiers lacking it once its slot is
        settled (no store into it, or read of it, in flight)."""
        cpu = self.tiers.cpu
        entry = cpu.entry(block_hash)
        cpu.touch(block_hash)
        for tier in self.tiers.tiers[1:]:
            if block_hash in tier:
                tier.touch(block_hash)
        if entry.ready and entry.pins == 0:
            self._write_down(block_hash, entry.slot)

    def _store(self, block_hash: BlockHash, block_id: int) -> bool:
        """Plans GPU block block_id -> a CPU slot, written through to every lower tier
        lacking it; False, planning nothing, when the CPU tier has no unpinned room."""
        cpu = self.tiers.cpu
        reserved = cpu.reserve(block_hash, ready=True)  # ready: loads queue behind the copy
        if reserved is None:
            return False
        slot = reserved[0].slot
        self._plan.store_gpu_block_ids.append(block_id)
        self._plan.store_cpu_slots.append(slot)
        self._plan.store_hashes.append(bytes(block_hash))
        self._step_store_hashes.append(block_hash)
        cpu.counters.stored += 1
        self._write_down(block_hash, slot)
        return True

    def _write_down(self, block_hash: BlockHash, slot: int) -> None:
        """Plans CPU slot -> every lower tier lacking the block (after this step's
        stores, on the writer thread); a tier with no unpinned room drops it."""
        cpu = self.tiers.cpu
        for tier_index, tier in enumerate(self.tiers.tiers[1:], start=1):
            if block_hash in tier:
                continue
            lower = tier.reserve(block_hash, ready=False)
            if lower is None:
                tier.counters.dropped += 1
                continue
            self._plan.evictions.extend((tier_index, bytes(h)) for h in lower[1])
            cpu.pin(block_hash)  # the slot is read by the write
            write = TierWrite(next(self._ids), tier_index, bytes(block_hash), slot)
            self._writes[write.op_id] = write
            self._plan.writes.append(write)

    # ------------------------------------------------------------ worker round trip

    def take_plan(self) -> KVTransferPlan | None:
        """This step's plan for the worker (None: nothing to do and nothing in flight)."""
        plan, self._plan = self._plan, KVTransferPlan()
        # The step's allocations are over: the inline loads' blocks may be evicted from
        # the next step on (whose store gathers the worker queues after these copies).
        for job in self._inline_this_step:
            self.pool.free_blocks(reversed(job.held))
            job.held = []
        self._inline_this_step = []
        self._step_inline = 0
        if self._step_store_hashes:
            plan.store_id = next(self._ids)
            self._store_batches[plan.store_id] = self._step_store_hashes
        self._step_store_hashes = []
        self._step_loads = 0
        if not plan.has_work and self.has_in_flight:
            plan.poll = True
        return None if plan.is_empty else plan

    def step_scheduled(self, step) -> None:
        """The scheduler built `step` (a SchedulerOutput) now: the start of its timing."""
        if self.cost is not None and step.total_num_scheduled_tokens:
            if len(self._scheduled_at) >= _MAX_STEPS_TIMED:
                self._scheduled_at.clear()
            self._scheduled_at[id(step)] = self._clock()

    def step_done(self, step) -> None:
        """`step`'s results arrived now: its tokens per second feed the prefill estimate."""
        if self.cost is None:
            return
        now = self._clock()
        started = self._scheduled_at.pop(id(step), None)
        if started is not None:
            self.cost.observe_prefill(
                step.total_num_scheduled_tokens, now - max(started, self._last_step_done)
            )
        self._last_step_done = now

    def apply_report(self, report: KVTransferReport) -> None:
        accumulate_io(self.io_totals, report.io)
        if self.cost is not None:
            for name, num_bytes in report.io.bytes_loaded.items():
                self.cost.observe_load(name, num_bytes, sum(report.io.load_seconds.get(name, ())))
        cpu = self.tiers.cpu
        for store_id in report.stores_done:
            for block_hash in self._store_batches.pop(store_id):
                cpu.unpin(block_hash)
        for op_id, ok in report.writes_done.items():
            write = self._writes.pop(op_id)
            block_hash = BlockHash(write.block_hash)
            cpu.unpin(block_hash)
            tier = self.tiers.tiers[write.tier]
            if ok:
                tier.commit(block_hash)
                tier.counters.stored += 1
            else:
                tier.unpin(block_hash)
                tier.remove(block_hash)
                tier.counters.dropped += 1
        for job_id, num_intact in report.loads_done.items():
            self._finish_job(self._jobs[job_id], num_intact)

    def _finish_job(self, job: _Job, num_intact: int) -> None:
        """The worker reported the job: its tier pins go; an asynchronous job's intact
        blocks are registered on the GPU and its request is ready to be admitted."""
        if job.inline and num_intact != len(job.load_blocks):
            raise RuntimeError(
                f"internal error: inline KV load {job.job.job_id} reported "
                f"{num_intact} of {len(job.load_blocks)} blocks"
            )
        self._release_sources(job, num_intact)
        job.done = True
        if not job.inline:
            self._register_blocks(job, num_intact)
            self.pool.free_blocks(reversed(job.held))
            job.held = []
            if not job.orphaned:
                self._ready.append(job.request)
        if job.orphaned:
            del self._jobs[job.job.job_id]

    def _register_blocks(self, job: _Job, num_intact: int) -> None:
        """The job's first num_intact blocks hold their KV: into the GPU prefix cache."""
        for block, block_hash, tokens in zip(job.load_blocks[:num_intact], job.hashes, job.tokens):
            self.pool.cache_full_block(block, block_hash, tokens)  # False: cached meanwhile
        job.gpu_ready = True

    def _release_sources(self, job: _Job, num_intact: int) -> None:
        """Unpins the job's source blocks in their tiers; a lower-tier block read into a
        CPU slot is committed there if intact, dropped (and counted) if not."""
        cpu = self.tiers.cpu
        for index, (block_hash, tier_index) in enumerate(zip(job.hashes, job.sources)):
            if tier_index == 0:
                cpu.unpin(block_hash)
                continue
            lower = self.tiers.tiers[tier_index]
            lower.unpin(block_hash)
            if index < num_intact:
                cpu.commit(block_hash)
                continue
            cpu.unpin(block_hash)
            cpu.remove(block_hash)
            if index == num_intact:  # the read that failed: its copy is bad or gone
                lower.counters.failed_reads += 1
                if lower.entry(block_hash).pins == 0:
                    lower.remove(block_hash)

    def stats(self) -> list[dict]:
        """Per tier, top first: usage, lookups, blocks moved and skipped, bytes, latencies,
        and the cost model's load bandwidth and prefill estimates (None without one)."""
        rows = [
            tier_snapshot(tier, self.io_totals.get(tier.name, TierIOTotals()))
            for tier in self.tiers.tiers
        ]
        for index, row in enumerate(rows):
            row["est_load_bytes_per_s"] = (
                None if self.cost is None else self.cost.bandwidth[index].value
            )
            row["est_prefill_tokens_per_s"] = None if self.cost is None else self.cost.prefill.value
        return rows

    # ------------------------------------------------------------ audit

    def audit(self):
        """The GPU audit counting the jobs' references, and every tier's audit against
        the transfers in flight; raises AssertionError on any leak or double use."""
        gpu = self.manager.audit(extra_holders=[job.held for job in self._jobs.values()])
        cpu_pins: Counter = Counter()
        lower_pins = [Counter() for _ in self.tiers.tiers]
        for hashes in self._store_batches.values():
            cpu_pins.update(hashes)
        for write in self._writes.values():
            cpu_pins[BlockHash(write.block_hash)] += 1
            lower_pins[write.tier][BlockHash(write.block_hash)] += 1
        for job in self._jobs.values():
            if job.done:
                continue
            for block_hash, tier_index in zip(job.hashes, job.sources):
                cpu_pins[block_hash] += 1
                if tier_index:
                    lower_pins[tier_index][block_hash] += 1
        self.tiers.cpu.audit(dict(cpu_pins))
        for tier, pins in zip(self.tiers.tiers[1:], lower_pins[1:]):
            tier.audit(dict(pins))
        return gpu
