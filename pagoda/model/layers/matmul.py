"""``linear(x, weight, bias)``: F.linear, computed on the CPU as a batch of column blocks.

Why: on the CPU, MKL's own threading of one float32 product of a few rows (decode) with
a weight of megabytes leaves most of the machine idle, and a weight of tens of
megabytes runs far from cache. Viewing the weight [N, K] as P blocks [P, N/P, K] and
calling one ``bmm`` (ATen hands the P independent products to the threads, each one
single-threaded) fixes both: every SmolLM2-135M projection got faster, at 1 row and at
32 (figures: docs/performance.md, "measured reasons").

Invariant: each output element is still one dot product over the whole of K by the
same kernel; only which thread computes which columns changes. The result is
bit-identical to F.linear (asserted by tests/model/test_linear_blocks.py), so greedy outputs
stay identical to Hugging Face's, which calls F.linear. CUDA tensors, other dtypes and
weights without a suitable split take F.linear unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Each block holds at most about this much weight (the best block size measured,
# docs/performance.md) ...
_BLOCK_BYTES = 1 << 20
# ... and there are at least this many blocks (and at least one per thread).
_MIN_BLOCKS = 4
# Blocks narrower than this many output columns are not worth a split.
_MIN_BLOCK_COLS = 64


def num_blocks(out_features: int, in_features: int, element_size: int, threads: int) -> int:
    """How many equal column blocks a weight [out_features, in_features] is split into:
    the smallest divisor of out_features that gives blocks of at most _BLOCK_BYTES and
    at least max(_MIN_BLOCKS, threads) blocks; 1 (no split) when none is wide enough."""
    want = max(_MIN_BLOCKS, threads, -(-out_features * in_features * element_size // _BLOCK_BYTES))
    for blocks in range(want, out_features // _MIN_BLOCK_COLS + 1):
        if out_features % blocks == 0:
            return blocks
    return 1


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] @ weight[out, in].T (+ bias) -> [M, out], exactly like F.linear."""
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.dim() != 2
        or not weight.is_contiguous()
    ):
        return F.linear(x, weight, bias)
    out_features, in_features = weight.shape
    blocks = num_blocks(out_features, in_features, weight.element_size(), torch.get_num_threads())
    if blocks == 1:
        return F.linear(x, weight, bias)
    cols = out_features // blocks
    w = weight.view(blocks, cols, in_features).transpose(1, 2)  # [P, K, cols], no copy
    xb = x.expand(blocks, *x.shape)
    if bias is None:
        y = torch.bmm(xb, w)
    else:  # beta * bias + x @ w, as F.linear's addmm: the add rounds the same way
        y = torch.baddbmm(bias.view(blocks, 1, cols), xb, w)
    return y.transpose(0, 1).reshape(x.shape[0], out_features)  # [P, M, cols] -> [M, N]
