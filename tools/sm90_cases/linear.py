"""The linear kernels' sm_90 compile cases: RMSNorm and the one-row GEMV, the W8A16
GEMV (the "pdl" and "defaults" groups), and the producers with FP8 output (the
"fp8_fused_quant" group)."""

from __future__ import annotations

import torch

from .shapes import BF16, EXPERT_INTER, HIDDEN, QKV_ROWS


def pdl_norm_gemv_cases():
    """RMSNorm with its weight loaded before the wait (a row of one chunk) and after it
    (wider rows), and the one-row GEMV at default_tiles."""
    from pagoda.kernels.gemv import gemv
    from pagoda.kernels.norm import fused_ops as fo

    x, out = torch.empty(1, HIDDEN, dtype=BF16), torch.empty(1, HIDDEN, dtype=BF16)
    norm_args = (
        x,
        x,
        torch.empty(HIDDEN, dtype=BF16),
        out,
        out,
        1,
        HIDDEN,
        HIDDEN,
        HIDDEN,
        HIDDEN,
        1e-6,
    )
    for preload in (False, True):
        yield (
            f"rms_norm{'[preload]' if preload else ''}",
            fo._rms_norm_kernel,
            norm_args,
            dict(
                HIDDEN=HIDDEN,
                BLOCK=HIDDEN,
                HAS_RESIDUAL=True,
                PRELOAD_WEIGHT=preload,
                num_warps=4,
                USE_PDL=True,
            ),
        )
    w = torch.empty(QKV_ROWS, HIDDEN, dtype=BF16)
    y = torch.empty(1, QKV_ROWS, dtype=BF16)
    tiles = gemv.default_tiles(1, QKV_ROWS, HIDDEN)
    yield (
        "gemv[qkv]",
        gemv._gemv_kernel,
        (x, w, y, y, y, y, 1, QKV_ROWS, HIDDEN, HIDDEN, HIDDEN, HIDDEN, QKV_ROWS),
        dict(
            HAS_BIAS=False,
            DOT_PRECISION="tf32",
            BLOCK_M=1,
            EVEN_M=True,
            EVEN_N=True,
            EVEN_K=True,
            SPLIT_K=tiles.split_k,
            BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k,
            LOOP_STAGES=tiles.loop_stages,
            num_warps=tiles.num_warps,
            DOT=tiles.dot,
            USE_PDL=True,
        ),
    )


def pdl_w8a16_cases():
    """The W8A16 one-row GEMV (pagoda.kernels.fp8.w8a16) at the MoE gate/up width, plain
    and gated, at w8a16_config's tiles."""
    from pagoda.kernels.fp8 import w8a16 as fl

    x = torch.empty(1, HIDDEN, dtype=BF16)
    w8 = torch.empty(2 * EXPERT_INTER, HIDDEN, dtype=torch.float8_e4m3fn)
    scale, y8 = torch.empty(2 * EXPERT_INTER), torch.empty(1, 2 * EXPERT_INTER, dtype=BF16)
    for gated in (False, True):
        cfg = dict(fl.w8a16_config(1, 2 * EXPERT_INTER, HIDDEN))
        cfg["BLOCK_N"] //= 2 if gated else 1
        cfg.pop("SPLIT_K")
        yield (
            f"w8a16[gated={gated}]",
            fl._w8a16_kernel,
            (
                x,
                w8,
                scale,
                y8,
                y8,
                y8,
                1,
                EXPERT_INTER if gated else 2 * EXPERT_INTER,
                HIDDEN,
                HIDDEN,
                HIDDEN,
                HIDDEN,
                2 * EXPERT_INTER,
                1,
                0,
            ),
            dict(
                SCALE_BLOCKED=False,
                GROUP_N=1,
                GROUP_K=1,
                HAS_BIAS=False,
                SPLIT_K=1,
                DOT_PRECISION="tf32",
                BLOCK_M=1,
                EVEN_K=True,
                EVEN_N=True,
                DECODE="cvt",
                GATED=gated,
                **cfg,
                USE_PDL=True,
            ),
        )


def fp8_fused_quant_cases():
    """The RMSNorm and SiLU-and-mul producers with per-token FP8 output
    (pagoda.kernels.fp8.fused_quant) at the Llama-3.1-8B widths, with USE_PDL (the
    SiLU at its default BLOCK, the row in registers, and at a two-pass one)."""
    import triton.language as tl

    from pagoda.kernels.fp8 import fused_quant as fq
    from pagoda.kernels.fp8.quant import FLOAT32_TINY, FP8_MAX
    from pagoda.kernels.norm.fused_ops import _num_warps

    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    x, w = torch.empty(256, 4096, dtype=bf16), torch.empty(4096, dtype=bf16)
    q, s = torch.empty(256, 4096, dtype=fp8), torch.empty(256, 1)
    for residual in (False, True):
        yield (
            f"rms_norm_fp8[residual={residual}]",
            fq._rms_norm_fp8_kernel,
            (x, x, w, q, s, x, 4096, 4096, 1e-6),
            dict(
                HIDDEN=4096,
                BLOCK=4096,
                HAS_RESIDUAL=residual,
                ROW_DTYPE=tl.bfloat16,
                OUT_DTYPE=tl.bfloat16,
                FP8_MAX_C=FP8_MAX,
                TINY=FLOAT32_TINY,
                VEC=fq.norm_vec(bf16),
                num_warps=_num_warps(4096),
                USE_PDL=True,
            ),
        )
    gate_up, q8 = torch.empty(256, 2 * 14336, dtype=bf16), torch.empty(256, 14336, dtype=fp8)
    for block in (fq.silu_and_mul_block(14336), 2048):
        yield (
            f"silu_and_mul_fp8[block={block}]",
            fq._silu_and_mul_fp8_kernel,
            (gate_up, q8, s, 2 * 14336),
            dict(
                INTERMEDIATE=14336,
                BLOCK=block,
                FP8_MAX_C=FP8_MAX,
                TINY=FLOAT32_TINY,
                num_warps=fq.silu_and_mul_warps(block),
                USE_PDL=True,
            ),
        )


def default_w8a16_cases():
    """The W8A16 one-row GEMVs of the Llama-8B shapes at w8a16_config's tiles, as the
    engine launches them by default."""
    from pagoda.kernels.fp8 import w8a16 as fl

    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        x = torch.empty(1, k, dtype=BF16)
        w8 = torch.empty(n, k, dtype=torch.float8_e4m3fn)
        scale, y8 = torch.empty(n), torch.empty(1, n, dtype=BF16)
        cfg = dict(fl.w8a16_config(1, n, k))
        cfg.pop("SPLIT_K")
        stages = cfg.pop("LOOP_STAGES", 1)
        yield (
            f"w8a16[{n}x{k}]",
            fl._w8a16_kernel,
            (x, w8, scale, y8, y8, y8, 1, n, k, k, k, k, n, 1, 0),
            dict(
                SCALE_BLOCKED=False,
                GROUP_N=1,
                GROUP_K=1,
                HAS_BIAS=False,
                SPLIT_K=1,
                DOT_PRECISION="tf32",
                BLOCK_M=1,
                EVEN_K=True,
                EVEN_N=n % cfg["BLOCK_N"] == 0,
                LOOP_STAGES=stages,
                DECODE="cvt",
                GATED=False,
                **cfg,
                USE_PDL=True,
            ),
        )
