"""Attention kernel modes: `decode` (paged decode attention of one layer, bf16 or FP8 KV
cache, at the engine's split plan or fixed split counts, over tiles) and `prefill` (the
chunk kernel on prefill steps, over tiles).

decode: one layer of the Llama-3.1-8B shape (32 query heads, 8 KV heads, head_dim 128,
block 16) by default (--heads / --kv-heads for others, e.g. Qwen3-30B-A3B's 32 / 4), at
--batch x --context. Every variant's output is first checked against the bf16 kernel
reading the same values (for an FP8 cache, the bf16 values rounded to e4m3, scales 1,
and the queries rounded as the word kernel rounds them), then timed. Tiles come from the
kernel-config variant (--config) or the sweep (--tiles BLOCK_N:warps:stages[:rows], rows
the query rows a KV head pads to); the figure is the bandwidth over the KV bytes the
layer must read against the copy roofline. --pool-blocks N wraps the block tables over
N physical blocks (512 at this shape: 16 MB FP8, within L2): the time is then what the
kernel's instructions cost, not DRAM. --layout hnd stores each block head-major (seen
through the same view's strides).

prefill: the chunk kernel (paged_attention.paged_attention_chunks) at the engine's tiles
or a sweep (--tiles GROUP_PAD:BLOCK_Q:BLOCK_N:warps:stages), TFLOP/s of the causal
attention against the bf16 matmul roofline, each output checked against the default's.
"""

from __future__ import annotations

import math
from dataclasses import replace

from benchmarks.harness.variants import add_variant_args, configs_for
from benchmarks.kernel_bench import common


def add_decode_args(p) -> None:
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8"),
        default="auto",
        help="auto: the model dtype (bf16); fp8: e4m3 with scales",
    )
    p.add_argument(
        "--tiles",
        default="",
        help="sweep: comma list of BLOCK_N:warps:stages[:rows] for the kernel "
        "this cache takes (besides the config's)",
    )
    p.add_argument(
        "--splits",
        default="",
        help="comma list of context-slice counts (default: the engine's plan)",
    )
    p.add_argument(
        "--pool-blocks",
        type=int,
        default=0,
        help="the block tables wrap over this many blocks (512: the cache in L2)",
    )
    p.add_argument("--layout", choices=("nhd", "hnd"), default="nhd")
    add_variant_args(p)


def _decode_case(args, run):
    """q, the cache (model dtype and e4m3 from the same values), tables, lengths."""
    import torch

    gen = torch.Generator(device=run.device).manual_seed(0)
    blocks_per_req = -(-args.context // args.page)
    num_blocks = args.batch * blocks_per_req
    pool = min(args.pool_blocks, num_blocks) if args.pool_blocks > 0 else num_blocks
    shape = (2, pool, args.page, args.kv_heads, args.head_dim)
    cache = torch.randn(shape, device=run.device, generator=gen).to(run.dtype)
    if args.layout == "hnd":  # blocks stored head-major, seen through the same view
        cache = cache.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    fp8 = cache.to(torch.float8_e4m3fn)
    tables = (
        (torch.randperm(num_blocks, device=run.device, generator=gen) % pool)
        .view(args.batch, blocks_per_req)
        .int()
    )
    q = torch.randn(args.batch, args.heads, args.head_dim, device=run.device, generator=gen).to(
        run.dtype
    )
    qsl = torch.arange(args.batch + 1, device=run.device, dtype=torch.int32)
    seq = torch.full((args.batch,), args.context, device=run.device, dtype=torch.int32)
    return q, cache, fp8, tables, qsl, seq


def _tiles_sweep(text: str):
    from pagoda.kernels.attention.decode_config import DecodeTiles

    out = []
    for spec in (s for s in text.split(",") if s):
        values = [int(v) for v in spec.split(":")]
        out.append(DecodeTiles(*values))
    return out


def run_decode(args, run) -> dict:
    import torch

    from pagoda.kernels.attention.paged_decode import (
        choose_num_splits,
        min_split_tokens,
        paged_attention_decode,
        quantize_q_fp8_reference,
        words_kernel_reads,
    )

    if run.smoke:  # the interpreter: a tiny layer
        args.batch, args.context, args.heads, args.kv_heads, args.head_dim = 2, 40, 8, 2, 64
    q, cache, fp8, tables, qsl, seq = _decode_case(args, run)
    kv_fp8 = args.kv_cache_dtype == "fp8"
    the_cache = fp8 if kv_fp8 else cache
    scales = torch.ones(2, device=run.device) if kv_fp8 else None
    sms = torch.cuda.get_device_properties(0).multi_processor_count if run.device == "cuda" else 4
    engine_splits = choose_num_splits(args.batch, args.kv_heads, args.context, sms)
    plans = (
        [(n, 16) for n in common.parse_ints(args.splits)]
        if args.splits
        else [(engine_splits, min_split_tokens(args.batch, args.kv_heads, sms))]
    )
    config = configs_for(args.config, run.device).decode
    words = kv_fp8 and words_kernel_reads(q, the_cache)
    field = (
        "tiles_fp32"
        if q.dtype == torch.float32
        else ("tiles_fp8" if words else "tiles_fp8_fallback")
        if kv_fp8
        else "tiles_16bit"
    )
    variants = [(args.config, config)] + [
        (
            f"tiles {t.block_n}:{t.num_warps}:{t.num_stages}:{t.min_block_h}",
            replace(config, **{field: t}),
        )
        for t in _tiles_sweep(args.tiles)
    ]
    # The reference: the model-dtype kernel on the values the FP8 cache holds.
    ref_q = q
    if words:
        q8, q_scale = quantize_q_fp8_reference(q)
        ref_q = (q8.float() * q_scale).to(q.dtype)
    kv_bytes = (
        2 * args.batch * args.context * args.kv_heads * args.head_dim * the_cache.element_size()
    )
    copies = common.l2_copies(the_cache, run) if not args.pool_blocks else [the_cache]
    rows = []
    for splits, min_split in plans:
        ref = torch.empty_like(q)
        paged_attention_decode(
            ref,
            ref_q,
            fp8.to(q.dtype) if kv_fp8 else cache,
            tables,
            qsl,
            seq,
            args.batch,
            args.head_dim**-0.5,
            splits,
            min_split,
        )
        for name, cfg in variants:
            out = torch.empty_like(q)

            def call(kv, cfg=cfg, out=out):
                paged_attention_decode(
                    out,
                    q,
                    kv,
                    tables,
                    qsl,
                    seq,
                    args.batch,
                    args.head_dim**-0.5,
                    splits,
                    min_split,
                    config=cfg,
                    kv_scales=scales,
                )

            row = {"variant": name, "splits": splits, "kernel": "words" if words else "tile"}
            try:
                call(the_cache)
                row["max_abs_err"] = float((out.float() - ref.float()).abs().max())
                row["us"] = common.time_us(common.rotated(call, copies), run)
            except Exception as exc:  # out of resources, a refused tile: recorded
                row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            row["gb_per_s"] = common.tb_per_s(kv_bytes, row.get("us", float("nan"))) * 1e3
            row["roofline_us"] = common.memory_roofline_us(kv_bytes, run)
            rows.append(row)
    common.print_rows(
        rows,
        ["variant", "kernel", "splits", "us", "gb_per_s", "roofline_us", "max_abs_err", "error"],
        f"decode attention, {args.batch} x {args.context}, {args.heads}/"
        f"{args.kv_heads} heads, {args.kv_cache_dtype} cache, {args.layout}",
    )
    return {"kv_bytes": kv_bytes, "engine_splits": engine_splits, "rows": rows}


def add_prefill_args(p) -> None:
    p.add_argument(
        "--steps",
        default="1x2048,8192+1x2048,8x2048,16x1024",
        help="comma list of REQUESTSxTOKENS prefill steps, CACHED+ before a "
        "step for a cached prefix of that many tokens",
    )
    p.add_argument(
        "--tiles", default="", help="sweep: comma list of GROUP_PAD:BLOCK_Q:BLOCK_N:warps:stages"
    )


def _prefill_step(spec: str, run):
    """(q, cache, tables, query_start_loc, seq_lens, rows, visible keys) of a step."""
    import torch

    cached, _, shape = spec.rpartition("+")
    reqs, tokens = (int(v) for v in shape.split("x"))
    context = int(cached or 0)
    heads, kv_heads, dim, page = 32, 8, 128, 16
    seq_len = context + tokens
    blocks = -(-seq_len // page)
    gen = torch.Generator(device=run.device).manual_seed(0)
    cache = torch.randn(2, reqs * blocks, page, kv_heads, dim, device=run.device, generator=gen).to(
        run.dtype
    )
    tables = torch.arange(reqs * blocks, device=run.device, dtype=torch.int32).view(reqs, blocks)
    q = torch.randn(reqs * tokens, heads, dim, device=run.device, generator=gen).to(run.dtype)
    qsl = torch.arange(reqs + 1, device=run.device, dtype=torch.int32) * tokens
    seq = torch.full((reqs,), seq_len, device=run.device, dtype=torch.int32)
    visible = reqs * sum(range(context + 1, seq_len + 1))
    return q, cache, tables, qsl, seq, reqs, visible


def run_prefill(args, run) -> dict:
    import torch

    from pagoda.kernels.attention.paged_attention import paged_attention_chunks

    rows = []
    sweep = [
        dict(
            zip(
                ("GROUP_PAD", "BLOCK_Q", "BLOCK_N", "num_warps", "num_stages"),
                (int(v) for v in spec.split(":")),
            )
        )
        for spec in args.tiles.split(",")
        if spec
    ]
    for spec in ("1x24", "16+1x8") if run.smoke else args.steps.split(","):
        q, cache, tables, qsl, seq, reqs, visible = _prefill_step(spec, run)
        flops = 4 * q.shape[1] * q.shape[2] * visible  # QK^T and PV, 2 FLOPs a MAC
        base = torch.empty_like(q)
        call_args = (q, cache, tables, qsl, seq, reqs, q.shape[0], q.shape[2] ** -0.5)
        paged_attention_chunks(base, *call_args, skip_single_token=False)
        for tiles in [None] + sweep:
            out = torch.empty_like(q)

            def call(tiles=tiles, out=out):
                paged_attention_chunks(out, *call_args, skip_single_token=False, config=tiles)

            row = {
                "step": spec,
                "tiles": "default" if tiles is None else ":".join(str(v) for v in tiles.values()),
            }
            try:
                call()
                row["max_abs_vs_default"] = float((out.float() - base.float()).abs().max())
                row["us"] = common.time_us(call, run, form="events")
            except Exception as exc:  # a tile the GPU cannot run
                row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            us = row.get("us", float("nan"))
            row["tflops"] = flops / us / 1e6 if us == us else float("nan")
            row["roofline_us"] = common.compute_roofline_us(flops, run)
            rows.append(row)
    common.print_rows(
        rows,
        ["step", "tiles", "us", "tflops", "roofline_us", "max_abs_vs_default", "error"],
        "prefill attention (chunk kernel), Llama-3.1-8B heads",
    )
    return {"rows": rows}


def ncu_decode_case(spec: str, run):
    """A closure launching one decode layer for Nsight Compute: spec
    {bf16,fp8}-BATCHxCONTEXT[-hnd]."""
    import argparse

    parts = spec.split("-")
    batch, context = (int(v) for v in parts[1].split("x"))
    args = argparse.Namespace(
        batch=batch,
        context=context,
        heads=32,
        kv_heads=8,
        head_dim=128,
        page=16,
        pool_blocks=0,
        layout=parts[2] if len(parts) > 2 else "nhd",
    )
    import torch

    from pagoda.kernels.attention.paged_decode import choose_num_splits, paged_attention_decode

    q, cache, fp8, tables, qsl, seq = _decode_case(args, run)
    kv = fp8 if parts[0] == "fp8" else cache
    scales = torch.ones(2, device=run.device) if parts[0] == "fp8" else None
    splits = choose_num_splits(
        batch, 8, context, torch.cuda.get_device_properties(0).multi_processor_count
    )
    out = torch.empty_like(q)
    return lambda: (
        paged_attention_decode(
            out, q, kv, tables, qsl, seq, batch, math.sqrt(1 / 128), splits, kv_scales=scales
        )
        or out
    )
