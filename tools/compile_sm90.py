"""Compile Triton kernels for Hopper (sm_90) on a machine without a GPU.

    python tools/compile_sm90.py            # every kernel case in CASES below
    python tools/compile_sm90.py moe        # the cases of one group
    python tools/compile_sm90.py --loops pdl   # and each kernel's loops in SASS
    python tools/compile_sm90.py --sass DIR pdl   # and each case's SASS into DIR
    python tools/compile_sm90.py defaults   # the decode kernels the engine runs by default

The Triton interpreter (what the CPU tests run) executes a kernel's Python, so it
cannot see what the GPU compiler rejects (an op a layout cannot lower, shared memory
or registers over the limit, a constexpr used as a runtime value). This tool binds
each case's arguments (CPU tensors stand in for device pointers: only dtype and
alignment matter), builds the kernel with Triton's own compiler for
GPUTarget("cuda", 90, 32) through ptxas (shipped with Triton) and prints its
registers, spills and shared memory. A compile error is raised, and the run exits 1.
With --sass DIR it writes each case's whole SASS to DIR/<group>.<case>.sass: run it
before and after a change that should not alter the compiled code (a kernel split into
helpers, say) and diff the two folders.
With --loops it also disassembles the cubin (cuobjdump -sass) and prints each loop
(a backward branch) with its instruction count and commonest opcodes: for a kernel
bound by instruction issue, the count of its main loop is a first measure of a change.
It says nothing about speed or results. The local Triton may be newer than the GPU
machine's: a kernel that compiles here is likely, not certain, to compile there, and
its pipelining (buffers, copy waits) and counts can differ: for those, run this tool
under the GPU's Triton (pip install triton==3.6.0 into a scratch venv with torch).

The cases take their tiles and launch options from the kernel families' configs for
Hopper (`for_capability(HOPPER)`), as the engine's wrappers pass them on an H100 or
H200, with programmatic dependent launch on (USE_PDL).
"""

from __future__ import annotations

import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
HOPPER = (9, 0)


def compile_for_sm90(kernel, *args, **kwargs):
    """Compiles kernel (a triton.jit function) for TARGET with these launch arguments
    (as in kernel[grid](*args, **kwargs)); returns the compiled kernel."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound, specialization, options
    )
    src = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=TARGET, options=options.__dict__)


def _cuobjdump(compiled, flag: str) -> str:
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


def resource_usage(compiled) -> str:
    """cuobjdump's resource line of the cubin (registers, stack, local memory)."""
    out = _cuobjdump(compiled, "-res-usage")
    lines = [ln.strip() for ln in out.splitlines() if "REG:" in ln]
    return lines[0] if lines else out.strip()[-200:]


_SASS_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")
_COPY_WAIT = re.compile(r"\bDEPBAR\.LE SB0, (0x[0-9a-f]+)")


def sass_loops(sass: str) -> list[tuple[int, int, collections.Counter, list[int]]]:
    """(start address, instruction count, opcode counts, copy waits) of each loop in the
    SASS text (cuobjdump -sass): the instructions from a backward branch's target to the
    branch itself. Copy waits: each DEPBAR.LE SB0, N in the loop, N the cp.async groups
    left in flight (a loop that waits with 0 at its top has no copy in flight during its
    math: Triton's pipelining did not overlap the loads)."""
    instructions = [
        (int(m.group(1), 16), m.group(2)) for m in map(_SASS_LINE.match, sass.splitlines()) if m
    ]
    index = {address: i for i, (address, _) in enumerate(instructions)}
    loops = []
    for i, (address, text) in enumerate(instructions):
        target = _BRANCH_TARGET.search(text)
        start = index.get(int(target.group(1), 16)) if target else None
        if start is None or instructions[start][0] >= address:
            continue
        body = instructions[start : i + 1]
        opcodes = collections.Counter(
            re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in body
        )
        waits = [int(m.group(1), 16) for _, t in body for m in [_COPY_WAIT.search(t)] if m]
        loops.append((instructions[start][0], len(body), opcodes, waits))
    return loops


def preloaded_loads(ptx: str) -> str:
    """How many global loads the PTX issues before its griddepcontrol.wait (a kernel
    that preloads its weights must have some); RuntimeError if none."""
    head = ptx[: ptx.index("griddepcontrol.wait")]
    loads = len(re.findall(r"\bld\.global", head))
    if loads == 0:
        raise RuntimeError("a preloading kernel with no global load before its wait")
    return f"{loads} global loads before griddepcontrol.wait"


def bulk_prefetches(ptx: str, name: str) -> str:
    """How many L2 bulk prefetches the PTX issues (pagoda.kernels.launch.l2_prefetch): none for a
    case named with prefetch off (`=False` / `=0`), some otherwise; RuntimeError if not."""
    count = ptx.count("cp.async.bulk.prefetch.L2.global")
    off = re.search(r"prefetch\w*=(False|0)\b", name) is not None
    if (count == 0) != off:
        raise RuntimeError(
            f"{count} bulk prefetches in a case with the prefetch {'off' if off else 'on'}"
        )
    return f"{count} L2 bulk prefetches"


def check_pdl_order(ptx: str) -> None:
    """The kernel waits on its predecessor (griddepcontrol.wait), then releases its
    dependents (griddepcontrol.launch_dependents), pagoda.kernels.launch.pdl's order."""
    if "griddepcontrol.wait" not in ptx or "griddepcontrol.launch_dependents" not in ptx:
        raise RuntimeError("USE_PDL but no griddepcontrol.wait / launch_dependents in the PTX")
    if ptx.index("griddepcontrol.launch_dependents") < ptx.index("griddepcontrol.wait"):
        raise RuntimeError("griddepcontrol order: the release comes before the wait")


def report(name: str, compiled) -> str:
    meta = compiled.metadata
    return (
        f"{name}: {resource_usage(compiled)}; {meta.shared} B shared (dynamic), "
        f"{meta.num_warps} warps"
    )


def _moe_cases():
    """The expert sort (pagoda.kernels.moe.align) at decode and prefill sizes, and the
    sum over the choices (pagoda.kernels.moe.fused_moe.sum_choices)."""
    from pagoda.kernels.moe import align as m

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


_BF16 = torch.bfloat16
_HIDDEN, _QKV_ROWS, _EXPERTS, _EXPERT_INTER = 2048, 5120, 128, 768  # Qwen3-30B-A3B


def _pdl_cases():
    """Batch-1 decode kernels of the Qwen3-30B-A3B shape with USE_PDL (pagoda.kernels.launch.pdl),
    in a layer's order: the wait on the predecessor grid must lower to griddepcontrol
    (checked in main)."""
    yield from _pdl_norm_gemv_cases()
    yield from _pdl_router_gate_up_cases()
    yield from _qk_rope_store_cases()
    yield from _pdl_w8a16_cases()
    yield from _pdl_decode_cases()
    yield from _pdl_moe_down_cases()


def _pdl_norm_gemv_cases():
    """RMSNorm with its weight loaded before the wait (a row of one chunk) and after it
    (wider rows), and the one-row GEMV at default_tiles."""
    from pagoda.kernels.gemv import gemv
    from pagoda.kernels.norm import fused_ops as fo

    x, out = torch.empty(1, _HIDDEN, dtype=_BF16), torch.empty(1, _HIDDEN, dtype=_BF16)
    norm_args = (
        x,
        x,
        torch.empty(_HIDDEN, dtype=_BF16),
        out,
        out,
        1,
        _HIDDEN,
        _HIDDEN,
        _HIDDEN,
        _HIDDEN,
        1e-6,
    )
    for preload in (False, True):
        yield (
            f"rms_norm{'[preload]' if preload else ''}",
            fo._rms_norm_kernel,
            norm_args,
            dict(
                HIDDEN=_HIDDEN,
                BLOCK=_HIDDEN,
                HAS_RESIDUAL=True,
                PRELOAD_WEIGHT=preload,
                num_warps=4,
                USE_PDL=True,
            ),
        )
    w = torch.empty(_QKV_ROWS, _HIDDEN, dtype=_BF16)
    y = torch.empty(1, _QKV_ROWS, dtype=_BF16)
    tiles = gemv.default_tiles(1, _QKV_ROWS, _HIDDEN)
    yield (
        "gemv[qkv]",
        gemv._gemv_kernel,
        (x, w, y, y, y, y, 1, _QKV_ROWS, _HIDDEN, _HIDDEN, _HIDDEN, _HIDDEN, _QKV_ROWS),
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


def _pdl_router_gate_up_cases():
    import triton.language as tl

    from pagoda.kernels.moe import fused_moe_decode as fmd
    from pagoda.kernels.moe import router_fused as mrf
    from pagoda.kernels.moe.config import MoEKernelConfig

    x, out = torch.empty(1, _HIDDEN, dtype=_BF16), torch.empty(1, _HIDDEN, dtype=_BF16)
    w13 = torch.empty(_EXPERTS, 2 * _EXPERT_INTER, _HIDDEN, dtype=_BF16)
    ids, weights = torch.empty(1, 8, dtype=torch.int32), torch.empty(1, 8)
    act = torch.empty(8, _EXPERT_INTER, dtype=_BF16)
    gate_w, scratch = torch.empty(_EXPERTS, _HIDDEN, dtype=_BF16), torch.empty(16, _EXPERTS)
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
                _HIDDEN,
                _HIDDEN,
                _HIDDEN,
                _EXPERTS,
                _EXPERTS,
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
                BLOCK_H=_HIDDEN,
                ROUTE_T=1,
                BLOCK_E=_EXPERTS,
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
    yield (
        "moe_gemv_gate_up",
        fmd._gemv_gate_up_kernel,
        (
            x,
            w13,
            ids,
            act,
            w13,
            _HIDDEN,
            _EXPERT_INTER,
            _HIDDEN,
            w13.stride(0),
            w13.stride(1),
            8,
            0,
            _HIDDEN,
        ),
        dict(
            TOP_K=8,
            SHARED_CHUNKS=0,
            **MoEKernelConfig.for_capability(HOPPER).gate_up.launch(),
            USE_PDL=True,
        ),
    )


def _pdl_w8a16_cases():
    from pagoda.kernels.fp8 import w8a16 as fl

    x = torch.empty(1, _HIDDEN, dtype=_BF16)
    w8 = torch.empty(2 * _EXPERT_INTER, _HIDDEN, dtype=torch.float8_e4m3fn)
    scale, y8 = torch.empty(2 * _EXPERT_INTER), torch.empty(1, 2 * _EXPERT_INTER, dtype=_BF16)
    for gated in (False, True):
        cfg = dict(fl.w8a16_config(1, 2 * _EXPERT_INTER, _HIDDEN))
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
                _EXPERT_INTER if gated else 2 * _EXPERT_INTER,
                _HIDDEN,
                _HIDDEN,
                _HIDDEN,
                _HIDDEN,
                2 * _EXPERT_INTER,
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


def _decode_case(
    heads: int, kv_heads: int, fp8: bool, direct: bool, dtype: torch.dtype = _BF16, dim: int = 128
):
    """(kernel, args, kwargs) of paged_attention_decode's launch for one query row of
    heads query heads over kv_heads KV heads, 8 context slices (direct: one), as the
    wrapper chooses its kernel and tiles from DecodeAttentionConfig for Hopper."""
    from pagoda.kernels.attention import paged_decode as pd
    from pagoda.kernels.attention.decode_config import DecodeAttentionConfig

    config = DecodeAttentionConfig.for_capability(HOPPER)
    q, attn_out = torch.empty(1, heads, dim, dtype=dtype), torch.empty(1, heads, dim, dtype=dtype)
    part, lse = torch.empty(1, heads, 8, dim), torch.empty(1, heads, 8)
    i32 = torch.empty(64, dtype=torch.int32)
    cache = torch.empty(2, 64, 16, kv_heads, dim, dtype=torch.float8_e4m3fn if fp8 else dtype)
    words = fp8 and pd.words_kernel_reads(q, cache)
    tiles = config.tiles_for(dtype, fp8, words)
    group = heads // kv_heads
    if words:
        kernel, extra = (
            pd._decode_words_kernel,
            dict(OFFSETS_32=True, PTX_PAIRS=config.e4m3_pairs_ptx),
        )
    else:
        kernel, extra = pd._decode_kernel, dict(IEEE_DOT=dtype == torch.float32, KV_FP8=fp8)
    args = (
        attn_out,
        part,
        lse,
        q,
        cache[0],
        cache[1],
        torch.empty(2),
        i32,
        i32,
        i32,
        0.1,
        8,
        32,
        q.stride(0),
        q.stride(1),
        attn_out.stride(0),
        attn_out.stride(1),
        64,
        cache.stride(1),
        cache.stride(2),
        cache.stride(3),
    )
    return (
        kernel,
        args,
        dict(
            NUM_HEADS=heads,
            GROUP=group,
            BLOCK_H=tiles.block_h(group),
            PAGE_SIZE=16,
            HEAD_DIM=dim,
            DIRECT_OUT=direct,
            **extra,
            **tiles.launch(),
            USE_PDL=True,
        ),
    )


def _pdl_decode_cases():
    """Decode attention over a bf16 and an FP8 cache at the Qwen3 grouping, and the
    merge of 8 slices; all load the query start and context length before the wait."""
    from pagoda.kernels.attention import paged_decode as pd

    for fp8 in (False, True):
        yield (f"decode[fp8={fp8}, preload]", *_decode_case(32, 4, fp8, direct=False))
    attn_out, part = torch.empty(1, 32, 128, dtype=_BF16), torch.empty(1, 32, 8, 128)
    lse, i32 = torch.empty(1, 32, 8), torch.empty(64, dtype=torch.int32)
    yield (
        "decode_merge[preload]",
        pd._merge_kernel,
        (attn_out, part, lse, i32, 8, attn_out.stride(0), attn_out.stride(1)),
        dict(NUM_HEADS=32, HEAD_DIM=128, SPLITS_PAD=8, USE_PDL=True),
    )


def _pdl_moe_down_cases():
    from pagoda.kernels.moe import fused_moe_decode as fmd
    from pagoda.kernels.moe.config import MoEKernelConfig

    down = MoEKernelConfig.for_capability(HOPPER).down_tiles(_EXPERT_INTER).launch(_EXPERT_INTER)
    out = torch.empty(1, _HIDDEN, dtype=_BF16)
    w2 = torch.empty(_EXPERTS, _HIDDEN, _EXPERT_INTER, dtype=_BF16)
    next_qkv = torch.empty(_QKV_ROWS, _HIDDEN, dtype=_BF16)
    ids, weights = torch.empty(1, 8, dtype=torch.int32), torch.empty(1, 8)
    act = torch.empty(8, _EXPERT_INTER, dtype=_BF16)
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
                _HIDDEN,
                _EXPERT_INTER,
                w2.stride(0),
                w2.stride(1),
                _HIDDEN,
                8,
                _EXPERT_INTER,
                _QKV_ROWS * _HIDDEN * 2,
            ),
            dict(TOP_K=8, SHARED_CHUNKS=0, **down, PREFETCH_NEXT=prefetch, USE_PDL=True),
        )


def _qk_rope_store_cases():
    """Qwen3-30B-A3B's q/k norm + rotary + KV store at batch 1, operands preloaded."""
    from pagoda.kernels.attention import qk_rope_store as qr

    bf16 = torch.bfloat16
    qkv, cos = torch.empty(1, (32 + 8) * 128, dtype=bf16), torch.empty(1, 64, dtype=bf16)
    norm_w, q = torch.empty(128, dtype=bf16), torch.empty(1, 4096, dtype=bf16)
    cache, slots = torch.empty(2, 64, 16, 4, 128, dtype=bf16), torch.empty(1, dtype=torch.int64)
    yield (
        "qk_rope_store[preload]",
        qr._qk_norm_rope_store_kernel,
        (
            qkv,
            cos,
            cos,
            norm_w,
            norm_w,
            q,
            cache,
            slots,
            slots,
            qkv.stride(0),
            64,
            64,
            cache.stride(0),
            cache.stride(1),
            cache.stride(2),
            cache.stride(3),
            1e-6,
        ),
        dict(
            NUM_HEADS=32,
            NUM_KV_HEADS=4,
            HEAD_DIM=128,
            PAGE_SIZE=16,
            HEADS_PER_PROGRAM=1,
            BLOCK_DIM=128,
            BLOCK_HALF=64,
            HAS_QK_NORM=True,
            KV_FP8=False,
            num_warps=1,
            USE_PDL=True,
        ),
    )


def _fp8_fused_quant_cases():
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


def _mla_prefill_cases():
    """DeepSeek-V2-Lite's widths (16 heads, 128 + 64 query/key, 128 value) as the layer
    passes them: strided halves of kv_b_proj's output and of the latent entries."""
    from pagoda.kernels.attention import mla_prefill as mp
    from pagoda.kernels.attention.mla_config import MLAKernelConfig

    config = MLAKernelConfig.for_capability(HOPPER)
    tokens, heads, ctx = 4096, 16, 4096
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.empty(tokens, heads, 192, dtype=dtype)
        kv = torch.empty(ctx, heads, 256, dtype=dtype)
        k_rope = torch.empty(ctx, 576, dtype=dtype)[:, 512:]
        out = torch.empty(tokens, heads, 128, dtype=dtype)
        q_nope, q_rope, k_nope, v = q[..., :128], q[..., 128:], kv[..., :128], kv[..., 128:]
        rows = torch.empty(tokens, dtype=torch.int64)
        tiles = torch.empty(32, mp.TILE_FIELDS, dtype=torch.int32)
        yield (
            f"mla_prefill[{str(dtype).removeprefix('torch.')}]",
            mp._mla_prefill_kernel,
            (
                out,
                q_nope,
                q_rope,
                k_nope,
                k_rope,
                v,
                rows,
                tiles,
                0.1,
                q_nope.stride(0),
                q_nope.stride(1),
                q_rope.stride(0),
                q_rope.stride(1),
                k_nope.stride(0),
                k_nope.stride(1),
                k_rope.stride(0),
                v.stride(0),
                v.stride(1),
                out.stride(0),
                out.stride(1),
            ),
            dict(
                NUM_HEADS=heads,
                DN=128,
                DR=64,
                DV=128,
                BLOCK_DN=128,
                BLOCK_DR=64,
                BLOCK_DV=128,
                IEEE_DOT=False,
                **config.prefill_tiles(dtype).launch(),
            ),
        )


def _default_decode_cases():
    """The decode kernels the engine launches by default at the Llama-8B (4 query heads
    a KV head) and Qwen3 (8) groupings, over 8 slices and one (direct output); an FP8
    cache the word kernel cannot read (float32 queries, head_dim 32); and the W8A16
    one-row GEMVs of the Llama-8B shapes at w8a16_config's tiles."""
    from pagoda.kernels.fp8 import w8a16 as fl

    for heads, kv_heads in ((32, 8), (32, 4)):
        for fp8 in (False, True):
            for direct in (False, True):
                yield (
                    f"decode[{heads}/{kv_heads}, fp8={fp8}, direct={direct}]",
                    *_decode_case(heads, kv_heads, fp8, direct),
                )
    yield ("decode[fp8, fp32 q]", *_decode_case(32, 8, True, False, dtype=torch.float32))
    yield ("decode[fp8, head_dim 32]", *_decode_case(32, 8, True, False, dim=32))
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        x = torch.empty(1, k, dtype=_BF16)
        w8 = torch.empty(n, k, dtype=torch.float8_e4m3fn)
        scale, y8 = torch.empty(n), torch.empty(1, n, dtype=_BF16)
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


CASES = {
    "moe": _moe_cases,
    "mla_prefill": _mla_prefill_cases,
    "pdl": _pdl_cases,
    "fp8_fused_quant": _fp8_fused_quant_cases,
    "defaults": _default_decode_cases,
}


def write_sass(directory: str, case: str, sass: str) -> None:
    """A case's SASS (cuobjdump -sass) as directory/<case>.sass, the case name with
    anything but letters, digits, '.', '_', '=' and '-' replaced by '_'."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, re.sub(r"[^\w.=-]", "_", case) + ".sass"), "w") as f:
        f.write(sass)


def main(argv: list[str]) -> int:
    loops = "--loops" in argv
    sass_dir = None
    if "--sass" in argv:
        at = argv.index("--sass")
        if at + 1 >= len(argv):
            raise SystemExit("--sass needs a folder")
        sass_dir = argv[at + 1]
        argv = argv[:at] + argv[at + 2 :]
    names = [a for a in argv if a != "--loops"] or list(CASES)
    failed = 0
    for module in names:
        for name, kernel, args, kwargs in CASES[module]():
            try:
                compiled = compile_for_sm90(kernel, *args, **kwargs)
                ptx = compiled.asm["ptx"]
                if kwargs.get("USE_PDL"):
                    check_pdl_order(ptx)
                print(report(f"{module}.{name}", compiled))
                # Disassembled once for both --sass and --loops.
                sass = _cuobjdump(compiled, "-sass") if loops or sass_dir else ""
                if sass_dir:
                    write_sass(sass_dir, f"{module}.{name}", sass)
                if "preload" in name:
                    print(f"  {preloaded_loads(ptx)}")
                if "prefetch" in name:
                    print(f"  {bulk_prefetches(ptx, name)}")
                for start, count, opcodes, waits in sass_loops(sass) if loops else ():
                    top = ", ".join(f"{op} {n}" for op, n in opcodes.most_common(8))
                    print(f"  loop at {start:#x}: {count} instructions ({top})")
                    if waits:
                        print(f"    cp.async waits (groups left in flight): {waits}")
            except Exception as exc:  # report every case, then fail
                failed += 1
                print(f"{module}.{name}: FAILED {type(exc).__name__}: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
