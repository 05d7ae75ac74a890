"""TritonBackend (chunk kernel + split-K decode) and the KV pool's Triton store_kv
against TorchRefBackend and the pool's torch store.

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes in float16 and
float32 (the interpreter gets bfloat16 wrong). Triton reads TRITON_INTERPRET when a
kernel is decorated, i.e. when its module is imported, so this module sets the variable
before importing the kernels and reloads them if an earlier test module imported them
compiled. With CUDA the same small cases run compiled on the GPU, plus a bfloat16
sweep up to 32k tokens of context and a real CUDA graph capture and replay.

Every run poisons the output (NaN) and the cache slots no request uses (NaN): each
output row must be written, no unused slot read or written, and the cache must equal
the reference's byte for byte.
"""

import math
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
from helpers.interpreted_kernels import kernel_modules  # noqa: E402
from helpers.kv_pool_helpers import pool_holding, store_and_attend  # noqa: E402
from helpers.paged_attention_case import TORCH_STORE, TRITON_STORE, Case  # noqa: E402

from pagoda.attention.metadata import build_attention_metadata  # noqa: E402
from pagoda.attention.torch_ref import TorchRefBackend  # noqa: E402
from pagoda.attention.triton_backend import TritonBackend  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


kernel_modules(
    "attention.store_kv",
    "attention.paged_attention",
    "attention.fp8_decode_words",
    "attention.paged_decode_slices",
    "attention.paged_decode_words",
    "attention.paged_decode",
)


def run_and_compare(case: Case, backend: TritonBackend, atol: float, rtol: float):
    ref_backend = TorchRefBackend(
        backend.num_heads, backend.num_kv_heads, backend.head_dim, backend.scale
    )
    ref = store_and_attend(ref_backend, case.pool_ref, 0, case.q, case.k, case.v, case.md)
    out = torch.full_like(case.q, float("nan"))
    returned = store_and_attend(backend, case.pool_tri, 0, case.q, case.k, case.v, case.md, out=out)
    assert returned is out
    if ON_GPU:
        torch.cuda.synchronize()
    assert not out.isnan().any(), "an output row was not written"
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    rel = (out.double() - ref.double()).norm() / ref.double().norm()
    assert rel < rtol
    # K/V landed exactly where the reference put them; unused slots untouched (NaN).
    assert torch.equal(case.cache_tri[:, case.used], case.cache_ref[:, case.used])
    assert case.cache_tri[:, ~case.used].isnan().all()
    return out, ref


# A fresh prefill, a chunk after a cached prefix that spans several key tiles, a short
# chunk after a short prefix, and three decodes.
MIXED = [(0, 37), (70, 40), (5, 3), (45, 1), (0, 1), (130, 1)]


@pytest.mark.parametrize(
    "dtype,num_heads,num_kv_heads,block_size,splits",
    [
        (torch.float16, 8, 2, 16, None),  # GQA 4, automatic slices (one: short contexts)
        (torch.float32, 2, 2, 32, 3),  # no GQA, decode slices forced on
    ],
)
def test_mixed_batch_matches_reference(dtype, num_heads, num_kv_heads, block_size, splits):
    case = Case(MIXED, num_heads, num_kv_heads, 64, block_size, dtype, pad_rows=2)
    backend = TritonBackend(num_heads, num_kv_heads, 64, 1 / 8, num_decode_splits=splits)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    out, _ = run_and_compare(case, backend, atol=tol, rtol=tol)
    # Padding rows come back zero, as from torch_ref.
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))


def test_split_k_decode_head_dim_128():
    # Decode only, contexts long enough for several slices, one slice left empty.
    shapes = [(199, 1), (70, 1), (128, 1), (0, 1)]
    case = Case(shapes, 8, 2, 128, 32, torch.float16, seed=1)
    backend = TritonBackend(8, 2, 128, 1 / math.sqrt(128), num_decode_splits=4)
    run_and_compare(case, backend, atol=3e-3, rtol=3e-3)


def test_graph_buffers_replay_a_smaller_batch():
    """The graph path: launches sized from capture-time values only, real lengths read
    from the persistent buffers; padding requests are skipped."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 1, 64, 16
    backend = TritonBackend(num_heads, num_kv_heads, head_dim, 1 / 8)
    assert backend.supports_cuda_graphs()
    backend.init_cuda_graph_state(
        max_batch_size=6, max_blocks_per_req=8, block_size=block_size, device=DEVICE
    )
    capture_md = backend.metadata_for_capture(4)
    common = capture_md.common
    assert common.query_start_loc_cpu is None and common.max_query_len == 1
    # Planned from capture-time values: every request may decode, over the longest
    # context the block table holds; padding output rows are left alone.
    assert (capture_md.num_decodes, capture_md.zero_padding_rows) == (4, False)
    case = Case(
        [(40, 1), (3, 1), (100, 1)],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        torch.float16,
        pad_rows=1,
        seed=2,
    )
    # The capture-time run writes nothing into the cache (every slot is -1).
    before = case.cache_tri.clone()
    store_and_attend(
        backend, case.pool_tri, 0, case.q[:4], case.k[:4], case.v[:4], common, plan=capture_md
    )
    assert torch.equal(before.nan_to_num(7.0), case.cache_tri.nan_to_num(7.0))

    backend.prepare_replay(case.md, batch_size=4)
    ref = store_and_attend(
        TorchRefBackend(num_heads, num_kv_heads, head_dim, 1 / 8),
        case.pool_ref,
        0,
        case.q,
        case.k,
        case.v,
        case.md,
    )
    out = store_and_attend(
        backend, case.pool_tri, 0, case.q, case.k, case.v, common, plan=capture_md
    )
    torch.testing.assert_close(out[:3].float(), ref[:3].float(), atol=3e-3, rtol=3e-3)
    assert torch.equal(case.cache_tri[:, case.used], case.cache_ref[:, case.used])
    assert case.cache_tri[:, ~case.used].isnan().all()


def test_mixed_graph_buffers_replay_prefill_chunks_beside_decodes():
    """A mixed graph (16 rows over up to 5 requests, captured with no host copies) replays
    a chunk after a context, a decode and a fresh prompt: the real rows equal torch_ref,
    padding rows and the padding request write nothing."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 1, 64, 16
    backend = TritonBackend(num_heads, num_kv_heads, head_dim, 1 / 8)
    backend.init_cuda_graph_state(
        max_batch_size=6,
        max_blocks_per_req=8,
        block_size=block_size,
        device=DEVICE,
        max_num_tokens=16,
    )
    capture_md = backend.metadata_for_capture(5, num_tokens=16)
    common = capture_md.common
    assert (common.num_reqs, common.num_actual_tokens, common.max_query_len) == (5, 16, 16)
    assert (capture_md.num_decodes, capture_md.zero_padding_rows) == (5, False)
    case = Case(
        [(40, 5), (3, 1), (0, 6)],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        torch.float16,
        pad_rows=4,
        seed=3,
    )
    backend.prepare_replay(case.md, batch_size=5, num_tokens=16)
    ref = store_and_attend(
        TorchRefBackend(num_heads, num_kv_heads, head_dim, 1 / 8),
        case.pool_ref,
        0,
        case.q,
        case.k,
        case.v,
        case.md,
    )
    out = store_and_attend(
        backend, case.pool_tri, 0, case.q, case.k, case.v, common, plan=capture_md
    )
    torch.testing.assert_close(out[:12].float(), ref[:12].float(), atol=3e-3, rtol=3e-3)
    assert torch.equal(case.cache_tri[:, case.used], case.cache_ref[:, case.used])
    assert case.cache_tri[:, ~case.used].isnan().all()
    with pytest.raises(ValueError, match="does not fit"):
        backend.prepare_replay(case.md, batch_size=2, num_tokens=16)
    with pytest.raises(ValueError, match="num_tokens"):
        backend.metadata_for_capture(5, num_tokens=32)


def test_graph_hooks_reject_bad_batches():
    backend = TritonBackend(4, 1, 64, 1 / 8)
    with pytest.raises(RuntimeError, match="init_cuda_graph_state"):
        backend.metadata_for_capture(2)
    backend.init_cuda_graph_state(
        max_batch_size=2, max_blocks_per_req=2, block_size=16, device="cpu"
    )
    with pytest.raises(ValueError, match="batch_size"):
        backend.metadata_for_capture(3)
    prefill = build_attention_metadata([3], [3], [[0]], 16, "cpu")
    with pytest.raises(ValueError, match="max_query_len"):
        backend.prepare_replay(prefill, 2)
    too_wide = build_attention_metadata([1], [40], [[0, 1, 2]], 16, "cpu")
    with pytest.raises(ValueError, match="max_blocks_per_req"):
        backend.prepare_replay(too_wide, 2)
    other_block_size = build_attention_metadata([1], [3], [[0]], 32, "cpu")
    with pytest.raises(ValueError, match="block_size"):
        backend.prepare_replay(other_block_size, 2)


def test_rejects_unsupported_shapes_and_dtypes():
    with pytest.raises(ValueError, match="head_dim"):
        TritonBackend(4, 2, 80, 0.1)
    with pytest.raises(ValueError, match="num_decode_splits"):
        TritonBackend(4, 2, 64, 0.1, num_decode_splits=0)
    backend = TritonBackend(4, 2, 64, 0.1)
    md = build_attention_metadata([1], [1], [[0]], 16, "cpu")
    q = torch.zeros(1, 4, 64, dtype=torch.float16)
    torch.zeros(1, 2, 64, dtype=torch.float16)
    plan = backend.build_metadata(md)
    with pytest.raises(ValueError, match="kv_cache dtype"):
        backend.forward(q, torch.zeros(2, 1, 16, 2, 64), plan)
    with pytest.raises(ValueError, match="q must be"):
        backend.forward(
            torch.zeros(1, 8, 64, dtype=torch.float16),
            torch.zeros(2, 1, 16, 2, 64, dtype=torch.float16),
            plan,
        )


# ---- GPU only ----------------------------------------------------------------------

gpu = pytest.mark.gpu

GPU_SWEEP = [
    # (shapes, num_heads, num_kv_heads, head_dim, block_size)
    ([(0, 1), (16, 1), (999, 1), (4096, 1), (32767, 1)], 32, 8, 128, 16),
    ([(0, 1), (31, 1), (8191, 1), (20000, 1)], 32, 32, 128, 32),
    ([(0, 513), (30000, 700), (17, 1), (32000, 1), (100, 1)], 32, 8, 128, 16),
    ([(0, 2048), (1000, 300), (5000, 1), (1, 1)], 16, 4, 64, 32),
    ([(12000, 3), (12000, 5), (0, 4)], 32, 8, 128, 16),  # spec-decode-like chunks
]


@gpu
@pytest.mark.parametrize("index", range(len(GPU_SWEEP)))
@pytest.mark.parametrize("splits", [None, 7])
def test_gpu_bf16_sweep(index, splits):
    shapes, num_heads, num_kv_heads, head_dim, block_size = GPU_SWEEP[index]
    case = Case(
        shapes,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        torch.bfloat16,
        pad_rows=3,
        seed=index,
    )
    backend = TritonBackend(
        num_heads, num_kv_heads, head_dim, 1 / math.sqrt(head_dim), num_decode_splits=splits
    )
    run_and_compare(case, backend, atol=2e-2, rtol=1e-2)


@gpu
def test_gpu_cuda_graph_capture_and_replay():
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    backend = TritonBackend(num_heads, num_kv_heads, head_dim, 1 / math.sqrt(head_dim))
    backend.init_cuda_graph_state(
        max_batch_size=8, max_blocks_per_req=2048, block_size=block_size, device="cuda"
    )
    md = backend.metadata_for_capture(8)
    num_blocks = 8 * 2048 + 1
    pool = pool_holding(
        [
            torch.randn(
                2,
                num_blocks,
                block_size,
                num_kv_heads,
                head_dim,
                dtype=torch.bfloat16,
                device="cuda",
            )
        ],
        TRITON_STORE,
    )
    cache = pool.cache(0)
    q = torch.randn(8, num_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(8, num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    # warm-up: compile outside the capture
    store_and_attend(backend, pool, 0, q, k, v, md.common, plan=md, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_and_attend(backend, pool, 0, q, k, v, md.common, plan=md, out=out)
    gen = torch.Generator().manual_seed(5)
    for seqs in ([5, 32768, 100], [1, 2, 3, 4, 5, 6, 7, 8000], [20000]):
        n = len(seqs)
        order = torch.randperm(num_blocks, generator=gen).tolist()
        tables = []
        for s in seqs:
            count = -(-s // block_size)
            tables.append(order[:count])
            order = order[count:]
        real = build_attention_metadata([1] * n, seqs, tables, block_size, "cuda")
        q.copy_(torch.randn(8, num_heads, head_dim, generator=gen).to(q))
        k.copy_(torch.randn(8, num_kv_heads, head_dim, generator=gen).to(k))
        v.copy_(torch.randn(8, num_kv_heads, head_dim, generator=gen).to(v))
        ref_pool = pool_holding([cache], TORCH_STORE)
        ref = store_and_attend(
            TorchRefBackend(num_heads, num_kv_heads, head_dim, backend.scale),
            ref_pool,
            0,
            q[:n],
            k[:n],
            v[:n],
            real,
        )
        backend.prepare_replay(real, batch_size=8)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out[:n].float(), ref.float(), atol=2e-2, rtol=1e-2)
        assert torch.equal(cache, ref_pool.cache(0))


def test_split_plan_uses_short_slices_only_when_the_grid_is_small():
    from pagoda.kernels.attention.paged_decode import (
        MAX_SPLITS,
        MIN_SPLIT_TOKENS,
        SMALL_GRID_MIN_SPLIT,
        choose_num_splits,
        min_split_tokens,
    )

    sms = 132
    # Batch 1 over 4 KV heads: 4 programs unsplit, so slices of 32 tokens.
    assert min_split_tokens(1, 4, sms) == SMALL_GRID_MIN_SPLIT == 32
    assert choose_num_splits(1, 4, 32, sms) == 1
    assert choose_num_splits(1, 4, 128, sms) == 4
    assert choose_num_splits(1, 4, 2304, sms) == MAX_SPLITS
    # 64 requests x 8 KV heads fill the SMs: long slices, and only as many as pay.
    assert min_split_tokens(64, 8, sms) == MIN_SPLIT_TOKENS == 256
    assert choose_num_splits(64, 8, 256, sms) == 1
    assert choose_num_splits(64, 8, 1024, sms) == 2  # 4 * 132 / 512 programs, rounded up
    assert choose_num_splits(0, 8, 1024, sms) == 1
