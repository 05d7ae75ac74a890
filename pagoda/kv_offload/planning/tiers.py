"""Bookkeeping of the KV offload tiers below GPU memory (no torch): which block hashes
each tier holds, in what LRU order, in which slot, and which of them a transfer in
flight still needs; plus the typed plan the worker executes and the report it sends back.

Tiers form a stack: tier 0 is host (CPU) memory, a tensor of numbered slots that is
the hub of every transfer; tiers 1.. (disk, an out-of-tree plugin) are keyed by hash
alone. Data only moves GPU <-> CPU slot (the worker's copy engine) and CPU slot <->
lower tier (the worker's I/O threads):
- a block evicted from the GPU prefix cache is stored to a CPU slot, and written
  through from that slot to every lower tier lacking it;
- a block found only in a lower tier is read into a CPU slot, then loaded to the GPU.

Entry states, per tier and hash:
- ready: may be read (a CPU slot whose GPU->CPU copy is still queued counts as ready:
  any load from it is queued behind that copy on the same copy stream);
- pending: its data is still being written (a lower-tier write, or a read into a CPU
  slot); invisible to lookups.
Every transfer in flight pins the entries it reads or writes (pins > 0); pinned entries
are never evicted, so a slot or file is never reused while a transfer uses it. A pin is
taken when the transfer is planned and dropped when the worker reports it done.

LRU: `entries` is ordered from least to most recently used; a lookup hit and a store
make an entry most recent; eviction takes the least recent unpinned ready entry.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pagoda.core.block_hash import BlockHash


def _fail(message: str) -> None:
    raise AssertionError(f"kv tier audit failed: {message}")


@dataclass
class TierEntry:
    slot: int  # the CPU tier's slot; -1 in a keyed tier
    ready: bool
    pins: int = 0


@dataclass
class TierCounters:
    """Monotonic counters of one tier, in blocks (bytes are counted by the worker)."""

    queries: int = 0  # blocks looked up in this tier (not found in a tier above)
    hits: int = 0  # of those, found here
    skipped: int = 0  # hits not loaded: recomputing them was expected to be faster
    stored: int = 0  # blocks written into this tier
    loaded: int = 0  # blocks read out of this tier towards the GPU
    evicted: int = 0  # blocks dropped to make room
    dropped: int = 0  # stores given up: no unpinned room (all in flight) or per-step cap
    failed_reads: int = 0  # reads that found the block corrupt or gone


class TierIndex:
    """One tier: hash -> entry, LRU order, capacity in blocks, slots when `slotted`."""

    def __init__(self, name: str, capacity: int, slotted: bool) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(
                f"tier {name!r}: capacity must be an integer >= 1 block, got {capacity!r}"
            )
        self.name = name
        self.capacity = capacity
        self.slotted = slotted
        self.entries: OrderedDict[BlockHash, TierEntry] = OrderedDict()
        # Lowest slot first, so a batch of stores tends to take a contiguous run.
        self._free_slots: list[int] = list(range(capacity)) if slotted else []
        self.counters = TierCounters()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, block_hash: BlockHash) -> bool:
        """Held, ready or pending."""
        return block_hash in self.entries

    def is_ready(self, block_hash: BlockHash) -> bool:
        entry = self.entries.get(block_hash)
        return entry is not None and entry.ready

    def entry(self, block_hash: BlockHash) -> TierEntry:
        return self.entries[block_hash]

    def touch(self, block_hash: BlockHash) -> None:
        """Makes the entry most recently used."""
        self.entries.move_to_end(block_hash)

    def reserve(
        self, block_hash: BlockHash, ready: bool
    ) -> tuple[TierEntry, list[BlockHash]] | None:
        """Makes room for a new entry (pinned once, most recent) and returns it with the
        hashes evicted for it; None, changing nothing, when every entry is pinned."""
        if block_hash in self.entries:
            raise ValueError(f"tier {self.name!r} already holds {block_hash.hex()[:12]}")
        evicted: list[BlockHash] = []
        if len(self.entries) >= self.capacity:
            victim = self._lru_unpinned()
            if victim is None:
                return None
            self.remove(victim)
            self.counters.evicted += 1
            evicted.append(victim)
        slot = heapq.heappop(self._free_slots) if self.slotted else -1
        entry = TierEntry(slot=slot, ready=ready, pins=1)
        self.entries[block_hash] = entry
        return entry, evicted

    def _lru_unpinned(self) -> BlockHash | None:
        for block_hash, entry in self.entries.items():
            if entry.pins == 0:
                return block_hash
        return None

    def pin(self, block_hash: BlockHash) -> None:
        self.entries[block_hash].pins += 1

    def unpin(self, block_hash: BlockHash) -> None:
        entry = self.entries[block_hash]
        if entry.pins < 1:
            raise ValueError(f"tier {self.name!r}: unpin of unpinned {block_hash.hex()[:12]}")
        entry.pins -= 1

    def commit(self, block_hash: BlockHash) -> None:
        """A pending entry's data is in place: ready, and its writer's pin dropped."""
        entry = self.entries[block_hash]
        entry.ready = True
        self.unpin(block_hash)

    def remove(self, block_hash: BlockHash) -> None:
        """Forgets the entry (evicted, or its data found corrupt), freeing its slot."""
        entry = self.entries.pop(block_hash)
        if self.slotted:
            heapq.heappush(self._free_slots, entry.slot)

    def add_ready(self, block_hashes: Iterable[BlockHash]) -> int:
        """Seeds a keyed tier with what it already holds (a disk tier after a restart),
        oldest first; stops at capacity. Returns how many were added."""
        if self.slotted:
            raise ValueError("only a keyed tier starts with contents")
        added = 0
        for block_hash in block_hashes:
            if len(self.entries) >= self.capacity:
                break
            if block_hash not in self.entries:
                self.entries[block_hash] = TierEntry(slot=-1, ready=True)
                added += 1
        return added

    def audit(self, expected_pins: dict[BlockHash, int]) -> None:
        """Raises AssertionError unless capacity, slots and pins are consistent; every
        pin must be one a transfer in flight accounts for (expected_pins)."""
        if len(self.entries) > self.capacity:
            _fail(f"{self.name}: {len(self.entries)} entries over capacity {self.capacity}")
        if self.slotted:
            used = [entry.slot for entry in self.entries.values()]
            if len(set(used)) != len(used):
                _fail(f"{self.name}: a slot is held by two hashes")
            if (
                set(used) & set(self._free_slots)
                or len(used) + len(self._free_slots) != self.capacity
            ):
                _fail(
                    f"{self.name}: used {len(used)} + free {len(self._free_slots)} slots "
                    f"!= capacity {self.capacity}, or a slot is both"
                )
        for block_hash, entry in self.entries.items():
            want = expected_pins.get(block_hash, 0)
            if entry.pins != want:
                _fail(
                    f"{self.name}: {block_hash.hex()[:12]} has {entry.pins} pins, "
                    f"transfers in flight account for {want}"
                )
            if not entry.ready and entry.pins == 0:
                _fail(f"{self.name}: pending {block_hash.hex()[:12]} has no transfer in flight")
        for block_hash in expected_pins:
            if block_hash not in self.entries:
                _fail(f"{self.name}: a transfer in flight uses {block_hash.hex()[:12]}, not held")


class TierStack:
    """The tiers below the GPU, top (CPU) first, and the cross-tier lookup."""

    def __init__(self, tiers: Sequence[TierIndex]) -> None:
        if not tiers or not tiers[0].slotted or any(t.slotted for t in tiers[1:]):
            raise ValueError("the tier stack is one slotted CPU tier, then keyed tiers")
        self.tiers = list(tiers)

    @property
    def cpu(self) -> TierIndex:
        return self.tiers[0]

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """The longest prefix of block_hashes that some tier holds ready: for each of
        its blocks, the highest tier holding it. Counts queries and hits per tier (a
        block missed everywhere is a query of every tier)."""
        found: list[int] = []
        for block_hash in block_hashes:
            source = None
            for index, tier in enumerate(self.tiers):
                tier.counters.queries += 1
                if tier.is_ready(block_hash):
                    tier.counters.hits += 1
                    source = index
                    break
            if source is None:
                break
            found.append(source)
        return found


# ------------------------------------------------------------------ the worker's plan


@dataclass
class TierWrite:
    """Copy CPU slot `cpu_slot` (its data: block `block_hash`) into lower tier `tier`."""

    op_id: int
    tier: int
    block_hash: bytes
    cpu_slot: int


@dataclass
class TierRead:
    """Read block `block_hash` from lower tier `tier` into CPU slot `cpu_slot`."""

    tier: int
    block_hash: bytes
    cpu_slot: int


@dataclass
class LoadJob:
    """Bring blocks back to the GPU: block i of the job goes from CPU slot cpu_slots[i]
    to GPU block gpu_block_ids[i]. `reads` first fill some of those slots from lower
    tiers (in block order). The job is done once every intact leading block is on the
    GPU; the worker reports how many leading blocks are intact (a failed read stops it).

    inline: the blocks all come from CPU slots (no reads) and the worker copies them on
    the compute stream before this step's forward, so this very step may read them
    (the scheduler registers them at once); the report then only releases the slots."""

    job_id: int
    cpu_slots: list[int]
    gpu_block_ids: list[int]
    reads: list[TierRead] = field(default_factory=list)
    inline: bool = False


@dataclass
class KVTransferPlan:
    """What one step asks the worker to move. Order of execution on the worker:
    stores (GPU -> CPU, gathered before this step's forward), then loads, whose
    reads go to the I/O thread; writes and evictions go to the I/O thread after the
    stores they read from.

    store_id names this step's batch of stores (None: none); `poll` asks only for a
    report of transfers done (sent while some are in flight)."""

    store_id: int | None = None
    store_gpu_block_ids: list[int] = field(default_factory=list)
    store_cpu_slots: list[int] = field(default_factory=list)
    store_hashes: list[bytes] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)
    writes: list[TierWrite] = field(default_factory=list)
    # (tier, hash): drop the block from a lower tier (LRU eviction).
    evictions: list[tuple[int, bytes]] = field(default_factory=list)
    poll: bool = False

    @property
    def has_work(self) -> bool:
        return bool(self.store_gpu_block_ids or self.loads or self.writes or self.evictions)

    @property
    def is_empty(self) -> bool:
        return not self.has_work and not self.poll


@dataclass
class TierIOStats:
    """Bytes moved and transfer latencies the worker measured, per tier name, since its
    last report (the engine accumulates them for the metrics)."""

    bytes_stored: dict[str, int] = field(default_factory=dict)
    bytes_loaded: dict[str, int] = field(default_factory=dict)
    store_seconds: dict[str, list[float]] = field(default_factory=dict)
    load_seconds: dict[str, list[float]] = field(default_factory=dict)
    # Files found corrupt, truncated or foreign (the disk tier), by tier name.
    invalid_files: dict[str, int] = field(default_factory=dict)

    def merge(self, other: TierIOStats) -> None:
        for counts, more in (
            (self.bytes_stored, other.bytes_stored),
            (self.bytes_loaded, other.bytes_loaded),
            (self.invalid_files, other.invalid_files),
        ):
            for name, value in more.items():
                counts[name] = counts.get(name, 0) + value
        for times, later in (
            (self.store_seconds, other.store_seconds),
            (self.load_seconds, other.load_seconds),
        ):
            for name, values in later.items():
                times.setdefault(name, []).extend(values)


@dataclass
class KVTransferReport:
    """What the worker finished since its last report."""

    stores_done: list[int] = field(default_factory=list)  # store_ids
    loads_done: dict[int, int] = field(default_factory=dict)  # job_id -> intact leading blocks
    writes_done: dict[int, bool] = field(default_factory=dict)  # op_id -> succeeded
    io: TierIOStats = field(default_factory=TierIOStats)

    @property
    def is_empty(self) -> bool:
        return not (self.stores_done or self.loads_done or self.writes_done)

    def merge(self, other: KVTransferReport) -> None:
        """Adds a later report (one not handed out yet must never be lost)."""
        self.stores_done.extend(other.stores_done)
        self.loads_done.update(other.loads_done)
        self.writes_done.update(other.writes_done)
        self.io.merge(other.io)


# ------------------------------------------------------------------ metrics

TRANSFER_SECONDS_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class LatencyHistogram:
    """Cumulative histogram with fixed buckets, as Prometheus exposes it."""

    def __init__(self, buckets: tuple[float, ...] = TRANSFER_SECONDS_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # observations <= each bound (cumulative)
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.sum += seconds
        for index, bound in enumerate(self.buckets):
            if seconds <= bound:
                self.counts[index] += 1

    def snapshot(self) -> dict:
        return {
            "buckets": list(self.buckets),
            "cumulative_counts": list(self.counts),
            "count": self.count,
            "sum": self.sum,
        }


@dataclass
class TierIOTotals:
    """What the worker reported for one tier, accumulated since start-up."""

    bytes_stored: int = 0
    bytes_loaded: int = 0
    invalid_files: int = 0
    store_seconds: LatencyHistogram = field(default_factory=LatencyHistogram)
    load_seconds: LatencyHistogram = field(default_factory=LatencyHistogram)


def accumulate_io(totals: dict[str, TierIOTotals], io: TierIOStats) -> None:
    for name, value in io.bytes_stored.items():
        totals.setdefault(name, TierIOTotals()).bytes_stored += value
    for name, value in io.bytes_loaded.items():
        totals.setdefault(name, TierIOTotals()).bytes_loaded += value
    for name, value in io.invalid_files.items():
        totals.setdefault(name, TierIOTotals()).invalid_files += value
    for name, values in io.store_seconds.items():
        for seconds in values:
            totals.setdefault(name, TierIOTotals()).store_seconds.observe(seconds)
    for name, values in io.load_seconds.items():
        for seconds in values:
            totals.setdefault(name, TierIOTotals()).load_seconds.observe(seconds)


def tier_snapshot(tier: TierIndex, io: TierIOTotals) -> dict:
    """One tier's figures for EngineStats and the metrics (plain data)."""
    counters = tier.counters
    return {
        "tier": tier.name,
        "capacity_blocks": tier.capacity,
        "blocks": len(tier),
        "usage": len(tier) / tier.capacity,
        "queries": counters.queries,
        "hits": counters.hits,
        "stored_blocks": counters.stored,
        "loaded_blocks": counters.loaded,
        "skipped_blocks": counters.skipped,
        "evicted_blocks": counters.evicted,
        "dropped_blocks": counters.dropped,
        "failed_reads": counters.failed_reads,
        "bytes_stored": io.bytes_stored,
        "bytes_loaded": io.bytes_loaded,
        "invalid_files": io.invalid_files,
        "store_seconds": io.store_seconds.snapshot(),
        "load_seconds": io.load_seconds.snapshot(),
    }
