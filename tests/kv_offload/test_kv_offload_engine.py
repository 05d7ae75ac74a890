"""KV offload tiers through the whole engine on CPU: outputs equal with offloading on and
off (embedded SmolLM2, a pool small enough that blocks go down and come back), a disk
tier that survives a restart and serves the first request (a finished request's blocks
are written through to it), a corrupted block file rejected, the size cap keeping the
most recent blocks, a plugin tier by module path."""

import os
import random

import pytest

from pagoda.core.block_hash import hash_block_tokens
from pagoda.entrypoints.llm import LLM
from pagoda.kv_offload.disk_tier import HEADER_RESERVE
from pagoda.sampling_params import SamplingParams

GIB = 1 << 30
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def tier(llm, name):
    return next(t for t in llm.llm_engine.get_stats().kv_offload if t["tier"] == name)


def one_by_one(llm, prompts):
    return [
        llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        for p in prompts
    ]


def test_smollm2_outputs_with_offloading_equal_outputs_without():
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(150)] for _ in range(3)]
    revisits = prompts + prompts  # each visit pushes an earlier prompt's blocks out
    kwargs = dict(device="cpu", num_gpu_blocks_override=24, max_model_len=256, max_num_seqs=4)
    off = LLM(**kwargs)
    try:
        expected = one_by_one(off, revisits)
        expected_batch = [
            o.outputs[0].token_ids
            for o in off.generate(
                [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False
            )
        ]
    finally:
        off.llm_engine.shutdown()
    on = LLM(
        kv_offloading_size=0.05, async_scheduling=True, kv_offloading_bandwidth="cpu=inf", **kwargs
    )
    try:
        assert one_by_one(on, revisits) == expected
        cpu = tier(on, "cpu")
        assert cpu["hits"] > 0 and cpu["bytes_loaded"] > 0 and cpu["bytes_stored"] > 0
        batch = on.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in batch] == expected_batch
        on.llm_engine.audit_kv_cache()
    finally:
        on.llm_engine.shutdown()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from helpers.tiny_models import save_tiny_hf_model

    path = tmp_path_factory.mktemp("kv-offload-llama")
    save_tiny_hf_model(path, "llama")
    return str(path)


BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers x (k, v) x block x kv heads x head_dim x fp32
DISK_BLOCKS = 6


def tiny(path, disk_dir=None, **extra):
    """The tiny model over the tiers; the cost model is told they load instantly (these
    tests check the data path: every hit is loaded) unless `extra` says otherwise."""
    extra.setdefault("kv_offloading_bandwidth", "cpu=inf,disk=inf")
    disk = {}
    if disk_dir is not None:
        disk = dict(
            kv_offloading_disk_path=str(disk_dir),
            kv_offloading_disk_size=DISK_BLOCKS * (BLOCK_BYTES + 10 + HEADER_RESERVE) / GIB,
        )
    return LLM(
        path,
        skip_tokenizer_init=True,
        device="cpu",
        num_gpu_blocks_override=8,
        max_model_len=128,
        kv_offloading_size=16 * BLOCK_BYTES / GIB,
        **disk,
        **extra,
    )


def block_hashes(tokens):
    hashes, parent = [], None
    for start in range(0, len(tokens) - len(tokens) % 16, 16):
        parent = hash_block_tokens(parent, tokens[start : start + 16])
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_restart_finds_the_last_runs_prefixes_on_disk(tiny_llama, tmp_path, async_scheduling):
    from pagoda.metrics.prometheus import ServerMetrics

    prompt = [random.Random(4).randrange(3, 384) for _ in range(40)]  # two full blocks
    first = tiny(tiny_llama, tmp_path, async_scheduling=async_scheduling)
    try:
        expected = one_by_one(first, [prompt])
        disk = tier(first, "disk")  # written through: the GPU pool evicted nothing
        assert disk["stored_blocks"] == 2 and tier(first, "cpu")["evicted_blocks"] == 0
    finally:
        first.shutdown()
    files = {f for _, _, names in os.walk(tmp_path) for f in names if f.endswith(".kvb")}
    assert files == {h.hex() + ".kvb" for h in block_hashes(prompt)}

    warm = tiny(tiny_llama, tmp_path, async_scheduling=async_scheduling)
    try:
        out = warm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == expected[0]
        assert out.num_cached_tokens == 32
        disk = tier(warm, "disk")
        assert disk["hits"] == 2 and disk["loaded_blocks"] == 2
        assert disk["bytes_loaded"] == 2 * BLOCK_BYTES
        text = ServerMetrics("m").render(warm.llm_engine.get_stats()).decode()
        assert 'pagoda:kv_offload_hits_total{model_name="m",tier="disk"} 2.0' in text
        warm.llm_engine.audit_kv_cache()
    finally:
        warm.shutdown()


def test_disk_tier_restart_warm_hit_size_cap_and_corrupt_file(tiny_llama, tmp_path):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 384) for _ in range(40)] for _ in range(5)]
    first = tiny(tiny_llama, tmp_path)
    try:
        expected = one_by_one(first, prompts)  # each one's blocks written through as it ends
        disk = tier(first, "disk")
        assert disk["stored_blocks"] == 10 and disk["evicted_blocks"] == 10 - DISK_BLOCKS
    finally:
        first.llm_engine.shutdown()
    files = sorted(f for _, _, names in os.walk(tmp_path) for f in names if f.endswith(".kvb"))
    assert len(files) == DISK_BLOCKS  # the cap: the least recently stored went first
    on_disk = {bytes.fromhex(f[:-4]) for f in files}
    assert set(block_hashes(prompts[4])) <= on_disk and not set(block_hashes(prompts[0])) & on_disk

    warm = tiny(tiny_llama, tmp_path)  # a restart on the same directory
    try:
        assert one_by_one(warm, [prompts[4]]) == [expected[4]]
        disk = tier(warm, "disk")
        assert disk["hits"] == 2 and disk["bytes_loaded"] == 2 * BLOCK_BYTES
        assert tier(warm, "cpu")["hits"] == 0
        warm.llm_engine.audit_kv_cache()
    finally:
        warm.llm_engine.shutdown()

    for name in files:  # flip the last byte of every block file
        path = os.path.join(tmp_path, name[:2], name)
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
    corrupt = tiny(tiny_llama, tmp_path)
    try:
        assert one_by_one(corrupt, [prompts[3]]) == [expected[3]]
        disk = tier(corrupt, "disk")
        assert disk["failed_reads"] == 1 and disk["invalid_files"] == 1
        assert disk["bytes_loaded"] == 0
        corrupt.llm_engine.audit_kv_cache()
    finally:
        corrupt.llm_engine.shutdown()


def test_a_tier_slower_than_recompute_is_skipped_and_outputs_are_unchanged(tiny_llama, tmp_path):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 384) for _ in range(40)] for _ in range(3)]
    first = tiny(tiny_llama, tmp_path)
    try:
        expected = one_by_one(first, prompts)  # all written through to the disk
    finally:
        first.llm_engine.shutdown()
    # A restart whose disk tier is told to read at 1 byte/s: every hit (all on disk
    # after a restart) is recomputed, and the tier keeps its copies.
    slow = tiny(tiny_llama, tmp_path, kv_offloading_bandwidth="disk=1e-9")
    try:
        assert one_by_one(slow, prompts[::-1]) == expected[::-1]
        disk = tier(slow, "disk")
        assert disk["hits"] == 6 and disk["skipped_blocks"] == 6
        assert disk["loaded_blocks"] == 0 and disk["bytes_loaded"] == 0
        assert disk["blocks"] == DISK_BLOCKS and disk["est_load_bytes_per_s"] == 1.0
        cpu = tier(slow, "cpu")  # measured at start-up
        assert cpu["est_load_bytes_per_s"] > 0 and cpu["est_prefill_tokens_per_s"] > 0
        slow.llm_engine.audit_kv_cache()
    finally:
        slow.llm_engine.shutdown()
    with pytest.raises(ValueError, match="names tier\\(s\\) nvme; the tiers are cpu, disk"):
        tiny(tiny_llama, tmp_path, kv_offloading_bandwidth="nvme=1")


def test_read_only_disk_directory_fails_at_start_up(tiny_llama):
    with pytest.raises(ValueError, match="kv-offloading-disk-path /proc/.* cannot create"):
        tiny(tiny_llama, "/proc/pagoda-kv")


def test_plugin_tier_serves_blocks_the_cpu_tier_lost(tiny_llama):
    from helpers import kv_tier_plugin

    rng = random.Random(2)
    prompts = [[rng.randrange(3, 384) for _ in range(40)] for _ in range(5)]
    llm = LLM(
        tiny_llama,
        skip_tokenizer_init=True,
        device="cpu",
        num_gpu_blocks_override=8,
        max_model_len=128,
        kv_offloading_size=2 * BLOCK_BYTES / GIB,
        kv_offloading_tier="helpers.kv_tier_plugin:DictTier",
        kv_offloading_bandwidth="cpu=inf,dict=inf",
    )
    try:
        expected = one_by_one(llm, prompts)
        plugin = kv_tier_plugin.INSTANCES[-1]
        assert plugin.counts["stores"] >= 4
        assert one_by_one(llm, [prompts[0]]) == [expected[0]]
        stats = tier(llm, "dict")
        assert stats["hits"] == 2 and plugin.counts["loads"] == 2
        llm.llm_engine.audit_kv_cache()
    finally:
        llm.llm_engine.shutdown()


def test_offloading_flags_are_checked():
    with pytest.raises(ValueError, match="stage blocks through host memory"):
        LLM(device="cpu", kv_offloading_disk_path="/tmp/x", kv_offloading_disk_size=1.0)
    with pytest.raises(ValueError, match="go together"):
        LLM(device="cpu", kv_offloading_size=1.0, kv_offloading_disk_path="/tmp/x")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(device="cpu", kv_offloading_size=1.0, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offloading_size must be"):
        LLM(device="cpu", kv_offloading_size=-1)
    with pytest.raises(ValueError, match="kv_offloading_bandwidth must be 'tier=GB/s"):
        LLM(device="cpu", kv_offloading_size=1.0, kv_offloading_bandwidth="disk")
    with pytest.raises(ValueError, match="kv_offloading_bandwidth must be 'tier=GB/s"):
        LLM(device="cpu", kv_offloading_size=1.0, kv_offloading_bandwidth="disk=0")
    with pytest.raises(ValueError, match="set kv_offloading_size too"):
        LLM(device="cpu", kv_offloading_bandwidth="disk=1")
