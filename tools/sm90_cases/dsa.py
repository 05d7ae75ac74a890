"""The DeepSeek Sparse Attention kernels' sm_90 compile cases (the "dsa" group): the
lightning indexer's scores and top-k and sparse latent attention at DeepSeek-V3.2's
widths, with the arguments their wrappers build (`indexer_launch`, `topk_launch`,
`sparse_launch`)."""

from __future__ import annotations

import torch

from .shapes import BF16, HOPPER


def dsa_cases():
    """Indexer scores (64 heads x 128 dims, a width of 4096) in bf16 and float32, with
    and without the -inf fill; the top-k of 2048 (and of 512) over a width of 163840,
    whole rows and (512) rows in segments, each of the six stages;
    sparse latent attention (128 heads, 512 + 64 entries, 2048 selected) in bf16 whole
    and split, with and without a count, and float32 split; pages of 64 tokens."""
    from pagoda.kernels.attention import dsa_indexer_kernel as dik
    from pagoda.kernels.attention import dsa_topk_kernel as dtk
    from pagoda.kernels.attention import sparse_mla_kernel as smk
    from pagoda.kernels.attention.dsa_config import DSAKernelConfig

    config = DSAKernelConfig.for_capability(HOPPER)
    rows, i32 = 4, torch.empty(4096, dtype=torch.int32)
    for dtype in (BF16, torch.float32):
        out = torch.empty(rows, 4096)
        q, weights = torch.empty(rows, 64, 128, dtype=dtype), torch.empty(rows, 64)
        keys = torch.empty(8, 64, 128, dtype=dtype)
        tiles = config.indexer_tiles(dtype)
        _, args, kwargs = dik.indexer_launch(out, q, weights, keys, i32[:64], i32, i32, tiles)
        yield (
            f"indexer[{str(dtype).removeprefix('torch.')}]",
            dik._indexer_scores_kernel,
            args,
            kwargs,
        )
        if dtype == BF16:  # as indexer_topk launches it: nothing past a row's length
            _, args, kwargs = dik.indexer_launch(
                out, q, weights, keys, i32[:64], i32, i32, tiles, fill=False
            )
            yield "indexer[bfloat16,fill=False]", dik._indexer_scores_kernel, args, kwargs
    scores = torch.empty(rows, 163840)
    for k in (2048, 512):
        positions = torch.empty(rows, k, dtype=torch.int32)
        _, args, kwargs = dtk.topk_launch(positions, scores, i32, k, config.topk)
        yield f"topk[k={k}]", dtk._topk_positions_kernel, args, kwargs
    # A decode step's few rows, each cut into 10 segments: the split kernel's stages.
    launches = dtk.split_launches(positions, scores, i32, 512, config.topk, 10)
    for stage, (_, args, kwargs) in enumerate(launches):
        yield f"topk_split[k=512,stage={stage}]", dtk._topk_split_kernel, args, kwargs
    selected = torch.empty(rows, 2048, dtype=torch.int32)
    for dtype, splits, count in (
        (BF16, 1, i32),
        (BF16, 8, i32),
        (BF16, 1, None),
        (torch.float32, 8, i32),
    ):
        q, out = torch.empty(rows, 128, 576, dtype=dtype), torch.empty(rows, 128, 512, dtype=dtype)
        part, lse = torch.empty(rows, 128, splits, 512), torch.empty(rows, 128, splits)
        cache = torch.empty(8, 64, 576, dtype=dtype)
        _, args, kwargs = smk.sparse_launch(
            out, part, lse, q, cache, i32[:64], i32, selected, count, 0.1, 512, splits,
            config.sparse_tiles(dtype),
        )  # fmt: skip
        name = f"sparse_mla[{str(dtype).removeprefix('torch.')},splits={splits},count={count is not None}]"
        yield name, smk._sparse_mla_kernel, args, kwargs
