"""The `mla` mode: DeepSeek-V2-Lite's MLA kernels (16 heads, kv_lora_rank 512, rope 64,
nope 128, value 128, bf16) against their references, with rooflines.

- decode: the latent decode kernel (kernels/attention/mla_decode.py) at the variant's
  tiles (--config), batch x context, the engine's split plan: GB/s over the latent
  bytes read against the copy roofline, the error and time of latent_attention_ref (up
  to --ref-max-batch requests);
- prefill: the prefill kernel (kernels/attention/mla_prefill.py) on two steps (16 fresh
  prompts of 1,024 tokens; 8 chunks of 1,024 after 1,024 cached) at its tiles and the
  --sweep-prefill tiles, against the torch path (the cats that assemble Q and K, then
  SDPA per chunk): TFLOP/s against the matmul roofline, error against the float32
  reference;
- projections (--projections): the absorbed query and the value projection at one token
  (kernels/attention/mla_absorb.py) against torch's bmm.
"""

from __future__ import annotations

from dataclasses import replace

from benchmarks.harness.variants import add_variant_args, configs_for
from benchmarks.kernel_bench import common

HEADS, NOPE, ROPE, V, RANK = 16, 128, 64, 128, 512
PREFILL_STEPS = {
    "16 x 1024 fresh": [(1024, 1024)] * 16,
    "8 x 1024 after 1024 cached": [(1024, 2048)] * 8,
}
PREFILL_SWEEP = [
    (128, 64, 8, 2),
    (128, 32, 8, 3),
    (128, 64, 4, 3),
    (128, 128, 8, 2),
    (64, 64, 4, 3),
    (64, 64, 4, 4),
    (64, 128, 4, 2),
    (64, 32, 4, 4),
]


def add_args(p) -> None:
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--ref-max-batch", type=int, default=64)
    p.add_argument(
        "--sweep-prefill",
        action="store_true",
        help="also the prefill kernel at other tiles (BLOCK_M:BLOCK_N:warps:stages)",
    )
    p.add_argument("--projections", action="store_true")
    add_variant_args(p)


def _decode_rows(args, run, config) -> list:
    import torch

    from pagoda.attention.mla_backend import latent_attention_ref
    from pagoda.kernels.attention.mla_decode import mla_decode
    from pagoda.kernels.attention.paged_decode import choose_num_splits

    entry, page = RANK + ROPE, 16
    scale = (NOPE + ROPE) ** -0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count if run.device == "cuda" else 4
    batches, contexts = (
        ([1, 2], [40])
        if run.smoke
        else (common.parse_ints(args.batches), common.parse_ints(args.contexts))
    )
    rows = []
    for batch in batches:
        for context in contexts:
            blocks = -(-context // page)
            gen = torch.Generator(device=run.device).manual_seed(batch)
            cache = (
                torch.randn(batch * blocks, page, entry, device=run.device, generator=gen) * 0.5
            ).to(run.dtype)
            tables = (
                torch.randperm(batch * blocks, device=run.device, generator=gen)
                .view(batch, blocks)
                .int()
            )
            q = torch.randn(batch, HEADS, entry, device=run.device, generator=gen).to(run.dtype)
            req = torch.arange(batch, device=run.device, dtype=torch.int32)
            lens = torch.full((batch,), context, device=run.device, dtype=torch.int32)
            out = torch.empty(batch, HEADS, RANK, device=run.device, dtype=run.dtype)
            head_blocks = -(-HEADS // config.decode_tiles(run.dtype).block_h)
            splits = choose_num_splits(batch, head_blocks, context, sms)

            def kernel():
                mla_decode(out, q, cache, tables, req, lens, scale, RANK, splits, config=config)

            nbytes = batch * context * entry * cache.element_size()
            us = common.time_us(kernel, run, "events")
            row = {
                "batch": batch,
                "context": context,
                "splits": splits,
                "us": us,
                "gb_per_s": common.tb_per_s(nbytes, us) * 1e3,
                "roofline_us": common.memory_roofline_us(nbytes, run),
            }
            if batch <= args.ref_max_batch:
                kernel()
                want = latent_attention_ref(q, cache, tables, req, lens, scale, RANK)
                row["max_abs_err"] = float((out.float() - want).abs().max())
                row["ref_us"] = common.time_us(
                    lambda: latent_attention_ref(q, cache, tables, req, lens, scale, RANK, context),
                    run,
                    "events",
                )
            rows.append(row)
            cache = None  # freed before the next case allocates its own
    common.print_rows(
        rows,
        ["batch", "context", "splits", "us", "gb_per_s", "roofline_us", "ref_us", "max_abs_err"],
        "MLA latent decode",
    )
    return rows


def _prefill_rows(args, run, config) -> list:
    import torch

    from pagoda.attention.mla_backend import PrefillChunk, assemble_prefill_qk, prefill_attention
    from pagoda.kernels.attention.mla_prefill import mla_prefill_attention, prefill_tile_table
    from pagoda.kernels.launch.host_copy import host_to_device

    steps = (
        {"fresh": [(20, 20), (9, 9)], "after a cached prefix": [(10, 30)]}
        if run.smoke
        else PREFILL_STEPS
    )
    sweep = PREFILL_SWEEP[:1] if run.smoke else PREFILL_SWEEP
    scale = (NOPE + ROPE) ** -0.5
    rows = []
    for name, layout in steps.items():
        gen = torch.Generator(device=run.device).manual_seed(0)
        n_rows, ctx = sum(q for q, _ in layout), sum(k for _, k in layout)
        q = torch.randn(n_rows, HEADS, NOPE + ROPE, device=run.device, generator=gen).to(run.dtype)
        kv = torch.randn(ctx, HEADS, NOPE + V, device=run.device, generator=gen).to(run.dtype)
        entries = torch.randn(ctx, RANK + ROPE, device=run.device, generator=gen).to(run.dtype)
        chunks, r, c = [], 0, 0
        for qlen, klen in layout:
            chunks.append(PrefillChunk(r, r + qlen, c, c + klen))
            r, c = r + qlen, c + klen
        p = dict(
            q_nope=q[..., :NOPE],
            q_rope=q[..., NOPE:],
            k_nope=kv[..., :NOPE],
            k_rope=entries[:, RANK:],
            v=kv[..., NOPE:],
        )
        flops = (
            2 * HEADS * (NOPE + ROPE + V) * sum(sum(range(k - q_ + 1, k + 1)) for q_, k in layout)
        )
        qq, kk = assemble_prefill_qk(p["q_nope"], p["q_rope"], p["k_nope"], p["k_rope"])
        ref = prefill_attention(qq, kk, p["v"], chunks, scale, upcast=True).float()

        def sdpa_path():
            a, b = assemble_prefill_qk(p["q_nope"], p["q_rope"], p["k_nope"], p["k_rope"])
            return prefill_attention(a, b, p["v"], chunks, scale, upcast=False)

        rel = lambda out: float((out.float() - ref).norm() / ref.norm())
        us = common.time_us(sdpa_path, run, "events")
        rows.append(
            {
                "step": name,
                "path": "sdpa",
                "us": us,
                "tflops": flops / us / 1e6,
                "rel_err": rel(sdpa_path()),
                "roofline_us": common.compute_roofline_us(flops, run),
            }
        )
        out = torch.empty(n_rows, HEADS, V, device=run.device, dtype=run.dtype)
        spans = [(ch.row_start, ch.row_end, ch.ctx_start, ch.ctx_end) for ch in chunks]
        variants = [("default", config)] + [
            (
                ":".join(map(str, t)),
                replace(
                    config,
                    **{
                        f: replace(
                            getattr(config, f),
                            block_m=t[0],
                            block_n=t[1],
                            num_warps=t[2],
                            num_stages=t[3],
                        )
                        for f in ("prefill_16bit", "prefill_fp32")
                    },
                ),
            )
            for t in (sweep if args.sweep_prefill else [])
        ]
        for label, cfg in variants:
            tiles = host_to_device(
                prefill_tile_table(spans, cfg.prefill_tile_rows), torch.int32, run.device
            )
            rows_idx = torch.arange(n_rows, device=run.device)

            def kernel(cfg=cfg, tiles=tiles):
                mla_prefill_attention(
                    out,
                    p["q_nope"],
                    p["q_rope"],
                    p["k_nope"],
                    p["k_rope"],
                    p["v"],
                    rows_idx,
                    tiles,
                    cfg.prefill_tile_rows,
                    scale,
                    config=cfg,
                )

            row = {"step": name, "path": f"kernel {label}"}
            try:
                kernel()
                row["rel_err"] = rel(out)
                row["us"] = common.time_us(kernel, run, "events")
                row["tflops"] = flops / row["us"] / 1e6
            except Exception as exc:  # a tile that does not fit
                row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
            row["roofline_us"] = common.compute_roofline_us(flops, run)
            rows.append(row)
    common.print_rows(
        rows, ["step", "path", "us", "tflops", "roofline_us", "rel_err", "error"], "MLA prefill"
    )
    return rows


def _projection_rows(run) -> list:
    import torch

    from pagoda.kernels.attention import mla_absorb

    q = torch.randn(1, HEADS * (NOPE + ROPE), device=run.device).to(run.dtype)
    q_nope, q_rope = q.view(1, HEADS, NOPE + ROPE).split([NOPE, ROPE], dim=-1)
    w = (torch.randn(HEADS, NOPE + V, RANK, device=run.device) * 0.05).to(run.dtype)
    w_uk, w_uv = w[:, :NOPE], w[:, NOPE:]
    cos = torch.rand(1, ROPE // 2, device=run.device)
    o_lat = torch.randn(1, HEADS, RANK, device=run.device).to(run.dtype)
    rows = [
        {
            "op": "absorb_q",
            "us": common.time_us(lambda: mla_absorb.absorb_q(q_nope, q_rope, w_uk, cos, cos), run),
        },
        {"op": "project_v", "us": common.time_us(lambda: mla_absorb.project_v(o_lat, w_uv), run)},
        {
            "op": "project_v (torch bmm)",
            "us": common.time_us(
                lambda: torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)), run
            ),
        },
    ]
    common.print_rows(rows, ["op", "us"], "MLA projections at one token")
    return rows


def run_mla(args, run) -> dict:
    config = configs_for(args.config, run.device).mla
    out = {"decode": _decode_rows(args, run, config), "prefill": _prefill_rows(args, run, config)}
    if args.projections:
        out["projections"] = _projection_rows(run)
    return out
