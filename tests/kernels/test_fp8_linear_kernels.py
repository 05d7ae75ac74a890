"""FP8 weight quantization and matmul kernels (pagoda.kernels.fp8.quant, fp8_linear)
against their torch references.

Without CUDA the Triton kernels run under TRITON_INTERPRET=1 (set by conftest) on small
shapes in float16/float32. The interpreter handles float8_e4m3fn tensors directly (loads,
conversions both ways, stores, tl.dot): the first test pins that down, so the kernels take
the fp8 tensors as they are, with no uint8 views. Covered: weight quantization round
trips and exact scales, zero rows, non-finite weights refused, chunked quantization equal
to unchunked, activation quantization bit-exact with its reference (per token and per
group, both scale layouts), the W8A16 kernel (GEMV and dot paths, split-K, bias), the
W8A8 GEMM (per channel and block scaled), the dispatch by rows, shapes that are not
multiples of any tile or block, the rejected arguments, and the W8A16 weight decodes
(DECODE "cvt" / "bits": every finite e4m3 code exact, subnormal and +-448 weights through
both scale layouts, one row on either path). With CUDA the same cases run compiled, plus the
torch._scaled_mm path and the bfloat16 bit decode (the interpreter gets bfloat16 bitcasts
wrong).
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from helpers.interpreted_kernels import kernel_modules  # noqa: E402

from pagoda.kernels.fp8.quant import round_to_e4m3  # noqa: E402

# Jit functions the test kernels below call: imported here, since a compiled kernel
# cannot import (only the interpreter runs an import inside a kernel body).
from pagoda.kernels.fp8.w8a16 import _e4m3_bits_f32, _e4m3_bits_to  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def kq():
    return kernel_modules("fp8.quant")[0]


@pytest.fixture(scope="module")
def kw(kq):
    return kernel_modules("fp8.w8a16")[0]


@pytest.fixture(scope="module")
def kl(kw):
    return kernel_modules("fp8.linear")[0]


def _rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ------------------------------------------------------------- the interpreter -------
@triton.jit
def _fp8_roundtrip_kernel(w_ptr, x_ptr, wf_ptr, q_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(wf_ptr + offs, tl.load(w_ptr + offs).to(tl.float32))
    v = tl.minimum(tl.maximum(tl.load(x_ptr + offs), -448.0), 448.0)
    tl.store(q_ptr + offs, round_to_e4m3(v).to(tl.float8e4nv))


def test_float8_loads_and_rounding_match_torch():
    """fp8 tensors go into kernels as they are; round_to_e4m3 + cast gives torch's bits
    for every e4m3 value, every midpoint (ties to even), carries into the next binade,
    subnormals, signed zeros and out-of-range values (clamped)."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[torch.isfinite(grid)].sort().values
    gen = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            grid,
            (grid[1:] + grid[:-1]) / 2,
            torch.linspace(-500, 500, 3001),
            torch.randn(2000, generator=gen) * 1e-3,
            torch.tensor([0.0, -0.0, 1e-30, -1e-30, 2.0**-10, 3 * 2.0**-11]),
        ]
    )
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())]).to(DEVICE)
    w = x.clamp(-448, 448).to(FP8)
    wf = torch.empty(n, device=DEVICE)
    q = torch.empty(n, dtype=FP8, device=DEVICE)
    _fp8_roundtrip_kernel[(1,)](w, x, wf, q, N=n)
    assert torch.equal(wf, w.float())
    assert torch.equal(_bits(q), _bits(w))


# ------------------------------------------------------------------- weights --------
def _roundtrip_bound(w, deq, scale_full):
    # e4m3: 3 mantissa bits -> half-ulp relative error 2^-4 for normals; below the
    # smallest normal (2^-6 * scale) the spacing is 2^-9 * scale.
    return ((w - deq).abs() <= w.abs() / 16 + scale_full * 2.0**-10 + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_per_channel_weight_quant(kq, dtype):
    w = _rand(37, 70, dtype=dtype, seed=1)
    w[5] = 0  # a zero row
    w[9] *= 1e-3
    q, s = kq.quantize_weight_per_channel(w)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (37,)
    amax = w.float().abs().amax(dim=1)
    nz = amax > 0
    assert torch.equal(s[nz], amax[nz] / 448.0)
    assert (q.float().abs().amax(dim=1)[nz] == 448).all()
    assert s[5] > 0 and (q[5].float() == 0).all()
    deq = kq.dequantize_per_channel(q, s)
    assert (deq[5] == 0).all()
    assert _roundtrip_bound(w.float(), deq, s[:, None])


def test_per_channel_chunks_match_one_pass(kq, monkeypatch):
    w = _rand(33, 50, seed=2)
    q1, s1 = kq.quantize_weight_per_channel(w)
    monkeypatch.setattr(kq, "_QUANT_CHUNK_ELEMENTS", 120)  # 2 rows per chunk
    q2, s2 = kq.quantize_weight_per_channel(w)
    assert torch.equal(_bits(q1), _bits(q2)) and torch.equal(s1, s2)


@pytest.mark.parametrize("block", [(128, 128), (16, 32)])
def test_blockwise_weight_quant(kq, block, monkeypatch):
    monkeypatch.setattr(kq, "_QUANT_CHUNK_ELEMENTS", 5000)  # several chunks
    bn, bk = block
    w = _rand(150, 200, seed=3)
    w[:bn, :bk] = 0  # a zero block
    q, s = kq.quantize_weight_blockwise(w, block)
    assert s.shape == (triton.cdiv(150, bn), triton.cdiv(200, bk))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            amax = tile.abs().max()
            want = amax / 448.0 if amax > 0 else torch.tensor(kq.FLOAT32_TINY)
            assert s[i, j].item() == pytest.approx(want.item(), rel=0, abs=0)
    deq = kq.dequantize_blockwise(q, s, block)
    assert (deq[:bn, :bk] == 0).all()
    full = s.repeat_interleave(bn, 0)[:150].repeat_interleave(bk, 1)[:, :200]
    assert _roundtrip_bound(w, deq, full)


def test_weight_quant_refuses_bad_input(kq):
    w = _rand(4, 8)
    w[1, 2] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        kq.quantize_weight_per_channel(w)
    with pytest.raises(ValueError, match="non-finite"):
        kq.quantize_weight_blockwise(w, (2, 4))
    with pytest.raises(ValueError, match="2-D float weight"):
        kq.quantize_weight_per_channel(_rand(8))
    with pytest.raises(ValueError, match="block must be"):
        kq.quantize_weight_blockwise(_rand(4, 8), (0, 4))


# ---------------------------------------------------------------- activations ------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k", [1, 96, 2500])  # 2500: several 1024-wide chunks
def test_per_token_quant_matches_reference(kq, dtype, k):
    x = _rand(6, k, dtype=dtype, seed=4, scale=3.0)
    x[2] = 0
    q, s = kq.per_token_quant_fp8(x)
    rq, rs = kq.per_token_quant_fp8_ref(x)
    assert s.shape == (6, 1) and q.shape == (6, k)
    assert torch.equal(s, rs)
    assert torch.equal(_bits(q), _bits(rq))
    assert (q[2].float() == 0).all()


@pytest.mark.parametrize("group,k", [(128, 300), (64, 256), (32, 20)])
@pytest.mark.parametrize("column_major", [False, True])
def test_per_token_group_quant_matches_reference(kq, group, k, column_major):
    x = _rand(5, k, dtype=torch.float16, seed=5, scale=2.0)
    x[1, :group] = 0  # a zero group
    q, s = kq.per_token_group_quant_fp8(x, group, column_major=column_major)
    rq, rs = kq.per_token_group_quant_fp8_ref(x, group)
    assert s.shape == (5, triton.cdiv(k, group))
    assert s.stride() == ((1, 5) if column_major else (s.shape[1], 1))
    assert torch.equal(s, rs)
    assert torch.equal(_bits(q), _bits(rq))


def test_empty_activation(kq):
    q, s = kq.per_token_quant_fp8(_rand(0, 16))
    assert q.shape == (0, 16) and s.shape == (0, 1)


# ------------------------------------------------------------------- matmuls --------
def _close(out, ref, dtype, fp8_mma: bool = False):
    """fp8_mma: the product ran on the FP8 tensor cores (W8A8), whose accumulation on
    Hopper keeps fewer bits than float32: 2e-4 of the output scale measured on the H200
    at 33 rows of float32 activations, where the W8A16 paths agree within 1e-4."""
    tol = 2e-2 if dtype == torch.float16 else (1e-3 if fp8_mma and ON_GPU else 1e-4)
    scale = ref.float().abs().max().item() + 1e-6
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * scale, f"max abs error {err} vs output scale {scale}"


def _weights(kq, n, k, seed=7):
    return kq.quantize_weight_per_channel(_rand(n, k, seed=seed, scale=0.05))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 16, 33])
def test_fp8_linear_matches_reference(kq, kl, dtype, m):
    n, k = 40, 300  # neither a multiple of any tile
    w, s = _weights(kq, n, k)
    x = _rand(m, k, dtype=dtype, seed=m)
    bias = _rand(n, dtype=dtype, seed=11)
    out = kl.fp8_linear(x, w, s, bias=bias)
    ref = kl.fp8_linear_ref(x, w, s, bias, act_quant=m > kl.W8A16_MAX_M)
    assert out.dtype == dtype and out.shape == (m, n)
    _close(out, ref, dtype, fp8_mma=m > kl.W8A16_MAX_M)


def test_fp8_linear_is_close_to_the_float_matmul(kq, kl):
    w_full = _rand(64, 256, seed=8, scale=0.05)
    w, s = kq.quantize_weight_per_channel(w_full)
    for m in (1, 40):  # both paths: W8A16, and W8A8 (activation quantized too)
        x = _rand(m, 256, seed=9)
        out = kl.fp8_linear(x, w, s)
        exact = x @ w_full.t()
        rel = ((out - exact).norm() / exact.norm()).item()
        assert rel < 0.06, rel


@pytest.mark.parametrize("m", [1, 4, 40])  # 40: a 64-row tile, past the dispatch's 16
def test_w8a16_split_k(kq, kl, kw, m):
    w, s = _weights(kq, 48, 700)
    x = _rand(m, 700, seed=3)
    bias = _rand(48, seed=4)
    cfg = dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=3, num_warps=4)
    out = kw.w8a16_linear(x, w, s, bias=bias, config=cfg)
    _close(out, kl.fp8_linear_ref(x, w, s, bias), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "n,k,config",
    [
        (40, 300, None),  # the default tile; N and K cut by it
        (64, 512, dict(BLOCK_N=8, BLOCK_K=128, SPLIT_K=1, LOOP_STAGES=3, num_warps=4)),
        (24, 256, dict(BLOCK_N=4, BLOCK_K=64, SPLIT_K=1, num_warps=2, DECODE="bits")),
    ],
)
def test_gated_w8a16_is_linear_then_silu_and_mul(kq, kl, kw, dtype, n, k, config):
    """One row of [gate; up] weights through the gated kernel equals the plain W8A16
    GEMV followed by silu_and_mul (the kernel the engine ran after it): the same sums,
    roundings and activation, so the same bits interpreted; compiled, within one ulp."""
    fused_ops = kernel_modules("norm.fused_ops")[0]
    w, s = _weights(kq, 2 * n, k, seed=n)
    x = _rand(1, k, dtype=dtype, seed=k)
    plain_cfg = None if config is None else dict(config, BLOCK_N=2 * config["BLOCK_N"])
    want = fused_ops.silu_and_mul(kw.w8a16_linear(x, w, s, config=plain_cfg))
    if config is None:
        got = kl.fp8_linear_silu_and_mul(x, w, s)
    else:
        got = kw.w8a16_linear(x, w, s, config=config, gated=True)
    assert got.shape == (1, n) and got.dtype == dtype
    if ON_GPU:
        torch.testing.assert_close(got, want, rtol=torch.finfo(dtype).eps, atol=1e-6)
    else:
        assert torch.equal(got, want)
    ref = kl.fp8_linear_ref(x, w, s).float()  # and near the float32 composition
    torch.testing.assert_close(
        got.float(),
        torch.nn.functional.silu(ref[:, :n]) * ref[:, n:],
        rtol=2e-2 if dtype == torch.float16 else 1e-4,
        atol=1e-3,
    )


def test_gated_w8a16_declines_and_refuses(kq, kl, kw):
    w, s = _weights(kq, 32, 64)
    assert kl.fp8_linear_silu_and_mul(_rand(2, 64), w, s) is None  # rows: caller unfuses
    assert kl.fp8_linear_silu_and_mul(_rand(1, 64), w[:31], s[:31]) is None  # odd width
    with pytest.raises(ValueError, match="one row"):
        kw.w8a16_linear(_rand(2, 64), w, s, gated=True)
    with pytest.raises(ValueError, match="SPLIT_K 1"):
        kw.w8a16_linear(
            _rand(1, 64),
            w,
            s,
            gated=True,
            config=dict(BLOCK_N=4, BLOCK_K=32, SPLIT_K=2, num_warps=4),
        )


def test_fp8_linear_leading_dims_out_dtype_and_empty(kq, kl):
    w, s = _weights(kq, 24, 64)
    x = _rand(2, 3, 64, dtype=torch.float16, seed=2)
    out = kl.fp8_linear(x, w, s.view(24, 1), out_dtype=torch.float32)
    assert out.shape == (2, 3, 24) and out.dtype == torch.float32
    ref = kl.fp8_linear_ref(x.reshape(6, 64), w, s, out_dtype=torch.float32)
    _close(out.reshape(6, 24), ref, torch.float32)
    assert kl.fp8_linear(_rand(0, 64), w, s).shape == (0, 24)


def test_scaled_mm_path_matches_reference(kq, kl):
    n, k, m = 48, 64, 24  # _scaled_mm's alignment: K and N multiples of 16
    w, s = _weights(kq, n, k)
    x = _rand(m, k, dtype=torch.float16, seed=5)
    bias = _rand(n, dtype=torch.float16, seed=6)
    xq, xs = kq.per_token_quant_fp8(x)
    try:
        out = kl.scaled_mm_linear(xq, xs, w, s, bias, out_dtype=torch.float16)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"torch._scaled_mm unavailable on {DEVICE}: {exc}")
    _close(out, kl.fp8_linear_ref(x, w, s, bias, act_quant=True), torch.float16)
    if ON_GPU:  # the dispatch takes it for aligned shapes
        assert kl.scaled_mm_usable(x, w, torch.float16)
        assert not kl.scaled_mm_usable(x[:, :60], w[:, :60].contiguous(), torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 7, 40])
@pytest.mark.parametrize("block", [(128, 128), (32, 64)])
def test_fp8_block_linear_matches_reference(kq, kl, dtype, m, block):
    n, k = 150, 200
    w, s = kq.quantize_weight_blockwise(_rand(n, k, seed=12, scale=0.05), block)
    x = _rand(m, k, dtype=dtype, seed=13)
    bias = _rand(n, dtype=dtype, seed=14)
    out = kl.fp8_block_linear(x, w, s, block, bias=bias)
    ref = kl.fp8_block_linear_ref(x, w, s, block, bias, act_quant=m > kl.W8A16_MAX_M)
    assert out.shape == (m, n) and out.dtype == dtype
    _close(out, ref, dtype, fp8_mma=m > kl.W8A16_MAX_M)


def test_w8a8_gemm_tile_configs(kq, kl):
    w, s = _weights(kq, 72, 160)
    x = _rand(50, 160, seed=15)
    xq, xs = kq.per_token_quant_fp8(x)
    ref = kl.fp8_linear_ref(x, w, s, act_quant=True, out_dtype=torch.float32)
    for cfg in (
        dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2),  # K % 32 == 0
        dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=64, GROUP_M=4),
    ):  # K % 64 != 0
        out = kl.w8a8_gemm(xq, xs, w, s, out_dtype=torch.float32, config=cfg)
        _close(out, ref, torch.float32)


def test_rejected_arguments(kq, kl):
    w, s = _weights(kq, 24, 64)
    x = _rand(2, 64)
    with pytest.raises(ValueError, match="w_scale must have 24"):
        kl.fp8_linear(x, w, s[:20])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        kl.fp8_linear(x, w.float(), s)
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        kl.fp8_linear(_rand(2, 32), w, s)
    with pytest.raises(ValueError, match="must be 2-D"):
        kl.fp8_linear(x, w.view(24, 8, 8), s)
    with pytest.raises(ValueError, match="bias must have shape"):
        kl.fp8_linear(x, w, s, bias=_rand(5))
    wb, sb = kq.quantize_weight_blockwise(_rand(24, 64), (16, 16))
    with pytest.raises(ValueError, match="w_scale_blocks must have shape"):
        kl.fp8_block_linear(x, wb, sb, (128, 128))
    wb, sb = kq.quantize_weight_blockwise(_rand(24, 72), (16, 24))
    with pytest.raises(ValueError, match="power-of-two divisor"):
        kl.fp8_block_linear(_rand(20, 72), wb, sb, (16, 24))


# ------------------------------------------------------------ W8A16 decodes --------
def _finite_codes() -> torch.Tensor:
    """Every finite e4m3fn value (254 codes: all but the NaNs 0x7f / 0xff), as fp8."""
    codes = torch.arange(256, dtype=torch.uint8)
    return codes[(codes & 0x7F) != 0x7F].view(FP8)


@triton.jit
def _bits_decode_kernel(w_ptr, f32_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    w = tl.load(w_ptr + offs)
    tl.store(f32_ptr + offs, _e4m3_bits_f32(w))
    tl.store(out_ptr + offs, _e4m3_bits_to(w, out_ptr.dtype.element_ty))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_e4m3_bit_decodes_are_exact(dtype):
    """_e4m3_bits_f32 gives value * 2^-120 exactly (subnormals included, as float32
    subnormals) and _e4m3_bits_to the value itself in each dot dtype, for every code."""
    if dtype == torch.bfloat16 and not ON_GPU:
        pytest.skip("the interpreter gets bfloat16 bitcasts wrong")
    codes = _finite_codes()
    n = 256
    w = torch.cat([codes.view(torch.uint8), torch.zeros(n - codes.numel(), dtype=torch.uint8)])
    w = w.view(FP8).to(DEVICE)
    f32 = torch.empty(n, device=DEVICE)
    out = torch.empty(n, dtype=dtype, device=DEVICE)
    _bits_decode_kernel[(1,)](w, f32, out, N=n)
    assert torch.equal(f32 * 2.0**120, w.float())
    assert (f32[(w.view(torch.uint8) & 0x78) == 0] * 2.0**120).abs().max() < 2.0**-6
    assert torch.equal(out.float(), w.float())


def _extreme_weights(n, k, seed):
    """fp8 [n, k] drawn from every finite code (about 6% subnormal, both +-448), with
    rows of +-448 and of the smallest subnormals only."""
    gen = torch.Generator().manual_seed(seed)
    codes = _finite_codes().view(torch.uint8)
    w = codes[torch.randint(0, codes.numel(), (n, k), generator=gen)]
    w[1] = torch.where(torch.rand(k, generator=gen) < 0.5, 0x7E, 0xFE)  # +-448
    w[2] = torch.randint(0, 8, (k,), generator=gen) | (
        torch.randint(0, 2, (k,), generator=gen) << 7
    )
    return w.to(torch.uint8).view(FP8).to(DEVICE)


@pytest.mark.parametrize("decode", ["cvt", "bits"])
@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("m,dot", [(1, False), (1, True), (5, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_w8a16_decodes_with_subnormal_and_extreme_weights(kl, kw, decode, blocked, m, dot, dtype):
    """Both decodes, both scale layouts, one row on the FMA or the tl.dot path, several
    rows: equal to the torch reference on weights with subnormals and +-448 (row 2 holds
    subnormals only: flushing them would zero its outputs), scales from tiny (2^-60) to
    large (2^10; float16 outputs: 2^-16 to 2^-8, within its range), K not a multiple of
    BLOCK_K (a masked tail)."""
    n, k = 40, 300
    lo, hi = (-60, 11) if dtype == torch.float32 else (-16, -7)
    w = _extreme_weights(n, k, seed=21)
    gen = torch.Generator().manual_seed(22)
    x = (torch.randn(m, k, generator=gen) * 0.5).to(dtype).to(DEVICE)
    if blocked:
        block = (16, 32)
        s = (
            2.0 ** torch.randint(lo, hi, (3, 10), generator=gen).float()
            * torch.rand(3, 10, generator=gen)
        ).to(DEVICE)
        ref = kl.fp8_block_linear_ref(x, w, s, block, out_dtype=torch.float32)
        w_abs = w.float().abs() * s.repeat_interleave(16, 0)[:n].repeat_interleave(32, 1)[:, :k]
    else:
        block = None
        s = (
            2.0 ** torch.randint(lo, hi, (n,), generator=gen).float() * torch.rand(n, generator=gen)
        ).to(DEVICE)
        ref = kl.fp8_linear_ref(x, w, s, out_dtype=torch.float32)
        w_abs = w.float().abs() * s[:, None]
    cfg = dict(
        BLOCK_N=16,
        BLOCK_K=64,
        SPLIT_K=2 if m > 1 else 1,
        num_warps=4,
        LOOP_STAGES=2,
        DECODE=decode,
        DOT=dot,
    )
    out = kw.w8a16_linear(x, w, s, block=block, config=cfg)
    # Each output against the sum of its terms' magnitudes (outputs cancel, and the
    # scales span 70 binades): float32 summation error, or float16's output rounding
    # (down to its subnormals' spacing, 2^-24).
    bound = x.float().abs() @ w_abs.t()
    tol, floor = (2e-3, 2.0**-24) if dtype == torch.float16 else (1e-5, 0.0)
    assert (bound[:, 2] > 0).all()
    assert ((out.float() - ref).abs() <= tol * bound + floor).all()


def test_w8a16_rejects_unknown_decode(kq, kw):
    w, s = _weights(kq, 24, 64)
    with pytest.raises(ValueError, match="DECODE must be one of"):
        kw.w8a16_linear(
            _rand(1, 64),
            w,
            s,
            config=dict(BLOCK_N=8, BLOCK_K=64, SPLIT_K=1, num_warps=4, DECODE="lut"),
        )


def test_w8a16_one_row_tiles_by_shape(kw):
    """One row: 16-column tiles for qkv / o sized projections (K <= 4096, N <= 8192),
    the 8-column rule for long K (down) and wide N (gate/up), 32 x 256 for a vocabulary."""
    short = kw.w8a16_config(1, 4096, 4096)
    assert (short["BLOCK_N"], short["BLOCK_K"], short["LOOP_STAGES"]) == (16, 512, 3)
    assert kw.w8a16_config(1, 6144, 4096) == short
    down, gate_up = kw.w8a16_config(1, 4096, 14336), kw.w8a16_config(1, 28672, 4096)
    assert (down["BLOCK_N"], down["BLOCK_K"], down["LOOP_STAGES"]) == (8, 1024, 4)
    assert (gate_up["BLOCK_N"], gate_up["BLOCK_K"], gate_up["LOOP_STAGES"]) == (8, 512, 3)
    assert kw.w8a16_config(1, 128256, 4096)["BLOCK_N"] == 32
