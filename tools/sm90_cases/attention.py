"""The attention kernels' sm_90 compile cases: paged decode attention and its merge
(the "pdl" and "defaults" groups), the q/k norm + rotary + KV store, and the MLA prefill
kernel (the "mla_prefill" group)."""

from __future__ import annotations

import torch

from .shapes import BF16, HOPPER


def decode_case(
    heads: int, kv_heads: int, fp8: bool, direct: bool, dtype: torch.dtype = BF16, dim: int = 128
):
    """(kernel, args, kwargs) of paged_attention_decode's launch for one query row of
    heads query heads over kv_heads KV heads, 8 context slices (direct: one), as the
    wrapper chooses its kernel and tiles from DecodeAttentionConfig for Hopper."""
    from pagoda.kernels.attention import paged_decode as pd
    from pagoda.kernels.attention import paged_decode_words as pdw
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
            pdw._decode_words_kernel,
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


def pdl_decode_cases():
    """Decode attention over a bf16 and an FP8 cache at the Qwen3 grouping, and the
    merge of 8 slices; all load the query start and context length before the wait."""
    from pagoda.kernels.attention import paged_decode_slices as pds

    for fp8 in (False, True):
        yield (f"decode[fp8={fp8}, preload]", *decode_case(32, 4, fp8, direct=False))
    attn_out, part = torch.empty(1, 32, 128, dtype=BF16), torch.empty(1, 32, 8, 128)
    lse, i32 = torch.empty(1, 32, 8), torch.empty(64, dtype=torch.int32)
    yield (
        "decode_merge[preload]",
        pds._merge_kernel,
        (attn_out, part, lse, i32, 8, attn_out.stride(0), attn_out.stride(1)),
        dict(NUM_HEADS=32, HEAD_DIM=128, SPLITS_PAD=8, USE_PDL=True),
    )


def default_decode_cases():
    """The decode kernels the engine launches by default at the Llama-8B (4 query heads
    a KV head) and Qwen3 (8) groupings, over 8 slices and one (direct output); and an
    FP8 cache the word kernel cannot read (float32 queries, head_dim 32)."""
    for heads, kv_heads in ((32, 8), (32, 4)):
        for fp8 in (False, True):
            for direct in (False, True):
                yield (
                    f"decode[{heads}/{kv_heads}, fp8={fp8}, direct={direct}]",
                    *decode_case(heads, kv_heads, fp8, direct),
                )
    yield ("decode[fp8, fp32 q]", *decode_case(32, 8, True, False, dtype=torch.float32))
    yield ("decode[fp8, head_dim 32]", *decode_case(32, 8, True, False, dim=32))


def qk_rope_store_cases():
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


def mla_prefill_cases():
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
