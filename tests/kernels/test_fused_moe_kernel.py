"""The fused MoE Triton kernel (pagoda.kernels.moe.fused_moe) against its torch reference.

Without CUDA it runs under TRITON_INTERPRET=1 (set by conftest) in float32 and float16
on small shapes: several token counts including 1, uneven expert loads, experts with
no tokens, choices of another rank's experts (-1), and every tile configuration; each
path (GEMV decode kernels, grouped GEMMs with the SiLU-and-mul epilogue). The
block alignment is checked exactly against a plain Python sort. With CUDA the same
cases run compiled, plus bfloat16 at the Qwen3-30B-A3B layer shape and a CUDA graph.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
from helpers.interpreted_kernels import kernel_modules  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def fm():
    return kernel_modules("moe.align", "moe.fused_moe_decode", "moe.fused_moe")[2]


def _case(
    tokens: int,
    experts: int,
    hidden: int,
    inter: int,
    top_k: int,
    dtype: torch.dtype,
    seed: int = 0,
    skew: bool = False,
    foreign: bool = False,
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    scores = torch.rand(tokens, experts, generator=gen)
    if skew:  # most tokens pick experts 0 and 1; the last expert is never chosen
        scores[:, :2] += 2.0
        scores[:, -1] = -1.0
    weights, ids = torch.topk(scores.softmax(-1), top_k, dim=-1)
    ids = ids.int()
    if foreign:  # choices of experts held by another rank
        ids[::3, 0] = -1
    to = dict(device=DEVICE)
    return (
        x.to(dtype).to(**to),
        w13.to(dtype).to(**to),
        w2.to(dtype).to(**to),
        weights.float().to(**to),
        ids.to(**to),
    )


def _small_gemv_tiles():
    """The default MoE config with small GEMV tiles (both kernels loop over several
    reduction chunks and column blocks) and the wide down tiles at every width."""
    from dataclasses import replace

    from pagoda.kernels.moe.config import DownTiles, GateUpTiles, MoEKernelConfig

    return replace(
        MoEKernelConfig.for_capability((9, 0)),
        gate_up=GateUpTiles(block_n=8, block_k=16, num_warps=1, num_stages=2),
        down=DownTiles(block_n=16, block_k=8, num_warps=1, loop_stages=1),
        narrow_down_max=0,
    )


def _unfused_moe(fm, hidden, w13, w2, topk_weights, topk_ids):
    """The grouped GEMMs without the SiLU-and-mul epilogue: gate/up to [pairs, 2I],
    fused_ops.silu_and_mul, down, the sum over the choices (the epilogue's reference
    composition of kernels)."""
    from pagoda.kernels.norm.fused_ops import silu_and_mul

    num_pairs = topk_ids.numel()
    gate_up_tiles = fm.pick_config(num_pairs, w13.shape[0], w13.element_size())
    down_tiles = fm.pick_config(num_pairs, w13.shape[0], w13.element_size(), gemm="down")
    sorted_ids, expert_ids, used = fm.moe_align_block_size(
        topk_ids, gate_up_tiles["BLOCK_M"], w13.shape[0]
    )
    weights = topk_weights.reshape(-1).float().contiguous()
    gate_up = torch.empty(num_pairs, w13.shape[1], dtype=hidden.dtype, device=hidden.device)
    fm._grouped_gemm(
        hidden,
        w13,
        gate_up,
        weights,
        sorted_ids,
        expert_ids,
        used,
        topk_ids.shape[1],
        False,
        gate_up_tiles,
    )
    act = silu_and_mul(gate_up)
    rows = torch.empty(num_pairs, w2.shape[1], dtype=hidden.dtype, device=hidden.device)
    fm._grouped_gemm(act, w2, rows, weights, sorted_ids, expert_ids, used, 1, True, down_tiles)
    return fm.sum_choices(rows, topk_ids.shape[1])


def _align_by_hand(ids: torch.Tensor, block_m: int, experts: int):
    flat = ids.reshape(-1).tolist()
    rows, blocks = [], []
    for bucket in list(range(experts)) + [-1]:
        pairs = [i for i, e in enumerate(flat) if e == bucket]
        padded = -(-len(pairs) // block_m) * block_m
        rows += pairs + [len(flat)] * (padded - len(pairs))
        blocks += [bucket] * (padded // block_m)
    return rows, blocks


@pytest.mark.parametrize("use_kernel", [False, True])  # torch ops / one Triton program
@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_block_size_exact(fm, block_m, use_kernel):
    ids = torch.tensor([[2, 0], [2, -1], [1, 2], [4, 2], [0, -1]], dtype=torch.int32)
    sorted_ids, expert_ids, used = fm.moe_align_block_size(ids.to(DEVICE), block_m, 5, use_kernel)
    rows, blocks = _align_by_hand(ids, block_m, 5)
    assert int(used) == len(rows)
    assert sorted_ids[: len(rows)].tolist() == rows
    assert (sorted_ids[len(rows) :] == ids.numel()).all()
    assert expert_ids[: len(blocks)].tolist() == blocks
    assert (expert_ids[len(blocks) :] == -1).all()
    # The fixed bound: T*k + (E+1)*(block_m-1), rounded up to block_m.
    bound = ids.numel() + 6 * (block_m - 1)
    assert sorted_ids.numel() == -(-bound // block_m) * block_m


# Up to 256 pairs one program; above, the chunked launches (257: a last chunk of one
# pair; 2,048: batch 256 of a top-8 model; 2,560: 40 chunks; 17,000: 266 chunks, more
# than one tile of the scan over chunks).
@pytest.mark.parametrize(
    "pairs,experts,block_m",
    [
        (1, 3, 16),
        (40, 6, 16),
        (256, 128, 16),
        (257, 5, 16),
        (600, 7, 4),
        (2048, 128, 32),
        (2560, 64, 16),
        (17000, 9, 8),
    ],
)
def test_align_kernel_matches_torch_ops(fm, pairs, experts, block_m):
    gen = torch.Generator().manual_seed(pairs)
    ids = torch.randint(-1, experts, (pairs, 1), generator=gen, dtype=torch.int32).to(DEVICE)
    ids[: pairs // 2] = ids[: pairs // 2] % 2  # uneven: half the pairs on experts 0 and 1
    for got, want in zip(
        fm.moe_align_block_size(ids, block_m, experts, use_kernel=True),
        fm.moe_align_block_size(ids, block_m, experts, use_kernel=False),
    ):
        assert torch.equal(got, want)


def test_align_chunked_exact_by_hand(fm):
    """The chunked kernels against a plain Python sort: 300 pairs of top-3 choices, so
    one token's choices straddle the first chunk's end, with another rank's experts."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(-1, 6, (100, 3), generator=gen, dtype=torch.int32)
    sorted_ids, expert_ids, used = fm.moe_align_block_size(ids.to(DEVICE), 8, 6, use_kernel=True)
    rows, blocks = _align_by_hand(ids, 8, 6)
    assert int(used) == len(rows)
    assert sorted_ids[: len(rows)].tolist() == rows
    assert (sorted_ids[len(rows) :] == ids.numel()).all()
    assert expert_ids[: len(blocks)].tolist() == blocks
    assert (expert_ids[len(blocks) :] == -1).all()


def test_align_default_path_per_device(fm):
    """On the CPU the default takes the kernels (interpreted) only up to one program's
    pairs, torch ops above; the two agree, here at a prefill-sized count."""
    from pagoda.kernels.moe import align as moe_align

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 16, (3000, 2), generator=gen, dtype=torch.int32).to(DEVICE)
    default = fm.moe_align_block_size(ids, 64, 16)
    kernels = fm.moe_align_block_size(ids, 64, 16, use_kernel=True)
    for got, want in zip(kernels, default):
        assert torch.equal(got, want)
    assert moe_align.SMALL_ALIGN_PAIRS < ids.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 8, 64), (13, 6, 200), (9, 1, 1030)])
def test_sum_choices_matches_torch(fm, dtype, tokens, top_k, hidden):
    """The sum over each token's k rows: float32 in choice order, one rounding; edges
    of the token and hidden tiles included. Exact in float16 (the sum of a few float16
    values is exact in float32), to float32 rounding in float32."""
    gen = torch.Generator().manual_seed(tokens)
    rows = torch.randn(tokens * top_k, hidden, generator=gen).to(dtype).to(DEVICE)
    want = rows.float().view(tokens, top_k, hidden).sum(dim=1).to(dtype)
    got = fm.sum_choices(rows, top_k)
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    if dtype == torch.float16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


CASES = [
    (1, 8, 2, False, False),
    (7, 6, 3, True, False),
    (33, 4, 2, True, True),
    (5, 8, 1, False, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "path,tokens,experts,top_k,skew,foreign",
    [
        (path, *case)
        for path in ("gemv", "fused")
        for case in CASES
        if path != "gemv" or case[0] < 33
    ],
)  # GEMV: decode sizes (and the interpreter is slow)
def test_fused_moe_matches_reference(fm, path, dtype, tokens, experts, top_k, skew, foreign):
    """Every path: the GEMV decode kernels, and the grouped GEMMs with the SiLU-and-mul
    in the epilogue."""
    args = _case(tokens, experts, 32, 48, top_k, dtype, skew=skew, foreign=foreign)
    got = fm.fused_moe(*args, path=path)
    expected = fm.fused_moe_reference(*args)
    assert got.dtype == dtype and got.shape == (tokens, 32)
    scale = expected.float().abs().max().item()
    assert (got.float() - expected.float()).abs().max().item() <= TOLERANCE[dtype] * max(scale, 1)


def test_prefill_tiles_float16_match_reference(fm):
    """600 rows per expert: pick_config's prefill tier as it is, B tiles by tensor
    descriptor, the down GEMM's 256 columns over a hidden size of 32 (one partial block
    whose descriptor rows run into the next expert's)."""
    assert fm.pick_config(1200, 2, 2, "down")["B_TMA"]
    args = _case(600, 2, 32, 48, 2, torch.float16, seed=11, skew=True)
    expected = fm.fused_moe_reference(*args)
    got = fm.fused_moe(*args, path="fused")
    scale = expected.float().abs().max().item()
    assert (got.float() - expected.float()).abs().max().item() <= 2e-3 * max(scale, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_epilogue_equals_unfused(fm, dtype):
    """The SiLU-and-mul epilogue rounds as the unfused kernels do (gate and up to the
    storage dtype, silu before the multiply): float16 results are the same bits; float32
    ones differ only by the float32 summation order of differently shaped tiles."""
    args = _case(9, 4, 32, 40, 2, dtype, seed=3, skew=True, foreign=True)
    fused, unfused = fm.fused_moe(*args, path="fused"), _unfused_moe(fm, *args)
    if dtype == torch.float16:
        assert torch.equal(fused, unfused)
    else:
        torch.testing.assert_close(fused, unfused, rtol=1e-6, atol=1e-6)


def test_default_path_choice(fm, monkeypatch):
    from dataclasses import replace

    from pagoda.kernels.moe.config import MoEKernelConfig

    calls = []
    real = fm.fused_moe_gemv
    monkeypatch.setattr(fm, "fused_moe_gemv", lambda *a: calls.append(a[3].shape) or real(*a))
    config = MoEKernelConfig.for_capability((9, 0))
    small = _case(config.gemv_max_pairs // 2, 4, 16, 16, 2, torch.float32)
    large = _case(config.gemv_max_pairs // 2 + 1, 4, 16, 16, 2, torch.float32)
    fm.fused_moe(*small)
    fm.fused_moe(*large)
    assert calls == [small[3].shape]  # decode-sized only
    fm.fused_moe(*small, config=replace(config, gemv_max_pairs=0))
    assert len(calls) == 1  # a config without the GEMV path
    with pytest.raises(ValueError, match="unknown fused_moe path"):
        fm.fused_moe(*small, path="atomic")


def test_gemv_sum_is_deterministic_and_skips_foreign_choices(fm):
    x, w13, w2, weights, ids = _case(3, 6, 24, 40, 3, torch.float32, seed=8)
    first = fm.fused_moe(x, w13, w2, weights, ids, path="gemv")
    assert torch.equal(first, fm.fused_moe(x, w13, w2, weights, ids, path="gemv"))
    # Every choice of token 1 held by another rank: its row is exactly zero.
    ids[1] = -1
    got = fm.fused_moe(x, w13, w2, weights, ids, path="gemv")
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    torch.testing.assert_close(
        got, fm.fused_moe_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_tiles_smaller_than_the_rows(fm, dtype):
    """Small GEMV tiles, so both kernels loop over several reduction chunks and column
    blocks, the last ones partial (H = 40, I = 24: no multiple of 16 or 8)."""
    args = _case(2, 5, 40, 24, 3, dtype, seed=11, foreign=True)
    expected = fm.fused_moe_reference(*args)
    got = fm.fused_moe(*args, path="gemv", config=_small_gemv_tiles())
    scale = expected.float().abs().max().item()
    assert (got.float() - expected.float()).abs().max().item() <= TOLERANCE[dtype] * max(scale, 1)


def test_down_tiles_by_intermediate_width():
    """Narrow experts (Qwen3's 768) get the four-column one-warp down tile with six
    choices in flight, wider ones (DeepSeek-V2-Lite's 1408) two warps and three; each
    with its whole row as one chunk, up to 2048 columns."""
    from pagoda.kernels.moe.config import MoEKernelConfig

    config = MoEKernelConfig.for_capability((9, 0))
    narrow = config.down_tiles(768).launch(768)
    wide = config.down_tiles(1408).launch(1408)
    assert (
        narrow["BLOCK_N"],
        narrow["num_warps"],
        narrow["BLOCK_K"],
        narrow["ONE_CHUNK"],
        narrow["LOOP_STAGES"],
    ) == (4, 1, 1024, True, 6)
    assert (
        wide["BLOCK_N"],
        wide["num_warps"],
        wide["BLOCK_K"],
        wide["ONE_CHUNK"],
        wide["LOOP_STAGES"],
    ) == (4, 2, 2048, True, 3)
    chunked = config.down_tiles(4096).launch(4096)
    assert (chunked["BLOCK_K"], chunked["ONE_CHUNK"]) == (256, False)


@pytest.mark.parametrize("b_tma", [False, True])
@pytest.mark.parametrize("num_pairs", [8, 200, 1000, 5000])
def test_every_tile_config_matches_reference(fm, num_pairs, b_tma):
    """Each of the grouped GEMMs' tiers, with B tiles by pointer loads and by tensor
    descriptor (TMA), forced on one small case (the interpreter is slow, so the shape
    stays small while the tiles change). N = 24 and 40 leave a partial column block: the
    descriptor's rows past N must not leak into the stored columns."""
    from dataclasses import replace

    from pagoda.kernels.moe.config import GroupedTier, MoEKernelConfig

    config = MoEKernelConfig.for_capability((9, 0))
    gate_up, down = (
        replace(config.grouped_tiles(num_pairs, 4, 4, gemm), b_tma=b_tma)
        for gemm in ("gate_up", "down")
    )
    forced = replace(config, grouped_tiers=(GroupedTier(None, gate_up, down, gate_up, down),))
    args = _case(9, 4, 24, 40, 2, torch.float32, seed=num_pairs, skew=True, foreign=True)
    torch.testing.assert_close(
        fm.fused_moe(*args, path="fused", config=forced),
        fm.fused_moe_reference(*args),
        rtol=1e-5,
        atol=1e-5,
    )


def test_tma_needs_a_contiguous_aligned_weight(fm):
    w = torch.zeros(2, 8, 16)
    assert fm.tma_takes(w)
    assert not fm.tma_takes(w[:, :, :3])  # rows of 12 bytes, and not contiguous
    assert not fm.tma_takes(w.transpose(1, 2))


def test_tiles_fit_shared_memory():
    """Triton's pipeline keeps num_stages - 1 buffers of the A tile and the B tiles (two
    with the gate/up epilogue) in shared memory: seen on the H200, where 32 x 128 x 128
    float32 tiles at 3 stages asked for 294,912 bytes of its 232,448. Every tier of
    pick_config, for 2- and 4-byte operands, must stay under it."""
    from pagoda.kernels.moe import fused_moe as fm_module

    for element_size in (2, 4):
        for pairs in (64, 2_000, 40_000):  # 8, 250 and 5,000 rows per expert of 8
            for gemm, b_tiles in (("gate_up", 2), ("down", 1)):
                c = fm_module.pick_config(pairs, 8, element_size, gemm)
                tile = c["BLOCK_M"] * c["BLOCK_K"] + b_tiles * c["BLOCK_N"] * c["BLOCK_K"]
                assert tile * element_size * (c["num_stages"] - 1) <= 232_448 - 4096, c
    with pytest.raises(ValueError, match="gemm must be"):
        fm_module.pick_config(64, 8, 2, "up")


def test_no_tokens_and_shape_errors(fm):
    x, w13, w2, weights, ids = _case(3, 4, 16, 16, 2, torch.float32)
    empty = fm.fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 16)
    with pytest.raises(ValueError, match="w2 must be"):
        fm.fused_moe(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="must both be"):
        fm.fused_moe(x, w13, w2, weights[:, :1], ids)


@gpu
def test_bfloat16_qwen3_30b_layer_shape_and_cuda_graph(fm):
    for tokens in (1, 2, 64, 4096):
        args = _case(tokens, 128, 2048, 768, 8, torch.bfloat16, seed=tokens)
        expected = fm.fused_moe_reference(*args)
        scale = expected.float().abs().max().item()
        for path in fm.PATHS if tokens <= 64 else ("fused",):
            got = fm.fused_moe(*args, path=path)
            assert (got.float() - expected.float()).abs().max().item() <= 2e-2 * scale
    for tokens in (1, 4):  # the GEMV path, then the grouped GEMMs
        args = _case(tokens, 128, 2048, 768, 8, torch.bfloat16, seed=5)
        fm.fused_moe(*args)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fm.fused_moe(*args)
        fresh = _case(tokens, 128, 2048, 768, 8, torch.bfloat16, seed=6)
        for dst, src in zip(args, fresh):
            dst.copy_(src)
        graph.replay()
        torch.testing.assert_close(out, fm.fused_moe(*fresh))


def _shared_mlp(hidden: int, inter: int, chunks: int, dtype: torch.dtype, seed: int):
    """A shared MLP's (gate_up [2 * Is, H], down [H, Is]) weights, Is = chunks * inter."""
    gen = torch.Generator().manual_seed(seed)
    shared_inter = chunks * inter
    gate_up = torch.randn(2 * shared_inter, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(hidden, shared_inter, generator=gen) * shared_inter**-0.5
    return gate_up.to(dtype).to(DEVICE), down.to(dtype).to(DEVICE)


def _shared_reference(x, gate_up, down):
    """GatedMLP's torch order of roundings: the projection, silu, the product, down."""
    g, u = (x @ gate_up.t()).chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u) @ down.t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("small_tiles", [False, True])
def test_gemv_adds_the_shared_mlp_in_its_launches(fm, dtype, small_tiles):
    """A shared MLP of two expert-sized chunks rides along the GEMV kernels: the result is
    the routed sum plus the shared MLP, each rounded on its own, then added (DeepSeek's
    block); with small tiles both kernels loop over several chunks of each row; a token
    whose choices are all another rank's still gets the shared MLP."""
    config = _small_gemv_tiles() if small_tiles else None
    x, w13, w2, weights, ids = _case(3, 5, 40, 24, 2, dtype, seed=13)
    ids[1] = -1
    gate_up, down = _shared_mlp(40, 24, 2, dtype, seed=14)
    got = fm.fused_moe(x, w13, w2, weights, ids, shared=(gate_up, down), config=config)
    expected = fm.fused_moe_reference(x, w13, w2, weights, ids) + _shared_reference(
        x, gate_up, down
    )
    assert got.dtype == dtype and got.shape == (3, 40)
    scale = expected.float().abs().max().item()
    assert (got.float() - expected.float()).abs().max().item() <= TOLERANCE[dtype] * max(scale, 1)
    assert torch.equal(
        got, fm.fused_moe(x, w13, w2, weights, ids, shared=(gate_up, down), config=config)
    )


def test_shared_mlp_refusals(fm):
    x, w13, w2, weights, ids = _case(1, 4, 32, 16, 2, torch.float32)
    with pytest.raises(ValueError, match="no whole number"):
        fm.fused_moe(x, w13, w2, weights, ids, shared=_shared_mlp(32, 24, 1, torch.float32, 0))
    with pytest.raises(ValueError, match="gemv path only"):
        fm.fused_moe(
            x, w13, w2, weights, ids, path="fused", shared=_shared_mlp(32, 16, 2, torch.float32, 0)
        )
