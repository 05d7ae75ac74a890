"""The MoE kernels' sm_90 compile cases: the expert sort, the sum over the choices and
the grouped GEMMs (the "moe" group), and the batch-1 decode kernels of the "pdl" group
(the fused router, the one-token gate/up and down GEMVs)."""

from __future__ import annotations

import torch
import triton

from .shapes import BF16, EXPERT_INTER, EXPERTS, HIDDEN, HOPPER, QKV_ROWS


def moe_cases():
    """The expert sort (pagoda.kernels.moe.align) at decode and prefill sizes, and the
    sum over the choices (pagoda.kernels.moe.fused_moe.sum_choices)."""
    from pagoda.kernels.moe import align as m

    yield from _align_cases(m)
    from pagoda.kernels.moe import fused_moe as fm

    rows, out = (
        torch.empty(16384 * 8, 2048, dtype=torch.bfloat16),
        torch.empty(16384, 2048, dtype=torch.bfloat16),
    )
    yield (
        "sum_choices",
        fm._sum_choices_kernel,
        (rows, out, 16384, 2048),
        dict(TOP_K=8, BLOCK_T=fm.SUM_BLOCK_T, BLOCK_H=512, num_warps=4),
    )
    yield from _moe_gemm_cases(fm, m)
    pairs, experts, block_m = m.SMALL_ALIGN_PAIRS, 128, 32
    max_padded = m.max_padded_rows(pairs, experts, block_m)
    yield (
        "align_small",
        m._align_small_kernel,
        (
            torch.zeros(pairs, dtype=torch.int32),
            torch.empty(max_padded, dtype=torch.int32),
            torch.empty(max_padded // block_m, dtype=torch.int32),
            torch.empty(1, dtype=torch.int32),
            pairs,
            experts,
            max_padded,
            max_padded // block_m,
        ),
        dict(
            BLOCK_M=block_m,
            PAIRS=pairs,
            BUCKETS=triton.next_power_of_2(experts + 1),
            CHUNK=256,
            num_warps=8,
        ),
    )


def _align_cases(m):
    """The count, scan and place kernels of the expert sort at 2048 (decode) and 131072
    (prefill) pairs."""
    for pairs, experts, block_m in ((2048, 128, 32), (131072, 128, 128)):
        flat = torch.zeros(pairs, dtype=torch.int32)
        max_padded = m.max_padded_rows(pairs, experts, block_m)
        sorted_ids = torch.empty(max_padded, dtype=torch.int32)
        expert_ids = torch.empty(max_padded // block_m, dtype=torch.int32)
        used = torch.empty(1, dtype=torch.int32)
        chunks = triton.cdiv(pairs, m.ALIGN_CHUNK)
        buckets = triton.next_power_of_2(experts + 1)
        counts = torch.empty(chunks, buckets, dtype=torch.int32)
        before, totals = torch.empty_like(counts), torch.empty(buckets, dtype=torch.int32)
        rank = torch.empty(pairs, dtype=torch.int32)
        yield (
            f"align_count[{pairs}]",
            m._align_count_kernel,
            (flat, counts, rank, sorted_ids, pairs, experts, max_padded, chunks),
            dict(BUCKETS=buckets, CHUNK=m.ALIGN_CHUNK, num_warps=8),
        )
        yield (
            f"align_scan[{pairs}]",
            m._align_scan_kernel,
            (counts, before, totals, chunks),
            dict(BUCKETS=buckets, BLOCK_C=m.SCAN_CHUNKS, BLOCK_B=m.SCAN_BUCKETS, num_warps=4),
        )
        yield (
            f"align_place[{pairs}]",
            m._align_place_kernel,
            (
                flat,
                before,
                totals,
                rank,
                sorted_ids,
                expert_ids,
                used,
                pairs,
                experts,
                expert_ids.numel(),
            ),
            dict(BLOCK_M=block_m, BUCKETS=buckets, CHUNK=m.ALIGN_CHUNK, num_warps=8),
        )


def _moe_gemm_cases(fm, m):
    """The grouped GEMMs at Qwen3-30B-A3B's prefill shape (gate/up with its epilogue, and
    down) with pick_config's tiles, B tiles by pointer loads and by tensor descriptor
    (TMA), in bfloat16 and float32."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    experts, hidden, inter, pairs = 128, 2048, 768, 16384 * 8
    for dtype in (torch.bfloat16, torch.float32):
        size = torch.empty(0, dtype=dtype).element_size()
        block_m = fm.pick_config(pairs, experts, size)["BLOCK_M"]
        max_padded = m.max_padded_rows(pairs, experts, block_m)
        sorted_ids = torch.empty(max_padded, dtype=torch.int32)
        expert_ids = torch.empty(max_padded // block_m, dtype=torch.int32)
        used, weights = torch.empty(1, dtype=torch.int32), torch.empty(pairs)
        x = torch.empty(16384, hidden, dtype=dtype)
        act = torch.empty(pairs, inter, dtype=dtype)
        rows = torch.empty(pairs, hidden, dtype=dtype)
        w13 = torch.empty(experts, 2 * inter, hidden, dtype=dtype)
        w2 = torch.empty(experts, hidden, inter, dtype=dtype)
        for tma in (False, True):
            for name, a, b, out, n, row_div in (
                ("gate_up", x, w13, act, inter, 8),
                ("down", act, w2, rows, hidden, 1),
            ):
                config = fm.pick_config(pairs, experts, size, name)
                config.pop("B_TMA", None)
                k = b.shape[2]
                desc = (
                    TensorDescriptor.from_tensor(
                        b.reshape(-1, k), [config["BLOCK_N"], config["BLOCK_K"]]
                    )
                    if tma
                    else b
                )
                label = f"{name}, {str(dtype)[6:]}{', tma' if tma else ''}"
                yield (
                    f"moe_gemm[{label}]",
                    fm._moe_gemm_kernel,
                    (
                        a,
                        b,
                        out,
                        weights,
                        sorted_ids,
                        expert_ids,
                        used,
                        desc,
                        n,
                        k,
                        pairs,
                        max_padded,
                        b.shape[1],
                        *a.stride(),
                        *b.stride(),
                        *out.stride(),
                    ),
                    dict(
                        A_ROW_DIV=row_div,
                        MUL_WEIGHT=name == "down",
                        GATE_UP_ACT=name == "gate_up",
                        IEEE_FP32=dtype == torch.float32,
                        B_TMA=tma,
                        **config,
                    ),
                )


def pdl_router_cases():
    """The fused router (pagoda.kernels.moe.router_fused) with its gate weight loaded
    before the wait, alone and with the RMSNorm before it fused in."""
    import triton.language as tl

    from pagoda.kernels.moe import router_fused as mrf

    x, out = torch.empty(1, HIDDEN, dtype=BF16), torch.empty(1, HIDDEN, dtype=BF16)
    ids, weights = torch.empty(1, 8, dtype=torch.int32), torch.empty(1, 8)
    gate_w, scratch = torch.empty(EXPERTS, HIDDEN, dtype=BF16), torch.empty(16, EXPERTS)
    counter = torch.empty(1, dtype=torch.int32)
    for norm in (False, True):
        yield (
            f"router_fused[preload{', norm' if norm else ''}]",
            mrf._router_fused_kernel,
            (
                x,
                gate_w,
                scratch,
                scratch,
                counter,
                weights,
                ids,
                1,
                HIDDEN,
                HIDDEN,
                HIDDEN,
                EXPERTS,
                EXPERTS,
                1.0,
                x,
                x[0],
                out,
                out,
                1e-6,
            ),
            dict(
                LOGITS_DTYPE=tl.bfloat16,
                ROUND_LOGITS=True,
                BLOCK_T=1,
                BLOCK_X=1,
                BLOCK_H=HIDDEN,
                ROUTE_T=1,
                BLOCK_E=EXPERTS,
                TOP_K=8,
                SIGMOID=False,
                HAS_BIAS=False,
                GROUPED=False,
                GROUP_BY_TOP2=False,
                N_GROUP=1,
                TOPK_GROUP=1,
                RENORMALIZE=True,
                BLOCK_G=2,
                BLOCK_K=8,
                PRELOAD_W=True,
                HAS_NORM=norm,
                num_warps=1,
                USE_PDL=True,
            ),
        )


def pdl_gate_up_cases():
    """The one-token MoE gate/up GEMV (pagoda.kernels.moe.fused_moe_decode) at the MoE
    config's Hopper tiles."""
    from pagoda.kernels.moe import fused_moe_decode as fmd
    from pagoda.kernels.moe.config import MoEKernelConfig

    x = torch.empty(1, HIDDEN, dtype=BF16)
    w13 = torch.empty(EXPERTS, 2 * EXPERT_INTER, HIDDEN, dtype=BF16)
    ids = torch.empty(1, 8, dtype=torch.int32)
    act = torch.empty(8, EXPERT_INTER, dtype=BF16)
    yield (
        "moe_gemv_gate_up",
        fmd._gemv_gate_up_kernel,
        (
            x,
            w13,
            ids,
            act,
            w13,
            HIDDEN,
            EXPERT_INTER,
            HIDDEN,
            w13.stride(0),
            w13.stride(1),
            8,
            0,
            HIDDEN,
        ),
        dict(
            TOP_K=8,
            SHARED_CHUNKS=0,
            **MoEKernelConfig.for_capability(HOPPER).gate_up.launch(),
            USE_PDL=True,
        ),
    )


def pdl_moe_down_cases():
    """The one-token MoE down GEMV with the sum over the choices (fused_moe_decode), at
    the MoE config's Hopper tiles."""
    from pagoda.kernels.moe import fused_moe_decode as fmd
    from pagoda.kernels.moe.config import MoEKernelConfig

    down = MoEKernelConfig.for_capability(HOPPER).down_tiles(EXPERT_INTER).launch(EXPERT_INTER)
    out = torch.empty(1, HIDDEN, dtype=BF16)
    w2 = torch.empty(EXPERTS, HIDDEN, EXPERT_INTER, dtype=BF16)
    next_qkv = torch.empty(QKV_ROWS, HIDDEN, dtype=BF16)
    ids, weights = torch.empty(1, 8, dtype=torch.int32), torch.empty(1, 8)
    act = torch.empty(8, EXPERT_INTER, dtype=BF16)
    # With and without the next layer's qkv weight prefetched at the end (l2_prefetch).
    for prefetch in (False, True):
        yield (
            f"moe_gemv_down[prefetch_next={prefetch}]",
            fmd._gemv_down_sum_kernel,
            (
                act,
                w2,
                ids,
                weights,
                out,
                w2,
                next_qkv,
                HIDDEN,
                EXPERT_INTER,
                w2.stride(0),
                w2.stride(1),
                HIDDEN,
                8,
                EXPERT_INTER,
                QKV_ROWS * HIDDEN * 2,
            ),
            dict(TOP_K=8, SHARED_CHUNKS=0, **down, PREFETCH_NEXT=prefetch, USE_PDL=True),
        )
