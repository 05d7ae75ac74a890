"""FP8 KV cache in the Triton kernels: store_kv's quantization against the torch
reference (bit for bit), and the chunk and split-K decode kernels reading an FP8 cache
against torch_ref reading the same bytes.

Without CUDA the kernels run under TRITON_INTERPRET=1 (float16 / float32 q, small
shapes). What the interpreter does and does not cover: it reads float8 e4m3 correctly
(except the NaN bytes 0x7F / 0xFF, which it reads as +-480, so no test here stores a
NaN) but its float32 -> float8 cast mis-rounds values whose rounding carries into the
next power of two; store_kv rounds to the e4m3 grid in float32 itself
(kernels/store_kv.py round_to_e4m3), so its final cast is exact and the interpreter
checks the kernel's whole arithmetic. The GPU's own float8 conversion instructions and
the bfloat16 path run only with CUDA (the GPU-only test below).
"""

import math
import os
from dataclasses import replace

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
from helpers.interpreted_kernels import kernel_modules  # noqa: E402

from pagoda.attention.kv_pool import FullAttentionLayout, KVCachePool  # noqa: E402
from pagoda.attention.kv_quant import FP8_KV_DTYPE, quantize_kv  # noqa: E402
from pagoda.attention.metadata import build_attention_metadata  # noqa: E402
from pagoda.attention.torch_ref import TorchRefBackend  # noqa: E402
from pagoda.attention.triton_backend import TritonBackend  # noqa: E402
from pagoda.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
POISON = 0x7E  # e4m3 448: what unused slots hold (the interpreter cannot read NaN)


kernel_modules(
    "attention.store_kv",
    "attention.paged_attention",
    "attention.fp8_decode_words",
    "attention.paged_decode_slices",
    "attention.paged_decode_words",
    "attention.paged_decode",
)


def fp8_pool(num_blocks, block_size, num_kv_heads, head_dim, use_triton) -> KVCachePool:
    spec = FullAttentionSpec(block_size, num_kv_heads, head_dim, "float8_e4m3fn")
    layouts = {FullAttentionSpec: FullAttentionLayout(use_triton=use_triton)}
    return KVCachePool(KVCacheConfig(num_blocks, [spec]), DEVICE, layouts)


def e4m3_edge_values() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties: round to even)
    and values just off them, both signs, and values past +-448 (clamped)."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_KV_DTYPE).float()
    pos = grid[grid.isfinite() & (grid >= 0)].unique()
    mids = (pos[1:] + pos[:-1]) / 2
    ties = torch.cat(
        [pos, mids, mids * (1 + 2**-20), mids * (1 - 2**-20), torch.tensor([500.0, 1e6, 3e-5])]
    )
    return torch.cat([ties, -ties])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_quantizes_bit_exactly_like_the_torch_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    num_kv_heads, head_dim, block_size, num_blocks = 3, 16, 8, 12
    edges = e4m3_edge_values()
    rows = -(-edges.numel() // (num_kv_heads * head_dim)) + 20
    k = torch.randn(rows, num_kv_heads, head_dim, generator=gen) * 40
    k.view(-1)[: edges.numel()] = edges * 0.75  # k_scale 0.75: x / 0.75 hits the edges
    v = torch.randn(rows, num_kv_heads, head_dim, generator=gen) * torch.exp(
        torch.randn(rows, num_kv_heads, head_dim, generator=gen) * 3
    )
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:rows]
    slots[[2, 7]] = -1  # padding rows write nothing
    md = build_attention_metadata([1] * rows, [1] * rows, [[0]] * rows, block_size, DEVICE)
    md.slot_mapping = slots.to(DEVICE)
    md.query_start_loc_cpu = md.seq_lens_cpu = None  # graph-style: filter padding by slot
    scales = torch.tensor([0.75, 1.9], device=DEVICE)
    pools = [
        fp8_pool(num_blocks, block_size, num_kv_heads, head_dim, use_triton)
        for use_triton in (False, True)
    ]
    for pool in pools:
        pool.cache(0).view(torch.uint8).fill_(POISON)
        pool.store(0, md, k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE), scales=scales)
    ref, tri = (pool.cache(0).view(torch.uint8) for pool in pools)
    assert torch.equal(tri, ref)
    # The reference itself: x / scale clamped to +-448, rounded to nearest even.
    flat = pools[0].cache(0).view(2, -1, num_kv_heads, head_dim).cpu()
    slots = slots.cpu()
    real = slots >= 0
    expect_k = (k.to(dtype).float()[real] / 0.75).clamp(-448, 448).to(FP8_KV_DTYPE)
    assert torch.equal(flat[0][slots[real]].view(torch.uint8), expect_k.view(torch.uint8))
    assert flat[0][slots[real]].float().abs().max() == 448  # the clamped ones
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[real]] = False
    assert (flat.view(torch.uint8)[:, untouched] == POISON).all()


def test_store_kv_refuses_an_fp8_cache_without_scales():
    from pagoda.kernels.attention.store_kv import store_kv

    cache = torch.zeros(2, 2, 8, 1, 16, dtype=FP8_KV_DTYPE, device=DEVICE)
    k = torch.zeros(1, 1, 16, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="needs kv_scales"):
        store_kv(k, k, cache, slots)
    with pytest.raises(ValueError, match=r"float32 \[2\]"):
        store_kv(k, k, cache, slots, torch.ones(2, dtype=torch.float16, device=DEVICE))


class Fp8Case:
    """A batch of (cached tokens, query length) requests over an FP8 cache: random
    context already stored (quantized with the scales), unused slots poisoned."""

    def __init__(
        self,
        shapes,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        scales=(0.01, 0.02),
        seed=0,
    ):
        gen = torch.Generator().manual_seed(seed)
        needed = [-(-(ctx + qlen) // block_size) for ctx, qlen in shapes]
        num_blocks = sum(needed) + 2
        order = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables = []
        used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for (ctx, qlen), n in zip(shapes, needed):
            table, order = order[:n], order[n:]
            self.tables.append(table)
            pos = torch.arange(ctx + qlen)
            used[torch.tensor(table)[pos // block_size], pos % block_size] = True
        qlens, seqs = [q for _, q in shapes], [c + q for c, q in shapes]
        self.md = build_attention_metadata(qlens, seqs, self.tables, block_size, DEVICE)
        rows = sum(qlens)
        self.scales = torch.tensor(scales, device=DEVICE)

        def rand(*shape, std=1.0):
            return (torch.randn(*shape, generator=gen) * std).to(dtype=dtype, device=DEVICE)

        self.q = rand(rows, num_heads, head_dim)
        # Scores of std ~1 (as the other kernel tests): entries of ~100 scale-units.
        self.k, self.v = rand(rows, num_kv_heads, head_dim), rand(rows, num_kv_heads, head_dim)
        context = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
        stored = torch.stack([quantize_kv(context[i], self.scales[i].cpu()) for i in (0, 1)])
        stored.view(torch.uint8)[:, ~used] = POISON
        self.pools = {}
        for use_triton in (False, True):
            pool = fp8_pool(num_blocks, block_size, num_kv_heads, head_dim, use_triton)
            pool.cache(0).copy_(stored.to(DEVICE))
            self.pools[use_triton] = pool


def attend(backend, pool, case, q=None, **kw):
    pool.store(0, case.md, case.k, case.v, scales=case.scales)
    return backend.forward(
        case.q if q is None else q,
        pool.cache(0),
        backend.build_metadata(case.md),
        kv_scales=case.scales,
        **kw,
    )


def decode_rows_rounded(q, md):
    """q with its decode rows (query length 1) rounded as the word kernel (16-bit
    queries on an FP8 cache) rounds them (paged_decode.quantize_q_fp8_reference); other rows as they are."""
    from pagoda.kernels.attention.paged_decode import quantize_q_fp8_reference

    starts = md.query_start_loc.tolist()
    rows = [a for a, b in zip(starts, starts[1:]) if b - a == 1]
    q8, scale = quantize_q_fp8_reference(q[rows])
    out = q.clone()
    out[rows] = (q8.float() * scale).to(q.dtype)  # exact: e4m3 times a power of two
    return out


MIXED = [(0, 37), (70, 40), (5, 3), (45, 1), (0, 1), (130, 1)]


@pytest.mark.parametrize(
    "dtype,num_heads,num_kv_heads,block_size,splits",
    [
        # The word kernel: its decode queries rounded to e4m3, the reference given the same.
        (torch.float16, 8, 2, 16, None),
        # The tile kernel (float32 queries), decode slices forced on: the V scale before the merge.
        (torch.float32, 2, 2, 32, 3),
    ],
)
def test_kernels_read_fp8_like_torch_ref(dtype, num_heads, num_kv_heads, block_size, splits):
    case = Fp8Case(MIXED, num_heads, num_kv_heads, 64, block_size, dtype)
    ref_backend = TorchRefBackend(num_heads, num_kv_heads, 64, 1 / 8)
    words = dtype != torch.float32
    ref = attend(
        ref_backend,
        case.pools[False],
        case,
        q=decode_rows_rounded(case.q, case.md) if words else None,
    )
    backend = TritonBackend(num_heads, num_kv_heads, 64, 1 / 8, num_decode_splits=splits)
    out = attend(backend, case.pools[True], case)
    assert torch.equal(
        case.pools[True].cache(0).view(torch.uint8), case.pools[False].cache(0).view(torch.uint8)
    )
    # float32: the scales folded (kernel) or applied to the entries (reference) round
    # differently in the last bits.
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_graph_plan_reads_the_scales_tensor_at_run_time():
    """A plan built from capture-time values, run twice with the layer's scales changed
    in place in between (as a CUDA graph replays): each run follows the current values."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 1, 64, 16
    backend = TritonBackend(num_heads, num_kv_heads, head_dim, 1 / 8)
    backend.init_cuda_graph_state(
        max_batch_size=4, max_blocks_per_req=8, block_size=block_size, device=DEVICE
    )
    plan = backend.metadata_for_capture(4)
    case = Fp8Case(
        [(40, 1), (3, 1), (100, 1)],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        torch.float16,
        seed=2,
    )
    backend.prepare_replay(case.md, batch_size=4)
    ref_backend = TorchRefBackend(num_heads, num_kv_heads, head_dim, 1 / 8)
    for scales in ((0.01, 0.02), (0.03, 0.005)):
        case.scales.copy_(torch.tensor(scales))
        tri_pool, ref_pool = case.pools[True], case.pools[False]
        q = torch.cat([case.q, case.q[:1]])  # the graph's 4th row: a padding request
        tri_pool.store(
            0,
            plan.common,
            torch.cat([case.k, case.k[:1]]),
            torch.cat([case.v, case.v[:1]]),
            scales=case.scales,
        )
        out = backend.forward(q, tri_pool.cache(0), plan, kv_scales=case.scales)
        ref = attend(ref_backend, ref_pool, case, q=decode_rows_rounded(case.q, case.md))
        torch.testing.assert_close(out[:3].float(), ref.float(), atol=3e-3, rtol=3e-3)
        assert torch.equal(tri_pool.cache(0).view(torch.uint8), ref_pool.cache(0).view(torch.uint8))


def test_backend_refuses_an_fp8_cache_without_scales():
    backend = TritonBackend(4, 1, 64, 1 / 8)
    md = build_attention_metadata([1], [1], [[0]], 16, DEVICE)
    q = torch.zeros(1, 4, 64, dtype=torch.float16, device=DEVICE)
    cache = torch.zeros(2, 1, 16, 1, 64, dtype=FP8_KV_DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="needs kv_scales"):
        backend.forward(q, cache, backend.build_metadata(md))


gpu = pytest.mark.gpu


@gpu
def test_gpu_bf16_queries_on_an_fp8_cache_match_torch_ref():
    shapes = [(0, 513), (3000, 200), (17, 1), (4000, 1), (100, 1)]
    case = Fp8Case(shapes, 32, 8, 128, 16, torch.bfloat16, seed=3)
    ref = attend(
        TorchRefBackend(32, 8, 128, 1 / math.sqrt(128)),
        case.pools[False],
        case,
        q=decode_rows_rounded(case.q, case.md),
    )
    for splits in (None, 7):
        out = attend(
            TritonBackend(32, 8, 128, 1 / math.sqrt(128), num_decode_splits=splits),
            case.pools[True],
            case,
        )
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=1e-2)
    assert torch.equal(
        case.pools[True].cache(0).view(torch.uint8), case.pools[False].cache(0).view(torch.uint8)
    )


def fp8_decode_case(
    contexts, num_heads, num_kv_heads, head_dim, block_size, seed=0, quantized_q=False
):
    """Decode rows over an FP8 cache holding every finite e4m3 byte (subnormals and both
    signs included): q, cache, block tables, query_start_loc with one 3-token row (the
    decode kernel must leave it alone), and the torch reference of the decode rows."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-ctx // block_size) for ctx in contexts]
    num_blocks = sum(needed) + 3
    raw = torch.randint(
        0,
        256,
        (2, num_blocks, block_size, num_kv_heads, head_dim),
        generator=gen,
        dtype=torch.uint8,
    )
    raw.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    raw[(raw == 0x7F) | (raw == 0xFF)] = 0x7E  # no NaN: store_kv never writes one
    cache = raw.view(FP8_KV_DTYPE)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(contexts), max(needed), dtype=torch.int32)
    for r, n in enumerate(needed):
        tables[r, :n] = torch.tensor(order[:n])
        order = order[n:]
    qlens = [3 if r == 1 else 1 for r in range(len(contexts))]
    qsl = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(int(qsl[-1]), num_heads, head_dim, generator=gen).to(torch.float16)
    scales = torch.tensor([0.01, 0.02])
    group = num_heads // num_kv_heads
    ref = torch.zeros(q.shape)
    q_ref = q.float()
    if quantized_q:  # what the word kernel attends with: each head rounded to e4m3
        from pagoda.kernels.attention.paged_decode import quantize_q_fp8_reference

        q8, q_scale = quantize_q_fp8_reference(q)
        q_ref = q8.float() * q_scale
    for r, ctx in enumerate(contexts):
        if qlens[r] != 1:
            continue
        pos = torch.arange(ctx)
        blk = tables[r][pos // block_size].long()
        k = (cache[0][blk, pos % block_size].float() * scales[0]).repeat_interleave(group, 1)
        v = (cache[1][blk, pos % block_size].float() * scales[1]).repeat_interleave(group, 1)
        s = torch.einsum("hd,nhd->hn", q_ref[qsl[r]], k) / math.sqrt(head_dim)
        ref[qsl[r]] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return {
        "q": q,
        "cache": cache,
        "tables": tables,
        "qsl": qsl,
        "seq": torch.tensor(contexts, dtype=torch.int32),
        "scales": scales,
        "ref": ref,
        "decode_rows": [int(qsl[r]) for r in range(len(contexts)) if qlens[r] == 1],
    }


def _tiles(block_n=32, num_warps=4, num_stages=2, min_block_h=16):
    """The default decode config with small test tiles for every kernel (and, for the
    word kernel, min_block_h query rows)."""
    from pagoda.kernels.attention.decode_config import DecodeAttentionConfig, DecodeTiles

    tiles = DecodeTiles(block_n, num_warps, num_stages, min_block_h)
    return replace(
        DecodeAttentionConfig.for_device(torch.device(DEVICE)),
        tiles_16bit=tiles,
        tiles_fp32=tiles,
        tiles_fp8=tiles,
        tiles_fp8_fallback=tiles,
    )


def _decode(case, head_dim, splits, config=None, q=None):
    """paged_attention_decode of fp8_decode_case's rows (q: in its place) into a tensor
    of 7.0s; the output."""
    from pagoda.kernels.attention.paged_decode import paged_attention_decode

    q = (case["q"] if q is None else q).to(DEVICE)
    out = torch.full_like(q, 7.0)
    paged_attention_decode(
        out,
        q,
        case["cache"].to(DEVICE),
        case["tables"].to(DEVICE),
        case["qsl"].to(DEVICE),
        case["seq"].to(DEVICE),
        len(case["seq"]),
        1 / math.sqrt(head_dim),
        splits,
        min_split_tokens=1,
        config=config,
        kv_scales=case["scales"].to(DEVICE),
    )
    return out


@pytest.mark.parametrize(
    "head_dim,num_heads,num_kv_heads,splits",
    [
        (64, 8, 2, 1),
        (64, 8, 2, 3),  # slices and the merge: the V scale before the merge
        (128, 4, 1, 7),  # more slices than some requests have tiles: empty slices
    ],
)
# The word kernel, and the tile kernel that reads an FP8 cache the word kernel cannot
# (float32 queries here); query rows padded to 16 and to 4 (the default FP8 tiles').
@pytest.mark.parametrize("kernel,min_block_h", [("words", 16), ("words", 4), ("tile", 16)])
def test_decode_fp8_kernels_match_torch_ref(
    head_dim, num_heads, num_kv_heads, splits, kernel, min_block_h
):
    case = fp8_decode_case(
        [37, 20, 1, 130, 64], num_heads, num_kv_heads, head_dim, 16, quantized_q=kernel == "words"
    )
    q = case["q"] if kernel == "words" else case["q"].float()
    out = _decode(case, head_dim, splits, _tiles(min_block_h=min_block_h), q=q)
    rows = case["decode_rows"]
    torch.testing.assert_close(out[rows].float().cpu(), case["ref"][rows], atol=3e-3, rtol=3e-3)
    skipped = [r for r in range(q.shape[0]) if r not in rows]
    assert (out[skipped] == 7.0).all()  # the 3-token request: left to the chunk kernel


def test_word_kernel_ignores_nan_bytes_past_the_context_end():
    """A reused block's stale slots and unused blocks may hold anything, NaN included
    (store_kv keeps a NaN input as NaN): with whole K tiles read, none of it reaches
    the output (K past the end gets score -inf; V past the end is never read). The NaN
    case bites on the GPU only: the interpreter converts the byte 0x7F to a finite
    value, so a V read past the end passes here and fails there."""
    contexts, block_size = [37, 20, 1, 130, 64], 16
    case = fp8_decode_case(contexts, 8, 2, 64, block_size, quantized_q=True)
    raw = case["cache"].view(torch.uint8)
    used = {
        int(case["tables"][r, i])
        for r, ctx in enumerate(contexts)
        for i in range(-(-ctx // block_size))
    }
    for block in set(range(raw.shape[1])) - used:
        raw[:, block] = 0x7F  # e4m3 NaN
    for r, ctx in enumerate(contexts):
        if ctx % block_size:
            raw[:, int(case["tables"][r, ctx // block_size]), ctx % block_size :] = 0x7F
    out = _decode(case, 64, 1, _tiles())
    rows = case["decode_rows"]
    torch.testing.assert_close(out[rows].float().cpu(), case["ref"][rows], atol=3e-3, rtol=3e-3)


def test_word_kernel_offsets_fit_int32_up_to_2_gib():
    from pagoda.kernels.attention.paged_decode import _offsets_fit_32

    page, heads, dim = 16, 8, 128  # 16 KiB a block of one half, e4m3
    fits = torch.empty(
        2, 2**31 // (page * heads * dim), page, heads, dim, dtype=FP8_KV_DTYPE, device="meta"
    )
    over = torch.empty(
        2, 2**31 // (page * heads * dim) + 1, page, heads, dim, dtype=FP8_KV_DTYPE, device="meta"
    )
    assert _offsets_fit_32(fits) and not _offsets_fit_32(over)
    # In bytes, not entries: a bf16 cache of the same blocks spans twice as far.
    assert not _offsets_fit_32(torch.empty(fits.shape, dtype=torch.bfloat16, device="meta"))


def test_query_rounding_of_the_fp8_dot_path():
    """quantize_q_fp8_reference: a power-of-two scale per head bringing its largest
    |value| to at most 448 (and to no less than 224), lossless on values it produced,
    and scale 1 for an all-zero head."""
    from pagoda.kernels.attention.paged_decode import quantize_q_fp8_reference

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(5, 4, 64, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 448.0])[:, None]
    q[0, 0] = 0.0
    q8, scale = quantize_q_fp8_reference(q.to(torch.float16))
    assert scale.shape == (5, 4, 1) and scale[0, 0, 0] == 1.0 and (q8[0, 0].float() == 0).all()
    mantissa, _ = torch.frexp(scale)
    assert (mantissa == 0.5).all()  # powers of two
    top = q8.float().abs().amax(-1)  # [224, 448]: 224 when the largest rounds down to it
    assert ((top[1:] >= 224) & (top[1:] <= 448)).all() and (top[0, 1:] >= 224).all()
    exact = q8.float() * scale
    again_q8, again_scale = quantize_q_fp8_reference(exact)
    assert torch.equal(again_q8.float() * again_scale, exact)


def test_decode_config_picks_the_kernel_and_tiles_by_dtype():
    """16-bit queries on an FP8 cache the word kernel reads: 128-key tiles, 4 warps, 2
    stages, query rows padded to 4; the word kernel refusing the cache (head_dim 32, or
    float32 queries): the tile kernel, the fallback or float32 tiles; a 16-bit cache:
    64-key tiles, 3 stages; the e4m3 pair conversion on CUDA only."""
    from pagoda.kernels.attention import paged_decode as pd
    from pagoda.kernels.attention.decode_config import DecodeAttentionConfig, DecodeTiles

    config = DecodeAttentionConfig.for_capability((9, 0))
    bf16 = torch.bfloat16
    assert config.tiles_for(bf16, True, True) == DecodeTiles(128, 4, 2, min_block_h=4)
    assert config.tiles_for(bf16, True, False) == DecodeTiles(128, 4, 4)
    assert config.tiles_for(bf16, False, False) == DecodeTiles(64, 4, 3)
    assert config.tiles_for(torch.float32, True, False) == DecodeTiles(32, 4, 2)
    assert config.tiles_fp8.block_h(4) == 4 and config.tiles_fp8.block_h(8) == 8
    assert config.tiles_fp8.block_h(1) == 4 and config.tiles_16bit.block_h(4) == 16
    assert config.e4m3_pairs_ptx
    assert not DecodeAttentionConfig.for_device(torch.device("cpu")).e4m3_pairs_ptx
    assert DecodeAttentionConfig.for_capability((12, 0)) == config  # unlisted: Hopper's
    cache = torch.empty(2, 4, 16, 2, 64, dtype=FP8_KV_DTYPE)
    q = torch.empty(1, 8, 64, dtype=bf16)
    assert pd.words_kernel_reads(q, cache)
    assert not pd.words_kernel_reads(q.float(), cache)
    assert not pd.words_kernel_reads(q, cache.to(bf16))
    assert not pd.words_kernel_reads(q[..., :32], cache[..., :32])


@pytest.mark.parametrize("splits", [1, 3])  # 3: slices and the merge
# Query heads a KV head of 4 (Llama-8B), 8 (Qwen3) and 1: BLOCK_H 4, 8 and 4 (3 padded).
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (16, 2), (2, 2)])
def test_default_fp8_decode_matches_torch_ref(splits, num_heads, num_kv_heads):
    """The default FP8 decode (no config: the device's; query rows padded to 4, not 16;
    whole K tiles read), against the reference with the queries rounded as the word
    kernel rounds them."""
    from pagoda.kernels.attention import paged_decode as pd

    contexts = [37, 20, 1, 130, 64, 200, 16, 9]
    case = fp8_decode_case(contexts, num_heads, num_kv_heads, 64, 16, quantized_q=True)
    q = case["q"].to(DEVICE)
    out = torch.full_like(q, 7.0)
    pd.paged_attention_decode(
        out,
        q,
        case["cache"].to(DEVICE),
        case["tables"].to(DEVICE),
        case["qsl"].to(DEVICE),
        case["seq"].to(DEVICE),
        len(contexts),
        1 / math.sqrt(64),
        splits,
        min_split_tokens=1,
        kv_scales=case["scales"].to(DEVICE),
    )
    rows = case["decode_rows"]
    torch.testing.assert_close(out[rows].float().cpu(), case["ref"][rows], atol=3e-3, rtol=3e-3)
    assert (out[[r for r in range(q.shape[0]) if r not in rows]] == 7.0).all()


def test_fp8_caches_the_word_kernel_cannot_read_take_the_tile_kernel():
    """head_dim 32 (planes narrower than a dot's 16 columns) with 16-bit queries: the
    default config sends the call to the tile kernel, which reads the cache exactly."""
    case = fp8_decode_case([37, 20, 1, 70], 4, 1, 32, 16)
    out = _decode(case, 32, 2)
    rows = case["decode_rows"]
    torch.testing.assert_close(out[rows].float().cpu(), case["ref"][rows], atol=3e-3, rtol=3e-3)


import triton.language as tl  # noqa: E402

from pagoda.kernels.attention.fp8_decode_words import word_planes  # noqa: E402  (after the reload above)


@triton.jit
def _planes_kernel(words_ptr, out_ptr, N: tl.constexpr, PTX_PAIRS: tl.constexpr):
    offs = tl.arange(0, N)
    b0, b1, b2, b3 = word_planes(tl.load(words_ptr + offs)[None, :], PTX_PAIRS)
    tl.store(out_ptr + offs[None, :], b0)
    tl.store(out_ptr + N + offs[None, :], b1)
    tl.store(out_ptr + 2 * N + offs[None, :], b2)
    tl.store(out_ptr + 3 * N + offs[None, :], b3)


@pytest.mark.parametrize(
    "ptx_pairs",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                DEVICE != "cuda", reason="inline PTX (the paired e4m3 conversion) runs on CUDA only"
            ),
        ),
    ],
)
def test_word_planes_convert_every_finite_e4m3_byte_exactly(ptx_pairs):
    """The decode word path's conversion: every finite e4m3 byte, in each of the four
    byte positions of a word, gives the e4m3 value."""
    finite = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    # byte j of word i is finite[(i + 64 j) % 254]: each position sees every byte
    idx = (torch.arange(256).view(1, 256) + 64 * torch.arange(4).view(4, 1)) % finite.numel()
    entries = finite[idx]  # [4 positions, 256 words]
    words = entries.t().contiguous().view(torch.int32).view(-1)
    out = torch.empty(4, 256, dtype=torch.float16, device=DEVICE)
    _planes_kernel[(1,)](words.to(DEVICE), out, N=256, PTX_PAIRS=ptx_pairs)
    expect = entries.view(FP8_KV_DTYPE).float()
    assert torch.equal(out.float().cpu(), expect)
