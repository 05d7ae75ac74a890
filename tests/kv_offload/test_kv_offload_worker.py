"""The worker side of the KV offload tiers on CPU: the copy engine's batched copies
between the pool and the CPU tier, the disk tier's files (restart, corruption, size
cap, lock, read-only directory) and loading a plugin tier by module path."""

import os
import pathlib
import shutil
import tempfile

import pytest
import torch

from pagoda.attention.kv_pool import KVCachePool
from pagoda.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig, MLAAttentionSpec
from pagoda.kv_offload.copy_engine import KVCopyEngine, _runs
from pagoda.kv_offload.cpu_tier import BlockLayout, CpuTier
from pagoda.kv_offload.disk_tier import LOCK_NAME, DiskTier, DiskTierError
from pagoda.kv_offload.planning.tiers import KVTransferPlan, LoadJob, TierRead, TierWrite
from pagoda.kv_offload.tier_api import KVBlockFormat, load_tier_plugin

SPECS = [FullAttentionSpec(4, 2, 8, "float32"), FullAttentionSpec(4, 2, 8, "float32")]
BLOCK_BYTES = 2 * (2 * 4 * 2 * 8 * 4)
MIXED = [FullAttentionSpec(4, 2, 8, "float32"), MLAAttentionSpec(4, 12, 4, "float16")]


def fmt(model_id="tiny") -> KVBlockFormat:
    return KVBlockFormat(model_id, "float32", 4, BlockLayout(SPECS).description, BLOCK_BYTES)


def block(seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def key(n: int) -> bytes:
    return n.to_bytes(32, "big")


def test_layout_and_runs():
    layout = BlockLayout(SPECS)
    assert layout.block_bytes == BLOCK_BYTES
    assert layout.description == "2x[full:2x4x2x8:float32]"
    mixed = BlockLayout(MIXED)
    assert mixed.description == "1x[full:2x4x2x8:float32],1x[mla:4x16:float16]"
    assert mixed.block_bytes == 512 + 4 * 16 * 2
    assert [(p.offset, p.nbytes) for p in layout.pages] == [(0, 512), (512, 512)]
    assert _runs([3, 4, 5, 9, 2, 3]) == [(0, 3, 3), (3, 9, 1), (4, 2, 2)]


def make_engine(lower=(), specs=SPECS):
    pool = KVCachePool(KVCacheConfig(8, specs), "cpu")
    torch.manual_seed(0)
    for cache in pool.caches:
        cache.normal_()
    layout = BlockLayout(specs)
    cpu = CpuTier(6, layout.block_bytes, pin_memory=False)
    return pool, cpu, KVCopyEngine(pool, layout, cpu, list(lower), torch.device("cpu"))


@pytest.mark.parametrize("specs", [SPECS, MIXED], ids=["full", "full+mla"])
def test_copy_engine_stores_then_loads_blocks_exactly(specs):
    pool, cpu, engine = make_engine(specs=specs)
    block_bytes = engine.block_bytes
    original = [cache.clone() for cache in pool.caches]
    try:
        engine.execute(
            KVTransferPlan(
                store_id=7,
                store_gpu_block_ids=[3, 1, 5],
                store_cpu_slots=[0, 1, 4],
                store_hashes=[key(3), key(1), key(5)],
            )
        )
        report = engine.poll()
        assert report.stores_done == [7] and report.io.bytes_stored == {"cpu": 3 * block_bytes}
        assert cpu.lookup([key(3), key(1), key(5)]) == 3
        for cache in pool.caches:
            cache.zero_()
        engine.execute(KVTransferPlan(loads=[LoadJob(1, cpu_slots=[4, 0], gpu_block_ids=[6, 2])]))
        report = engine.poll()
        assert report.loads_done == {1: 2}
        for cache, before, page in zip(pool.caches, original, engine.layout.pages):
            cache, before = cache.movedim(page.block_dim, 0), before.movedim(page.block_dim, 0)
            assert torch.equal(cache[6], before[5]) and torch.equal(cache[2], before[3])
            assert not cache[[0, 1, 3, 4, 5, 7]].any()
    finally:
        engine.close()


def test_copy_engine_writes_through_and_reads_back_a_lower_tier(tmp_path):
    disk = DiskTier(fmt(), str(tmp_path), 1 << 20)
    pool, cpu, engine = make_engine([disk])
    original = pool.caches[0][:, 2].clone()
    try:
        engine.execute(
            KVTransferPlan(
                store_id=1,
                store_gpu_block_ids=[2],
                store_cpu_slots=[3],
                store_hashes=[key(2)],
                writes=[TierWrite(5, 1, key(2), 3)],
            )
        )
        engine.writer.close()  # drain: the write is done once the thread has stopped
        report = engine.poll()
        assert report.writes_done == {5: True} and disk.contents() == [key(2)]
        cpu.data.zero_()
        pool.caches[0].zero_()
        engine.reader.close()
        engine.reader = type(engine.writer)("test-read")
        engine.execute(KVTransferPlan(loads=[LoadJob(2, [0], [7], [TierRead(1, key(2), 0)])]))
        engine.reader.close()
        assert engine.poll().loads_done == {2: 1}
        assert torch.equal(pool.caches[0][:, 7], original)
    finally:
        engine.close()


def test_disk_tier_survives_a_restart_and_rejects_a_corrupt_block(tmp_path):
    disk = DiskTier(fmt(), str(tmp_path), 1 << 20)
    disk.store([key(1), key(2)], [block(1), block(2)])
    disk.close()
    disk = DiskTier(fmt(), str(tmp_path), 1 << 20)
    assert sorted(disk.contents()) == [key(1), key(2)]
    out = [torch.empty(BLOCK_BYTES, dtype=torch.uint8) for _ in range(2)]
    assert disk.load([key(1), key(2)], out) == 2
    assert torch.equal(out[0], block(1)) and torch.equal(out[1], block(2))
    path = disk._file(key(2))
    with open(path, "r+b") as f:  # flip one payload byte
        f.seek(-10, os.SEEK_END)
        byte = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    out[1].zero_()
    assert disk.load([key(1), key(2)], out) == 1
    assert disk.stats()["invalid_files"] == 1 and not os.path.exists(path)
    assert disk.contents() == [key(1)]
    disk.close()


def flip_payload_byte(path):
    with open(path, "r+b") as f:
        f.seek(-10, os.SEEK_END)
        byte = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_disk_tier_reads_a_batch_in_parallel_and_judges_only_the_first_failure(tmp_path):
    disk = DiskTier(fmt(), str(tmp_path), 1 << 20, io_threads=4)
    keys, blocks = [key(n) for n in range(6)], [block(n) for n in range(6)]
    disk.store(keys, blocks)  # written by the pool, one file each
    assert disk.contents() == keys and disk.stats()["writes"] == 6
    out = [torch.empty(BLOCK_BYTES, dtype=torch.uint8) for _ in range(6)]
    assert disk.load(keys, out) == 6
    assert all(torch.equal(o, b) for o, b in zip(out, blocks))
    flip_payload_byte(disk._file(key(2)))
    flip_payload_byte(disk._file(key(4)))
    os.remove(disk._file(key(5)))
    assert disk.load(keys, out) == 2
    stats = disk.stats()
    assert stats["invalid_files"] == 1 and stats["read_failures"] == 1 and stats["reads"] == 8
    assert not os.path.exists(disk._file(key(2)))  # the failure judged: dropped
    assert os.path.exists(disk._file(key(4)))  # after it: not loaded, so not judged
    assert disk.contents() == [key(n) for n in (0, 1, 3, 4, 5)]
    assert disk.load([key(5)], out[:1]) == 0  # gone: counted, nothing to delete
    assert disk.stats()["read_failures"] == 2 and disk.contents() == [key(n) for n in (0, 1, 3, 4)]
    with pytest.raises(ValueError, match="io_threads must be"):
        DiskTier(fmt(), str(tmp_path / "other"), 1 << 20, io_threads=0)
    disk.close()


def test_disk_tier_ignores_truncated_and_foreign_files_at_start_up(tmp_path):
    disk = DiskTier(fmt(), str(tmp_path), 1 << 20)
    disk.store([key(1), key(2)], [block(1), block(2)])
    disk.close()
    foreign = DiskTier(
        fmt("another-model"), str(tmp_path.parent / f"{tmp_path.name}-other"), 1 << 20
    )
    foreign.store([key(3)], [block(3)])
    foreign.close()
    os.replace(
        foreign._file(key(3)), os.path.join(tmp_path, key(3).hex()[:2], key(3).hex() + ".kvb")
    )
    truncated = disk._file(key(2))
    with open(truncated, "r+b") as f:
        f.truncate(os.path.getsize(truncated) - 1)
    disk = DiskTier(fmt(), str(tmp_path), 1 << 20)
    assert disk.contents() == [key(1)]
    assert disk.stats()["invalid_files"] == 2
    assert not os.path.exists(truncated)  # ours and broken: deleted
    assert os.path.exists(disk._file(key(3)))  # another model's: left alone
    disk.close()


def test_disk_tier_size_cap_keeps_the_most_recent_blocks(tmp_path):
    disk = DiskTier(fmt(), str(tmp_path), 1 << 20)
    for n in range(4):
        disk.store([key(n)], [block(n)])
        os.utime(disk._file(key(n)), (1000 + n, 1000 + n))
    disk.close()
    file_bytes = os.path.getsize(disk._file(key(0)))
    small = DiskTier(fmt(), str(tmp_path), 2 * (BLOCK_BYTES + 522))
    assert small.capacity_blocks() == 2 and file_bytes <= BLOCK_BYTES + 522
    assert small.contents() == [key(2), key(3)]
    assert not os.path.exists(small._file(key(0))) and not os.path.exists(small._file(key(1)))
    small.evict([key(2)])
    assert small.contents() == [key(3)] and not os.path.exists(small._file(key(2)))
    small.close()
    with pytest.raises(DiskTierError, match="hold no block"):
        DiskTier(fmt(), str(tmp_path), 100)


def test_disk_tier_lock_refuses_a_second_tier_of_this_process(tmp_path):
    first = DiskTier(fmt(), str(tmp_path), 1 << 20)
    with pytest.raises(DiskTierError, match=r"in use by this process.*LLM\.shutdown\(\)"):
        DiskTier(fmt(), str(tmp_path), 1 << 20)
    first.close()
    DiskTier(fmt(), str(tmp_path), 1 << 20).close()  # free again once closed
    assert os.path.exists(tmp_path / LOCK_NAME)


def test_disk_tier_read_only_directory_is_a_clear_start_up_error():
    base = pathlib.Path(tempfile.mkdtemp(prefix="pagoda-kv-ro-"))
    os.chmod(base, 0o755)  # reachable by the unprivileged identity below
    read_only = base / "ro"
    read_only.mkdir()
    os.chmod(read_only, 0o555)
    # root ignores permission bits: take an unprivileged identity for the check
    as_root = os.geteuid() == 0
    if as_root:
        os.seteuid(65534)
    try:
        with pytest.raises(DiskTierError, match="is not writable"):
            DiskTier(fmt(), str(read_only), 1 << 20)
        with pytest.raises(DiskTierError, match="cannot create the directory"):
            DiskTier(fmt(), str(read_only / "sub"), 1 << 20)
    finally:
        if as_root:
            os.seteuid(0)
        os.chmod(read_only, 0o755)
        shutil.rmtree(base)


def test_plugin_tier_is_loaded_by_module_path():
    from helpers import kv_tier_plugin

    tier = load_tier_plugin("helpers.kv_tier_plugin:DictTier", fmt())
    assert isinstance(tier, kv_tier_plugin.DictTier) and tier.format == fmt()
    tier.store([key(1)], [block(1)])
    out = torch.empty(BLOCK_BYTES, dtype=torch.uint8)
    assert tier.lookup([key(1), key(2)]) == 1 and tier.load([key(1)], [out]) == 1
    assert torch.equal(out, block(1))
    with pytest.raises(ValueError, match="module.path:ClassName"):
        load_tier_plugin("helpers.kv_tier_plugin.DictTier", fmt())
    with pytest.raises(ValueError, match="cannot import"):
        load_tier_plugin("no_such_module_here:DictTier", fmt())
    with pytest.raises(ValueError, match="not a subclass"):
        load_tier_plugin("helpers.kv_tier_plugin:NotATier", fmt())


def test_cpu_tier_by_hash():
    cpu = CpuTier(2, BLOCK_BYTES, pin_memory=False)
    cpu.store([key(1), key(2), key(3)], [block(1), block(2), block(3)])  # 3 evicts 1
    out = torch.empty(BLOCK_BYTES, dtype=torch.uint8)
    assert cpu.lookup([key(1)]) == 0 and cpu.lookup([key(2), key(3)]) == 2
    assert cpu.load([key(3)], [out]) == 1 and torch.equal(out, block(3))
    cpu.evict([key(2)])
    assert cpu.stats() == {"blocks": 1.0, "capacity": 2.0}


def test_start_up_probes_measure_the_cpu_and_lower_tiers_without_binding_slots(tmp_path):
    from pagoda.kv_offload.cost_probe import cpu_load_sample, lower_load_sample

    disk = DiskTier(fmt(), str(tmp_path), 1 << 20)
    pool, cpu, engine = make_engine([disk])
    try:
        num_bytes, seconds = cpu_load_sample(engine, num_pool_blocks=8)
        assert num_bytes == 6 * BLOCK_BYTES and seconds > 0  # every CPU slot, 6 < 8 blocks
        assert lower_load_sample(engine, disk) is None  # holds nothing yet
        disk.store([key(1), key(2), key(3)], [block(1), block(2), block(3)])
        num_bytes, seconds = lower_load_sample(engine, disk)
        assert num_bytes == 3 * BLOCK_BYTES and seconds > 0
        assert torch.equal(cpu.row(2), block(3)) and cpu.lookup([key(3)]) == 0  # not bound
        flip_payload_byte(disk._file(key(1)))  # the oldest: read first, so none is intact
        assert lower_load_sample(engine, disk) is None
        assert disk.contents() == [key(2), key(3)]
    finally:
        engine.close()
