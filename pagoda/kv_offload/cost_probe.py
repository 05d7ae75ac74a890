"""Start-up measurements for the KV tiers' cost model (pagoda/kv_offload/planning/cost.py): what one
prefill forward computes per second, what the CPU tier loads per second (slots -> pool
blocks, the copy engine's own path), and what each lower tier reads per second on
blocks it kept from an earlier run (its own `load`, checksums included).

They seed the engine's running estimates, so the first request after a start, a warm
disk tier's restart hit above all, is weighed against real figures rather than
defaults. Run once, when the engine asks for the offload inventory: after the kernel
warm-up, before any request. The pool blocks and CPU slots written here hold nothing
anybody reads: a pool block is read only after a forward or a load wrote it for its
request, a CPU slot only once the bookkeeping has put a block there (as with the
warm-up, pagoda/worker/warmup.py). A tier whose bandwidth the user pinned
(kv_offloading_bandwidth) is not measured.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from pagoda.attention.forward_context import forward_context
from pagoda.attention.metadata import build_attention_metadata
from pagoda.config import parse_tier_bandwidths
from pagoda.kv_offload.copy_engine import KVCopyEngine, OffloadInventory, TierInventory

logger = logging.getLogger(__name__)

PROBE_MAX_TOKENS = 1024  # one prefill forward of at most this many tokens
PROBE_MAX_BLOCKS = 64  # blocks moved per tier probe, at most
PROBE_MAX_BYTES = 256 << 20  # and bytes


def _timed(device: torch.device, fn: Callable[[], object]) -> float:
    """Seconds fn's work takes, the device's queue drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


@torch.inference_mode()
def prefill_sample(runner, num_tokens: int) -> tuple[int, float]:
    """(tokens, seconds) of one prefill forward of num_tokens tokens on pool blocks
    0.. (on CUDA the second of two runs: the first may meet a new GEMM shape)."""
    bs, device = runner.block_size, runner.device
    table = list(range(-(-num_tokens // bs)))
    metadata = build_attention_metadata([num_tokens], [num_tokens], [table], bs, device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device)

    def forward() -> None:
        with forward_context(
            runner.backend, runner.backend.build_metadata(metadata), runner.kv_pool
        ):
            hidden = runner.model(ids, positions)
        runner.model.compute_logits(hidden[-1:])

    if device.type == "cuda":
        forward()
    return num_tokens, _timed(device, forward)


def cpu_load_sample(engine: KVCopyEngine, num_pool_blocks: int) -> tuple[int, float]:
    """(bytes, seconds) of copying CPU slots 0.. into pool blocks 0.. (after one block to
    warm the path up)."""
    n = min(
        engine.cpu.capacity_blocks(),
        num_pool_blocks,
        PROBE_MAX_BLOCKS,
        max(1, PROBE_MAX_BYTES // engine.block_bytes),
    )
    engine._copy_slots_to_pool([0], [0])
    seconds = _timed(
        engine.device, lambda: engine._copy_slots_to_pool(list(range(n)), list(range(n)))
    )
    return n * engine.block_bytes, seconds


def lower_load_sample(engine: KVCopyEngine, tier) -> tuple[int, float] | None:
    """(bytes, seconds) of the tier reading its most recent blocks into CPU slots 0..;
    None when it holds none (or none reads back intact)."""
    held = tier.contents()
    n = min(
        len(held),
        engine.cpu.capacity_blocks(),
        PROBE_MAX_BLOCKS,
        max(1, PROBE_MAX_BYTES // engine.block_bytes),
    )
    if n == 0:
        return None
    hashes = held[-n:]
    rows = [engine.cpu.row(slot) for slot in range(n)]
    start = time.perf_counter()
    got = tier.load(hashes, rows)
    seconds = time.perf_counter() - start
    return (got * engine.block_bytes, seconds) if got else None


def measure_start_rates(runner, inventory: OffloadInventory) -> OffloadInventory:
    """The inventory with the start-up samples, and the lower tiers' contents listed
    again (a probe read that found a block corrupt drops it)."""
    engine: KVCopyEngine = runner.kv_offload
    cache, sched = runner.config.cache, runner.config.scheduler
    pinned = (
        parse_tier_bandwidths(cache.kv_offloading_bandwidth)
        if cache.kv_offloading_bandwidth
        else {}
    )
    num_tokens = min(
        PROBE_MAX_TOKENS,
        sched.max_num_batched_tokens,
        runner.arch.max_position_embeddings,
        runner.num_blocks * runner.block_size,
    )
    prefill = prefill_sample(runner, num_tokens)
    samples: dict[str, tuple[int, float]] = {}
    if engine.cpu.name not in pinned:
        samples[engine.cpu.name] = cpu_load_sample(engine, runner.num_blocks)
    for tier in engine.lower:
        if tier.name not in pinned:
            sample = lower_load_sample(engine, tier)
            if sample is not None:
                samples[tier.name] = sample
    logger.info(
        "KV tiers' cost model at start-up: prefill %.0f tokens/s; load %s",
        prefill[0] / prefill[1],
        ", ".join(f"{name} {b / s / 1e9:.2f} GB/s" for name, (b, s) in samples.items())
        or "all pinned",
    )
    tiers = [inventory.tiers[0]] + [
        TierInventory(t.name, t.capacity_blocks(), list(t.contents())) for t in engine.lower
    ]
    return dataclasses.replace(inventory, tiers=tiers, prefill_sample=prefill, load_samples=samples)
