"""The KV tiers' cost model (no torch), exactly: running rates, the cut between loaded
and recomputed blocks for given bandwidths and prefill rate, exploration of a tier that
keeps losing, pinned figures; and the KVOffloadManager using it: skipped hits counted
per tier, the load plan holding only the blocks that pay, the step timing and the
worker's load timings feeding the estimates."""

import math

import pytest

from pagoda.core.block_hash import extend_block_hashes
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.outputs import SchedulerOutput
from pagoda.core.request import Request
from pagoda.kv_offload.planning.cost import (
    DEFAULT_LOAD_BYTES_PER_S,
    DEFAULT_PREFILL_TOKENS_PER_S,
    PREFILL_SAMPLE_MIN_TOKENS,
    LoadCostModel,
    RunningRate,
)
from pagoda.kv_offload.planning.manager import KVOffloadManager
from pagoda.kv_offload.planning.tiers import KVTransferReport, TierIndex, TierIOStats, TierStack
from pagoda.sampling_params import SamplingParams

MB = 1 << 20


def model(prefill=(1000, 1.0), cpu=(8 * MB, 1.0), disk=(MB, 1.0), explore_every=0, **kw):
    """Blocks of 1 MiB and 16 tokens. Defaults: recompute 16 ms a block; load 125 ms
    from the CPU tier, 1 s + 125 ms from disk."""
    samples = {"cpu": cpu, "disk": disk}
    return LoadCostModel(
        ["cpu", "disk"],
        MB,
        16,
        prefill,
        {k: v for k, v in samples.items() if v is not None},
        explore_every=explore_every,
        **kw,
    )


def test_running_rate_is_a_decayed_ratio_seeded_until_measured():
    rate = RunningRate(100.0, decay=0.25)
    assert rate.value == 100.0 and not rate.measured
    rate.observe(0, 1.0)  # nothing moved: not a measurement
    rate.observe(10, 0.0)
    assert not rate.measured
    rate.observe(40, 2.0)  # the seed is replaced, not averaged
    assert rate.value == 20.0 and rate.measured
    rate.observe(10, 0.5)  # (40 * 0.75 + 10) / (2 * 0.75 + 0.5)
    assert (rate.amount, rate.seconds, rate.value) == (40.0, 2.0, 20.0)
    rate.observe(24, 0.5)  # (40 * 0.75 + 24) / (2 * 0.75 + 0.5) = 54 / 2
    assert rate.value == 27.0
    pinned = RunningRate(5.0, decay=0.25, pinned=True)
    pinned.observe(100, 1.0)
    assert pinned.value == 5.0
    with pytest.raises(ValueError, match="must be > 0"):
        RunningRate(0.0, decay=0.25)


def test_costs_per_block():
    m = model(prefill=(1600, 1.0), cpu=(16 * MB, 1.0), disk=(4 * MB, 1.0))
    assert m.recompute_seconds() == 0.01  # 16 tokens at 1,600 tokens/s
    assert m.load_seconds(0) == 1 / 16
    assert m.load_seconds(1) == 1 / 4 + 1 / 16  # disk, then on through a CPU slot


def test_the_cut_loads_only_blocks_that_beat_recompute():
    # Recompute 16 tokens at 160 tokens/s: 0.1 s a block. CPU loads 0.0625 s, disk
    # 0.25 + 0.0625 s: a CPU block saves 0.0375 s, a disk block loses 0.2125 s.
    m = model(prefill=(160, 1.0), cpu=(16 * MB, 1.0), disk=(4 * MB, 1.0))
    assert m.choose([0, 0, 0]).num_load == 3
    decision = m.choose([0, 0, 1, 1])
    assert decision.num_load == 2 and decision.skipped == {1: 2}
    assert decision.load_seconds == 0.125 and decision.recompute_seconds == 0.2
    # Loading through a disk block pays only when enough CPU blocks follow it. Five
    # do not: 0.0375 - 0.2125 + 5 * 0.0375 = 0.0125 saved, less than stopping after
    # block 0 (0.0375); ten do: 0.2 saved.
    decision = m.choose([0, 1, 0, 0, 0, 0, 0])
    assert decision.num_load == 1 and decision.skipped == {1: 1, 0: 5}
    assert m.choose([0, 1] + [0] * 10).num_load == 12
    assert m.choose([1, 0, 0]).num_load == 0  # nothing pays: everything recomputed


def test_a_tie_recomputes_and_a_faster_disk_loads():
    # Recompute 0.125 s a block == a CPU load: not strictly faster, not loaded.
    m = model(prefill=(128, 1.0), cpu=(8 * MB, 1.0))
    assert m.choose([0, 0]).num_load == 0
    fast = model(prefill=(1000, 1.0), cpu=(1000 * MB, 1.0), disk=(500 * MB, 1.0))
    assert fast.choose([0, 1, 1]).num_load == 3  # 16 ms recompute vs 3 ms disk load


def test_defaults_until_measured_and_pinned_figures():
    m = LoadCostModel(["cpu", "disk"], MB, 16)
    assert m.prefill.value == DEFAULT_PREFILL_TOKENS_PER_S
    assert [r.value for r in m.bandwidth] == [
        DEFAULT_LOAD_BYTES_PER_S["cpu"],
        DEFAULT_LOAD_BYTES_PER_S["disk"],
    ]
    plugin = LoadCostModel(["cpu", "dict"], MB, 16)
    assert plugin.bandwidth[1].value == DEFAULT_LOAD_BYTES_PER_S["disk"]
    pinned = model(prefill=(16, 1.0), pinned_bytes_per_s={"disk": math.inf})
    assert pinned.bandwidth[1].pinned and pinned.load_seconds(1) == 0.125  # the CPU leg only
    pinned.observe_load("disk", MB, 100.0)
    assert pinned.bandwidth[1].value == math.inf
    with pytest.raises(ValueError, match="names tier\\(s\\) nvme; the tiers are cpu, disk"):
        model(pinned_bytes_per_s={"nvme": 1e9})


def test_observations_move_the_estimates():
    m = model(prefill=(1000, 1.0))
    m.observe_prefill(PREFILL_SAMPLE_MIN_TOKENS - 1, 0.001)  # a decode step: not sampled
    assert m.prefill.value == 1000.0
    m.observe_prefill(3000, 0.5)  # (1000 * 0.875 + 3000) / (1 * 0.875 + 0.5)
    assert m.prefill.value == 3875 / 1.375
    m.observe_load("disk", 3 * MB, 1.0)  # (1 * 0.75 + 3) / (1 * 0.75 + 1) MiB/s
    assert m.bandwidth[1].value == 3.75 * MB / 1.75
    m.observe_load("elsewhere", MB, 1.0)  # not a tier of this model: ignored
    assert m.snapshot() == {
        "prefill_tokens_per_s": 3875 / 1.375,
        "load_bytes_per_s": {"cpu": 8.0 * MB, "disk": 3.75 * MB / 1.75},
    }


def test_a_tier_that_keeps_losing_is_loaded_whole_every_explore_every_decisions():
    m = model(prefill=(160, 1.0), cpu=(16 * MB, 1.0), disk=(4 * MB, 1.0), explore_every=3)
    first, second = m.choose([0, 1]), m.choose([1])
    assert (first.num_load, second.num_load) == (1, 0)
    assert m.choose([0, 0]).num_load == 2  # no disk block: the streak is untouched
    third = m.choose([0, 1, 1])
    assert third.num_load == 3 and third.explored and not third.skipped
    assert m.choose([1]).num_load == 0  # the streak starts again
    pinned = model(
        prefill=(160, 1.0),
        cpu=(16 * MB, 1.0),
        disk=None,
        explore_every=1,
        pinned_bytes_per_s={"disk": 1.0},
    )
    assert [pinned.choose([1]).num_load for _ in range(3)] == [0, 0, 0]  # never explored


# ---- the manager ---------------------------------------------------------------------

BS = 16


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def offload_with(cost, clock=None):
    manager = KVCacheManager(16, BS)
    tiers = TierStack([TierIndex("cpu", 8, slotted=True), TierIndex("disk", 8, slotted=False)])
    return KVOffloadManager(manager, tiers, 64, cost, clock or Clock())


def test_start_load_plans_only_the_blocks_worth_loading(caplog):
    # CPU loads beat recompute, disk loads lose: of a hit [cpu, cpu, disk, disk] the
    # job carries the two CPU blocks; the disk ones are counted skipped and stay there.
    offload = offload_with(model(prefill=(160, 1.0), cpu=(16 * MB, 1.0), disk=(4 * MB, 1.0)))
    cpu, disk = offload.tiers.tiers
    r = Request("r", list(range(5 * BS)), SamplingParams(max_tokens=2))
    extend_block_hashes(r, BS)
    for block_hash in r.block_hashes[:2]:
        cpu.reserve(block_hash, ready=True)
        cpu.unpin(block_hash)
    disk.add_ready(r.block_hashes[2:4])
    with caplog.at_level("DEBUG", logger="pagoda.kv_offload.planning.manager"):
        assert offload.start_load(r, [])
    assert caplog.messages == [
        "request r: 2 of 4 tier hits recomputed (disk 2): a block loads in "
        "cpu 62.50 ms, disk 312.50 ms, recomputes in 100.00 ms"
    ]
    (job,) = offload.take_plan().loads
    assert job.cpu_slots == [0, 1] and job.reads == [] and len(job.gpu_block_ids) == 2
    assert (cpu.counters.hits, disk.counters.hits) == (2, 2)
    assert (cpu.counters.skipped, disk.counters.skipped) == (0, 2)
    assert (cpu.counters.loaded, disk.counters.loaded) == (2, 0)
    stats = {row["tier"]: row for row in offload.stats()}
    assert stats["disk"]["skipped_blocks"] == 2 and stats["disk"]["est_load_bytes_per_s"] == 4 * MB
    assert stats["cpu"]["est_prefill_tokens_per_s"] == 160.0
    offload.audit()


def test_a_hit_only_on_a_slow_tier_starts_no_load():
    offload = offload_with(model(prefill=(160, 1.0), cpu=(16 * MB, 1.0), disk=(4 * MB, 1.0)))
    r = Request("r", list(range(3 * BS)), SamplingParams(max_tokens=2))
    extend_block_hashes(r, BS)
    offload.tiers.tiers[1].add_ready(r.block_hashes[:2])
    assert not offload.start_load(r, [])  # admitted now, recomputing its prefix
    assert offload.tiers.tiers[1].counters.skipped == 2 and offload.take_plan() is None
    offload.audit()


def step(tokens: int) -> SchedulerOutput:
    return SchedulerOutput([], [], {"x": tokens}, tokens)


def test_step_timing_and_load_reports_feed_the_estimates():
    clock = Clock()
    offload = offload_with(model(prefill=(1000, 1.0)), clock)
    prefill = offload.cost.prefill
    a, b, c = step(512), step(512), step(4)
    clock.now = 1.0
    offload.step_scheduled(a)
    clock.now = 1.25
    offload.step_scheduled(b)  # async scheduling: b is built while a runs
    clock.now = 1.5
    offload.step_done(a)  # a: from 1.0 to 1.5
    assert (prefill.amount, prefill.seconds) == (1000 * 0.875 + 512, 0.875 + 0.5)
    clock.now = 1.75
    offload.step_done(b)  # b started when a's results came: 1.5 to 1.75
    assert (prefill.amount, prefill.seconds) == (
        (1000 * 0.875 + 512) * 0.875 + 512,
        (0.875 + 0.5) * 0.875 + 0.25,
    )
    before = (prefill.amount, prefill.seconds)
    clock.now = 5.0  # idle, then a small step: timed from its scheduling, not sampled
    offload.step_scheduled(c)
    clock.now = 5.5
    offload.step_done(c)
    assert (prefill.amount, prefill.seconds) == before
    offload.apply_report(
        KVTransferReport(
            io=TierIOStats(bytes_loaded={"disk": 3 * MB}, load_seconds={"disk": [0.25, 0.75]})
        )
    )
    assert offload.cost.bandwidth[1].value == 3.75 * MB / 1.75
