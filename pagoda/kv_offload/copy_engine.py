"""KVCopyEngine: the worker's side of the KV offload tiers. It runs each step's
KVTransferPlan (core/kv_tiers.py) and reports what finished, never making the step
loop wait for a copy or for disk I/O.

Data paths (the CPU tier is the hub, worker/kv_cpu_tier.py):
- store, GPU -> CPU: one gather per layer (index_select of every block of the batch)
  into a device staging tensor [n, block_bytes], then one device-to-host copy per run
  of consecutive CPU slots, on the copy stream, into pinned memory;
- load, CPU -> GPU: one host-to-device copy per run of consecutive slots into a
  staging tensor, then one scatter per layer (index_copy_) into the pool, on the copy
  stream; the job is reported done once its event has completed (polled, not waited);
- inline load, CPU -> GPU (a job the scheduler marked `inline`: CPU slots only, small):
  the same copies, all inline jobs of the plan in one batch, on the compute stream
  before this step's forward, so that forward may read the blocks (invariant 5);
- lower tiers (disk, plugin) <-> CPU slots: two I/O threads, a reader (loads) and a
  writer (stores and evictions, in plan order), calling the KVTier interface. A job
  whose blocks come partly from a lower tier is read first, then copied as above.
On CPU the same code runs with plain (synchronous) copies and no streams.

Ordering invariants (why no copy reads or writes a block at the wrong time):
1. A store reads a GPU block that this step's schedule() just took from the prefix
   cache for a new owner. Its gather is queued on the compute stream in
   execute_model() before this step's forward, and every write into a KV block
   happens in a forward on that stream, so the gather reads the old contents.
2. A load writes fresh GPU blocks that schedule() may have just evicted (their store
   gather is queued on the compute stream) or that an aborted request's in-flight
   forward may still write. The load's copies wait on an event recorded on the compute
   stream after that step's gathers, so they land after both.
3. A CPU slot is read by a GPU load or a disk write, or written by a store or a disk
   read, only while the engine's bookkeeping holds a pin on it; pinned slots are never
   reassigned. A store into a slot and a later load from it are ordered by the copy
   stream; a disk write from a slot first waits for its store's event.
4. The loaded blocks become visible (hashed in the GPU prefix cache) only once the
   worker reports the load's event complete, so no forward reads them before.
5. Inline loads are the exception to 4: their blocks are visible from the step that
   plans them, and their copies are queued on the compute stream before that step's
   forward (after the step's store gathers, invariant 2), so every forward that may
   read the blocks runs after the copies land. A slot they read may still be the
   target of a store in flight on the copy stream: the compute stream first waits for
   that store's event. Their slots stay pinned until their event is reported complete.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagoda.attention.kv_pool import KVCachePool
from pagoda.kernels.launch.host_copy import host_to_device
from pagoda.kv_offload.cpu_tier import BlockLayout, CpuTier
from pagoda.kv_offload.planning.tiers import (
    KVTransferPlan,
    KVTransferReport,
    LoadJob,
    TierIOStats,
    TierWrite,
)
from pagoda.kv_offload.tier_api import KVBlockFormat, KVTier, load_tier_plugin

logger = logging.getLogger(__name__)

GIB = 1 << 30
# Bytes stored, and bytes loaded, per step at most: bounds the device staging memory a
# step takes beside the pool (the scheduler drops stores and defers loads beyond it).
MAX_TRANSFER_BYTES_PER_STEP = 1 << 30
# Bytes per step loaded inline (on the compute stream, ahead of the step's forward, which
# waits for them): 512 MiB is ~13 ms at the ~40 GB/s an H200 host link gives, less than
# one mixed prefill/decode step, while a load waited for asynchronously costs its request
# about three steps (report, re-admission, results). Larger loads, and any from a lower
# tier, stay asynchronous.
MAX_INLINE_LOAD_BYTES_PER_STEP = 512 << 20
# How long an idle step (nothing to compute) waits for a transfer to finish.
IDLE_POLL_SECONDS = 0.002
# How long closing waits for an I/O thread to finish the calls queued on it.
IO_CLOSE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class TierInventory:
    """A tier as the engine's bookkeeping needs it (picklable, no torch)."""

    name: str
    capacity: int
    contents: list[bytes]  # held at start-up, least recently used first


@dataclass(frozen=True)
class OffloadInventory:
    tiers: list[TierInventory]  # CPU first
    max_blocks_per_step: int
    block_bytes: int
    max_inline_blocks_per_step: int = 0  # blocks a step may load inline (0: none)
    # Start-up measurements for the cost model (worker/kv_cost_probe.py): one prefill
    # forward's (tokens, seconds), and per tier name a load's (bytes, seconds).
    prefill_sample: tuple[int, float] | None = None
    load_samples: dict[str, tuple[int, float]] = field(default_factory=dict)


def _timed_event(stream) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def _elapsed(start, done: torch.cuda.Event | None) -> float:
    """Seconds a copy took: on CUDA the device time between its two events (what the
    copy engine measures as transfer latency and bandwidth), on CPU the wall time."""
    if done is None:
        return time.perf_counter() - start
    return start.elapsed_time(done) / 1000.0


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(index, first slot, length) of each run of consecutive slots."""
    runs: list[tuple[int, int, int]] = []
    for index, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((index, slot, 1))
    return runs


class _IOThread:
    """One daemon thread running submitted calls in order."""

    def __init__(self, name: str) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        self._queue.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            try:
                fn()
            except Exception:  # noqa: BLE001 - each call reports its own failure
                logger.exception("KV offload I/O failed")
            # The call references the copy engine: a thread waiting for the next must
            # not keep a dropped engine (and so this thread) alive.
            del fn

    def close(self) -> None:
        """Runs what was submitted, then stops the thread (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(None)
            if threading.current_thread() is self._thread:
                return  # the engine was dropped by this thread's last call: it stops next
            self._thread.join(timeout=IO_CLOSE_TIMEOUT_S)
            if self._thread.is_alive():
                logger.warning(
                    "KV offload thread %s did not stop within %.0fs",
                    self._thread.name,
                    IO_CLOSE_TIMEOUT_S,
                )


@dataclass
class _Load:
    job: LoadJob
    after: torch.cuda.Event | None  # compute-stream event of the step that planned it


class KVCopyEngine:
    def __init__(
        self,
        pool: KVCachePool,
        layout: BlockLayout,
        cpu: CpuTier,
        lower: list[KVTier],
        device: torch.device,
    ) -> None:
        self.pool, self.layout, self.cpu, self.lower = pool, layout, cpu, lower
        self.device = device
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.block_bytes = layout.block_bytes
        self._report = KVTransferReport()
        self._io = TierIOStats()
        self._io_guard = threading.Lock()
        self._done: queue.Queue = queue.Queue()  # from the I/O threads
        self._pending_stores: list[tuple[int, torch.cuda.Event, float, list[int], list[bytes]]] = []
        # ([(job id, blocks)], done event, start event): one entry per batch of copies
        self._pending_loads: list[tuple[list[tuple[int, int]], torch.cuda.Event, float]] = []
        self._num_thread_ops = 0  # submitted to the I/O threads, not yet drained
        self._invalid_seen = {tier.name: 0.0 for tier in lower}
        self.reader = _IOThread("pagoda-kv-read")
        self.writer = _IOThread("pagoda-kv-write")
        # Closed by close(), or when the engine is collected without it: the threads,
        # the tiers (the disk lock) and the pinned slots never outlive the copy engine.
        self._finalizer = weakref.finalize(
            self,
            _close_tiers,
            self.reader,
            self.writer,
            self.lower,
            self.cpu,
            device if self.cuda else None,
        )

    # ---- a step's plan ----------------------------------------------------------------
    def execute(self, plan: KVTransferPlan) -> None:
        """Queues the plan's transfers; called before the step's forward is launched."""
        store_event = None
        if plan.store_gpu_block_ids:
            store_event = self._store(plan)
        after = None
        if self.cuda:  # invariant 2: loads of this plan go after this point of the stream
            after = torch.cuda.Event()
            after.record()
        if plan.evictions or plan.writes:
            self._num_thread_ops += len(plan.writes)
            self.writer.submit(lambda: self._write(plan.evictions, plan.writes, store_event))
        inline = [job for job in plan.loads if job.inline]
        if inline:
            self._load_inline(inline)
        for job in plan.loads:
            if job.inline:
                continue
            load = _Load(job, after)
            if job.reads:
                self._num_thread_ops += 1
                self.reader.submit(lambda load=load: self._read(load))
            else:
                self._issue_load(load, len(job.gpu_block_ids))

    def _store(self, plan: KVTransferPlan) -> torch.cuda.Event | None:
        start = time.perf_counter()
        slots = list(plan.store_cpu_slots)
        ids = host_to_device(plan.store_gpu_block_ids, torch.long, self.device)
        staging = torch.empty(len(slots), self.block_bytes, dtype=torch.uint8, device=self.device)
        for page in self.layout.pages:  # invariant 1: on the compute stream, before the forward
            gathered = self.layout.gather(self.pool.cache(page.index), page, ids)
            self.layout.layer_view(staging, page).copy_(gathered)
        for slot in slots:
            self.cpu.unbind_slot(slot)
        if not self.cuda:
            self._copy_runs_to_cpu(staging, slots)
            self._finish_store(plan.store_id, start, slots, plan.store_hashes)
            return None
        gathered_event = torch.cuda.Event()
        gathered_event.record()
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(gathered_event)
            began = _timed_event(self.copy_stream)
            self._copy_runs_to_cpu(staging, slots)
            done = _timed_event(self.copy_stream)
        staging.record_stream(self.copy_stream)
        self._pending_stores.append((plan.store_id, done, began, slots, list(plan.store_hashes)))
        return done

    def _copy_runs_to_cpu(self, staging: torch.Tensor, slots: list[int]) -> None:
        for index, slot, length in _runs(slots):
            self.cpu.data[slot : slot + length].copy_(
                staging[index : index + length], non_blocking=self.cuda
            )

    def _finish_store(
        self,
        store_id: int,
        start,
        slots: list[int],
        hashes: list[bytes],
        done: torch.cuda.Event | None = None,
    ) -> None:
        for slot, block_hash in zip(slots, hashes):
            self.cpu.bind(block_hash, slot)
        self._report.stores_done.append(store_id)
        self._record_io("stored", self.cpu.name, len(slots), _elapsed(start, done))

    def _load_inline(self, jobs: list[LoadJob]) -> None:
        """The inline jobs' blocks, in one batch, on the current (compute) stream: the
        step's forward, queued after, reads them (invariant 5)."""
        if any(job.reads for job in jobs):
            raise ValueError("an inline KV load reads CPU slots only")
        start = time.perf_counter()
        slots = [slot for job in jobs for slot in job.cpu_slots]
        block_ids = [block_id for job in jobs for block_id in job.gpu_block_ids]
        counts = [(job.job_id, len(job.gpu_block_ids)) for job in jobs]
        if not self.cuda:
            self._copy_slots_to_pool(slots, block_ids)
            self._finish_load(counts, start)
            return
        stream = torch.cuda.current_stream(self.device)
        wanted = set(slots)
        for _, stored, _, store_slots, _ in self._pending_stores:
            if not wanted.isdisjoint(store_slots):
                stream.wait_event(stored)  # a store into one of these slots lands first
        began = _timed_event(stream)
        self._copy_slots_to_pool(slots, block_ids)
        self._pending_loads.append((counts, _timed_event(stream), began))

    def _issue_load(self, load: _Load, num_blocks: int) -> None:
        """Copies the job's first num_blocks blocks from their CPU slots to the GPU."""
        job = load.job
        start = time.perf_counter()
        if num_blocks == 0:
            self._report.loads_done[job.job_id] = 0
            return
        slots = job.cpu_slots[:num_blocks]
        if not self.cuda:
            self._copy_slots_to_pool(slots, job.gpu_block_ids[:num_blocks])
            self._finish_load([(job.job_id, num_blocks)], start)
            return
        with torch.cuda.stream(self.copy_stream):
            if load.after is not None:
                self.copy_stream.wait_event(load.after)
            began = _timed_event(self.copy_stream)
            self._copy_slots_to_pool(slots, job.gpu_block_ids[:num_blocks])
            done = _timed_event(self.copy_stream)
        self._pending_loads.append(([(job.job_id, num_blocks)], done, began))

    def _copy_slots_to_pool(self, slots: list[int], block_ids: list[int]) -> None:
        """On the current stream: the slots' bytes into a staging tensor, then one
        scatter per layer into the pool's blocks."""
        staging = torch.empty(len(slots), self.block_bytes, dtype=torch.uint8, device=self.device)
        for index, slot, length in _runs(slots):
            staging[index : index + length].copy_(
                self.cpu.data[slot : slot + length], non_blocking=self.cuda
            )
        ids = host_to_device(block_ids, torch.long, self.device)
        for page in self.layout.pages:
            self.layout.scatter(
                self.pool.cache(page.index), page, ids, self.layout.layer_view(staging, page)
            )

    def _finish_load(
        self, counts: list[tuple[int, int]], start, done: torch.cuda.Event | None = None
    ) -> None:
        """Reports the jobs of one batch of copies: (job id, intact blocks) each."""
        for job_id, num_blocks in counts:
            self._report.loads_done[job_id] = num_blocks
        self._record_io("loaded", self.cpu.name, sum(n for _, n in counts), _elapsed(start, done))

    # ---- the I/O threads --------------------------------------------------------------
    def _read(self, load: _Load) -> None:
        """Reader thread: the job's lower-tier blocks into their CPU slots, in block order,
        stopping at the first that is not intact; then hands the job back to the loop."""
        num_intact = 0
        try:
            num_intact = self._read_blocks(load.job)
        except Exception:  # noqa: BLE001 - nothing loaded; the request recomputes
            logger.exception("KV offload: reading job %d failed", load.job.job_id)
        finally:
            self._done.put(("read", load, num_intact))

    def _read_blocks(self, job: LoadJob) -> int:
        block_of_slot = {slot: index for index, slot in enumerate(job.cpu_slots)}
        groups: list[list] = []  # consecutive reads from one tier
        for read in job.reads:
            if groups and groups[-1][0] == read.tier:
                groups[-1][1].append(read)
            else:
                groups.append([read.tier, [read]])
        for tier_index, reads in groups:
            tier = self.lower[tier_index - 1]
            start = time.perf_counter()
            for read in reads:
                self.cpu.unbind_slot(read.cpu_slot)
            try:
                got = tier.load(
                    [r.block_hash for r in reads], [self.cpu.row(r.cpu_slot) for r in reads]
                )
            except Exception:  # noqa: BLE001 - a tier failing is a miss, not a crash
                logger.exception("KV tier %s: load failed", tier.name)
                got = 0
            for read in reads[:got]:
                self.cpu.bind(read.block_hash, read.cpu_slot)
            self._record_io("loaded", tier.name, got, time.perf_counter() - start)
            if got < len(reads):
                return block_of_slot[reads[got].cpu_slot]
        return len(job.cpu_slots)

    def _write(
        self,
        evictions: list[tuple[int, bytes]],
        writes: list[TierWrite],
        store_event: torch.cuda.Event | None,
    ) -> None:
        """Writer thread: evictions, then the writes (after the slots' store landed);
        every write is reported, as failed if anything went wrong."""
        results = {write.op_id: False for write in writes}
        try:
            for tier_index, block_hash in evictions:
                self.lower[tier_index - 1].evict([block_hash])
            if store_event is not None:
                store_event.synchronize()
            by_tier: dict[int, list[TierWrite]] = {}
            for write in writes:
                by_tier.setdefault(write.tier, []).append(write)
            for tier_index, ops in by_tier.items():
                tier = self.lower[tier_index - 1]
                start = time.perf_counter()
                try:
                    tier.store(
                        [op.block_hash for op in ops], [self.cpu.row(op.cpu_slot) for op in ops]
                    )
                except Exception:  # noqa: BLE001 - the blocks are then simply not stored there
                    logger.exception("KV tier %s: store failed", tier.name)
                    continue
                self._record_io("stored", tier.name, len(ops), time.perf_counter() - start)
                results.update((op.op_id, True) for op in ops)
        except Exception:  # noqa: BLE001
            logger.exception("KV offload: writing failed")
        finally:
            for op_id, ok in results.items():
                self._done.put(("write", op_id, ok))

    def _record_io(self, kind: str, tier_name: str, num_blocks: int, seconds: float) -> None:
        with self._io_guard:
            nbytes = self._io.bytes_stored if kind == "stored" else self._io.bytes_loaded
            latencies = self._io.store_seconds if kind == "stored" else self._io.load_seconds
            nbytes[tier_name] = nbytes.get(tier_name, 0) + num_blocks * self.block_bytes
            latencies.setdefault(tier_name, []).append(seconds)

    # ---- reporting --------------------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        return bool(self._pending_stores or self._pending_loads or self._num_thread_ops)

    def poll(self, wait: bool = False) -> KVTransferReport:
        """What finished since the last poll. wait: the step has nothing to compute, so
        wait up to IDLE_POLL_SECONDS for a transfer to finish rather than spin."""
        self._collect()
        if wait and self._report.is_empty and self.in_flight:
            try:
                self._handle(self._done.get(timeout=IDLE_POLL_SECONDS))
            except queue.Empty:
                pass
            self._collect()
        report, self._report = self._report, KVTransferReport()
        with self._io_guard:
            report.io, self._io = self._io, TierIOStats()
        for tier in self.lower:
            invalid = tier.stats().get("invalid_files", 0.0)
            if invalid > self._invalid_seen[tier.name]:
                report.io.invalid_files[tier.name] = int(invalid - self._invalid_seen[tier.name])
                self._invalid_seen[tier.name] = invalid
        return report

    def _collect(self) -> None:
        while True:
            try:
                self._handle(self._done.get_nowait())
            except queue.Empty:
                break
        still = []
        for store_id, event, start, slots, hashes in self._pending_stores:
            if event.query():
                self._finish_store(store_id, start, slots, hashes, event)
            else:
                still.append((store_id, event, start, slots, hashes))
        self._pending_stores = still
        waiting = []
        for counts, event, start in self._pending_loads:
            if event.query():
                self._finish_load(counts, start, event)
            else:
                waiting.append((counts, event, start))
        self._pending_loads = waiting

    def _handle(self, item: tuple) -> None:
        self._num_thread_ops -= 1
        if item[0] == "read":
            _, load, num_intact = item
            self._issue_load(load, num_intact)
        else:
            _, op_id, ok = item
            self._report.writes_done[op_id] = ok

    def close(self) -> None:
        """Stops the I/O threads (after what they were given), then closes the tiers
        and frees the CPU tier's slots (idempotent)."""
        self._finalizer()
        self._pending_stores, self._pending_loads = [], []


def _close_tiers(
    reader: _IOThread,
    writer: _IOThread,
    lower: list[KVTier],
    cpu: CpuTier,
    cuda_device: torch.device | None,
) -> None:
    try:
        reader.close()
        writer.close()
        if cuda_device is not None:
            torch.cuda.synchronize(cuda_device)  # no copy may still use the pinned slots
    finally:
        for tier in lower:
            try:
                tier.close()
            except Exception:  # noqa: BLE001 - the other tiers still close
                logger.exception("closing KV tier %s failed", tier.name)
        cpu.close()


def unique_names(tiers: list[KVTier]) -> None:
    """Gives each lower tier a distinct name (metrics are labelled by it)."""
    seen = {"cpu"}
    for tier in tiers:
        name, n = tier.name, 2
        while tier.name in seen:
            tier.name = f"{name}{n}"
            n += 1
        seen.add(tier.name)


def build_kv_offload(
    config, pool: KVCachePool, model_id: str, dtype: torch.dtype, device: torch.device
) -> tuple[KVCopyEngine, OffloadInventory]:
    """The copy engine over the tiers the cache config asks for, and their inventory."""
    from pagoda.kv_offload.disk_tier import DiskTier

    cache = config.cache
    layout = BlockLayout(pool.config.layer_specs)
    fmt = KVBlockFormat(
        model_id,
        str(dtype).removeprefix("torch."),
        pool.block_size,
        layout.description,
        layout.block_bytes,
    )
    num_slots = int(cache.kv_offloading_size * GIB) // layout.block_bytes
    if num_slots < 1:
        raise ValueError(
            f"--kv-offloading-size {cache.kv_offloading_size} GiB holds no KV block "
            f"of {layout.block_bytes} bytes"
        )
    lower: list[KVTier] = []
    try:
        if cache.kv_offloading_disk_path is not None:
            lower.append(
                DiskTier(
                    fmt, cache.kv_offloading_disk_path, int(cache.kv_offloading_disk_size * GIB)
                )
            )
        if cache.kv_offloading_tier is not None:
            lower.append(load_tier_plugin(cache.kv_offloading_tier, fmt))
    except BaseException:
        for tier in lower:
            tier.close()
        raise
    unique_names(lower)
    cpu = CpuTier(num_slots, layout.block_bytes, pin_memory=device.type == "cuda")
    engine = KVCopyEngine(pool, layout, cpu, lower, device)
    inventory = OffloadInventory(
        tiers=[TierInventory(cpu.name, num_slots, [])]
        + [TierInventory(t.name, t.capacity_blocks(), list(t.contents())) for t in lower],
        max_blocks_per_step=max(1, MAX_TRANSFER_BYTES_PER_STEP // layout.block_bytes),
        block_bytes=layout.block_bytes,
        max_inline_blocks_per_step=MAX_INLINE_LOAD_BYTES_PER_STEP // layout.block_bytes,
    )
    return engine, inventory
