"""FP8 (e4m3fn) quantization: weights at load time (torch) and activations per step
(Triton, with torch references).

Owns:
- ``quantize_weight_per_channel(w)`` -> (w_fp8 [N, K], scale [N] float32): one scale per
  output row (scale = amax(row) / 448);
- ``quantize_weight_blockwise(w, block)`` -> (w_fp8 [N, K], scale [ceil(N/bn), ceil(K/bk)]):
  DeepSeek-style 128 x 128 weight blocks;
- ``per_token_quant_fp8(x)`` -> (x_fp8 [M, K], scale [M, 1]): dynamic per-row activation
  scales, one Triton program per row;
- ``per_token_group_quant_fp8(x, group)`` -> (x_fp8 [M, K], scale [M, ceil(K/group)]): one
  scale per row and group of `group` columns (the activation side of block-scaled weights);
- the torch references of both activation kernels and the dequantizers used by every
  reference matmul in pagoda.kernels.fp8.linear.

Conventions (the same in kernels and references, so they agree bit for bit under the
interpreter): scale = max(amax / 448, FLOAT32_TINY) in float32, q = clamp(x / scale,
-448, 448) rounded to nearest-even by the cast. The guard keeps a zero row (or a row whose
amax / 448 underflows) from dividing by zero: its values quantize to 0 and dequantize to 0,
and no value can overflow because |x| <= amax <= 448 * scale. Values are dequantized as
q * scale. Non-finite weights are refused at load time (a single inf would zero its row).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)  # the smallest normal float32
# Rows of a weight quantized at once: bounds the float32 temporaries at load time
# (a 128256 x 4096 LM head would otherwise need 2 GiB of them).
_QUANT_CHUNK_ELEMENTS = 1 << 25


def triton_usable(t: torch.Tensor) -> bool:
    """Triton kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1
    (the CPU tests); elsewhere callers use the torch path, which computes the same."""
    return t.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    return torch.clamp(amax.float() / FP8_MAX, min=FLOAT32_TINY)


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _check_weight(w: torch.Tensor) -> None:
    if w.dim() != 2 or not w.is_floating_point() or w.dtype == FP8_DTYPE:
        raise ValueError(f"expected a 2-D float weight [N, K], got {tuple(w.shape)} {w.dtype}")


def _check_finite(amax: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(f"{what}: the weight has non-finite values; FP8 cannot hold them")


# ------------------------------------------------------------------ weights --------
def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (bf16/fp16/fp32) -> (w_fp8 [N, K] float8_e4m3fn, scale [N] float32),
    w ~= w_fp8 * scale[:, None]. Quantized in chunks of rows (bounded temporaries)."""
    _check_weight(w)
    n, k = w.shape
    q = torch.empty(n, k, dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty(n, dtype=torch.float32, device=w.device)
    rows = max(1, _QUANT_CHUNK_ELEMENTS // max(k, 1))
    for r0 in range(0, n, rows):
        chunk = w[r0 : r0 + rows]
        amax = chunk.abs().amax(dim=1) if k else torch.zeros(chunk.shape[0], device=w.device)
        _check_finite(amax, "quantize_weight_per_channel")
        s = _scale_from_amax(amax)
        scale[r0 : r0 + rows] = s
        q[r0 : r0 + rows] = _to_fp8(chunk, s[:, None])
    return q, scale


def quantize_weight_blockwise(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (w_fp8 [N, K], scale [ceil(N/bn), ceil(K/bk)] float32): one scale per
    bn x bk block (edge blocks are partial). w ~= w_fp8 * scale expanded over blocks."""
    _check_weight(w)
    bn, bk = _check_block(block)
    n, k = w.shape
    nb, kb = triton.cdiv(n, bn), triton.cdiv(k, bk)
    q = torch.empty(n, k, dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty(nb, kb, dtype=torch.float32, device=w.device)
    # Chunks of whole row blocks; each chunk is zero-padded to full blocks (zeros do not
    # change an amax) so the blocks are a reshape away.
    blocks_per_chunk = max(1, _QUANT_CHUNK_ELEMENTS // max(bn * kb * bk, 1))
    for b0 in range(0, nb, blocks_per_chunk):
        r0, r1 = b0 * bn, min(n, (b0 + blocks_per_chunk) * bn)
        rows_b = triton.cdiv(r1 - r0, bn)
        padded = torch.zeros(rows_b * bn, kb * bk, dtype=torch.float32, device=w.device)
        padded[: r1 - r0, :k] = w[r0:r1]
        tiles = padded.view(rows_b, bn, kb, bk)
        amax = tiles.abs().amax(dim=(1, 3))
        _check_finite(amax, "quantize_weight_blockwise")
        s = _scale_from_amax(amax)
        scale[b0 : b0 + rows_b] = s
        q[r0:r1] = _to_fp8(tiles, s[:, None, :, None]).view(rows_b * bn, kb * bk)[: r1 - r0, :k]
    return q, scale


def _check_block(block) -> tuple[int, int]:
    if len(block) != 2 or min(block) <= 0:
        raise ValueError(f"block must be two positive sizes (rows, cols), got {block}")
    return int(block[0]), int(block[1])


def dequantize_per_channel(w_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """-> float32 [N, K] = w_fp8 * scale[:, None] (the references' weight)."""
    return w_fp8.float() * scale.float().reshape(-1, 1)


def dequantize_blockwise(
    w_fp8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """-> float32 [N, K]: each bn x bk block of w_fp8 times its scale."""
    bn, bk = _check_block(block)
    n, k = w_fp8.shape
    full = scale.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return w_fp8.float() * full


# ------------------------------------------------------------- activations ---------
def per_token_quant_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of per_token_quant_fp8."""
    amax = x.abs().amax(dim=-1, keepdim=True) if x.shape[-1] else x.new_zeros(x.shape[0], 1)
    scale = _scale_from_amax(amax)
    return _to_fp8(x, scale), scale


def per_token_group_quant_fp8_ref(
    x: torch.Tensor, group: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of per_token_group_quant_fp8."""
    m, k = x.shape
    groups = triton.cdiv(k, group)
    padded = x.new_zeros(m, groups * group, dtype=torch.float32)
    padded[:, :k] = x
    tiles = padded.view(m, groups, group)
    scale = _scale_from_amax(tiles.abs().amax(dim=-1))
    q = _to_fp8(tiles, scale[:, :, None]).view(m, groups * group)[:, :k]
    return q.contiguous(), scale


@triton.jit
def round_to_e4m3(v):
    """float32 v in [-448, 448] -> v rounded to nearest-even on the e4m3 grid, in float32,
    so the cast to fp8 that follows is exact. Why not just cast: Triton's interpreter
    (3.9) rounds float32 -> float8e4nv wrongly where rounding carries into the next
    binade (31.8 -> 16, not 32) and at ties; this keeps the CPU tests meaningful, and on
    the GPU it is a few integer ops in a memory-bound kernel. The trick: adding
    c = 1.5 * 2^(e + 20) (e: v's binade, at least -6, e4m3's smallest normal one) moves v
    where float32's spacing is e4m3's spacing 2^(e - 3) in that binade, so the add rounds
    it (nearest-even, carries included) and subtracting c is exact."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    c = ((e + 20 + 127) << 23).to(tl.float32, bitcast=True) * 1.5
    r = (v + c) - c
    # (v + c) - c is +0 for small negative v: put v's sign back (torch casts to -0).
    return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    stride_sg,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    TINY: tl.constexpr,
):
    """Program (row, g) quantizes columns [g * GROUP, (g + 1) * GROUP) of one row with
    one scale: two passes over the span (amax, then scale and cast); the second pass
    reads from L2. GROUP >= K (one group) is the per-token case."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    start = g * GROUP
    end = tl.minimum(start + GROUP, K)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(start, end, BLOCK):
        x = tl.load(x_row + k0 + offs, mask=offs < end - k0, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX_C, TINY)
    for k0 in range(start, end, BLOCK):
        ok = offs < end - k0
        x = tl.load(x_row + k0 + offs, mask=ok, other=0.0).to(tl.float32)
        q = round_to_e4m3(tl.minimum(tl.maximum(x / scale, -FP8_MAX_C), FP8_MAX_C))
        tl.store(q_ptr + row * stride_qm + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_sm + g * stride_sg, scale)


def _launch_quant(x: torch.Tensor, group: int, scale: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    if m == 0 or k == 0:
        scale.fill_(FLOAT32_TINY)
        return q
    block = min(triton.next_power_of_2(group), 1024)
    _quant_rows_kernel[(m, scale.shape[1])](
        x,
        q,
        scale,
        k,
        x.stride(0),
        q.stride(0),
        scale.stride(0),
        scale.stride(1),
        GROUP=group,
        BLOCK=block,
        FP8_MAX_C=FP8_MAX,
        TINY=FLOAT32_TINY,
        num_warps=4 if block >= 512 else 1,
    )
    return q


def _check_activation(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise ValueError(f"expected a 2-D float activation [M, K], got {tuple(x.shape)} {x.dtype}")
    return x if x.stride(-1) == 1 else x.contiguous()


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32) -> (x_fp8 [M, K], scale [M, 1] float32): one scale per
    row, x ~= x_fp8 * scale. One Triton program per row (torch where Triton cannot run)."""
    x = _check_activation(x)
    if not triton_usable(x):
        return per_token_quant_fp8_ref(x)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    # The whole row is one group (GROUP >= K), walked in chunks of at most 1024.
    return _launch_quant(x, max(x.shape[1], 1), scale), scale


def per_token_group_quant_fp8(
    x: torch.Tensor, group: int = 128, column_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K], scale [M, ceil(K/group)] float32), one scale per row and
    group of `group` columns (the last group may be partial). column_major=True lays the
    scales out with stride (1, M) (what cuBLAS's 1x128 block scaling reads)."""
    x = _check_activation(x)
    if group <= 0:
        raise ValueError(f"group must be positive, got {group}")
    if not triton_usable(x):
        q, s = per_token_group_quant_fp8_ref(x, group)
        return q, (s.t().contiguous().t() if column_major else s)
    m, groups = x.shape[0], triton.cdiv(x.shape[1], group)
    if column_major:
        scale = torch.empty(groups, m, dtype=torch.float32, device=x.device).t()
    else:
        scale = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    return _launch_quant(x, group, scale), scale
