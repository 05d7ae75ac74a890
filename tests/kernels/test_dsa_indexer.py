"""The DeepSeek Sparse Attention indexer (pagoda/kernels/attention/dsa_indexer.py): its
torch reference against a direct loop, the Triton score kernel against the reference,
and the top-k selection, whole and in chunks of rows.

Without CUDA the kernel runs under TRITON_INTERPRET=1 (set before Triton is imported,
by conftest or here) on small shapes in float32 and float16. Unused cache slots hold
NaN (helpers/dsa_case.py).
"""

import dataclasses
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
from helpers.dsa_case import PagedCase  # noqa: E402
from helpers.interpreted_kernels import kernel_modules  # noqa: E402

from pagoda.kernels.attention.dsa_config import DSAKernelConfig, IndexerTiles  # noqa: E402
from pagoda.kernels.attention.dsa_indexer import (  # noqa: E402
    indexer_scores,
    indexer_scores_ref,
    indexer_topk,
    select_topk,
)

DEVICE = "cuda" if ON_GPU else "cpu"
kernel_modules("attention.dsa_indexer_kernel")

# Requests of 0, 3, 9, 17 and 40 tokens; a row per request at its full length, three
# prefill-like rows of the longest, and a padding row.
SEQ_LENS = [0, 3, 9, 17, 40]
ROWS = [(0, 0), (1, 3), (2, 9), (3, 17), (4, 38), (4, 39), (4, 40), (2, 0)]
WIDTH = 44
# Chunks of 2 tiles of 16 tokens: several chunks per row, rows ending mid-chunk and
# chunks past a row's end.
SMALL_TILES = IndexerTiles(block_n=16, tiles_per_program=2, num_warps=4, num_stages=1)


class IndexerCase:
    def __init__(self, heads, dim, block_size, dtype, seed=0):
        self.paged = PagedCase(SEQ_LENS, block_size, dim, dtype, seed=seed)
        self.q = self.paged.randn(len(ROWS), heads, dim, dtype=dtype)
        self.weights = self.paged.randn(len(ROWS), heads).abs() * 0.5
        self.row_req = torch.tensor([r for r, _ in ROWS], dtype=torch.int32)
        self.row_len = torch.tensor([n for _, n in ROWS], dtype=torch.int32)

    def args(self, device, nan=True):
        cache = self.paged.cache_nan if nan else self.paged.cache
        tensors = (self.q, self.weights, cache, self.paged.tables, self.row_req, self.row_len)
        return tuple(t.to(device) for t in tensors)


def test_reference_matches_direct_loop():
    case = IndexerCase(heads=4, dim=32, block_size=4, dtype=torch.float32)
    got = indexer_scores_ref(*case.args("cpu"), WIDTH)
    expected = torch.full((len(ROWS), WIDTH), float("-inf"))
    for n, (req, length) in enumerate(ROWS):
        for t in range(length):
            key = case.paged.token(req, t)
            expected[n, t] = sum(
                case.weights[n, h] * torch.relu(torch.dot(case.q[n, h], key)) for h in range(4)
            )
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.isinf(got[0]).all() and torch.isinf(got[-1]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,dim,block_size", [(4, 32, 4), (6, 48, 16)])
@pytest.mark.parametrize("small_tiles", [False, True])
def test_kernel_matches_reference(dtype, heads, dim, block_size, small_tiles):
    case = IndexerCase(heads, dim, block_size, dtype, seed=1)
    config = DSAKernelConfig.for_device(torch.device(DEVICE))
    if small_tiles:
        config = dataclasses.replace(config, indexer_16bit=SMALL_TILES, indexer_fp32=SMALL_TILES)
    expected = indexer_scores_ref(*case.args("cpu", nan=False), WIDTH)
    # A strided view of a wider buffer, full of NaN: every position must be written.
    buffer = torch.full((len(ROWS), WIDTH + 5), float("nan"), device=DEVICE)
    out = buffer[:, :WIDTH]
    indexer_scores(out, *case.args(DEVICE), config=config)
    out = out.cpu()
    assert not out.isnan().any()
    assert torch.equal(torch.isinf(out), torch.isinf(expected))
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    finite = torch.isfinite(expected)
    assert torch.allclose(out[finite], expected[finite], atol=tol, rtol=tol)
    assert buffer[:, WIDTH:].isnan().all()  # nothing written past the view


def test_select_topk():
    k = 4
    scores = torch.tensor(
        [
            [float("-inf")] * 8,  # padding row
            [5.0, 1.0] + [float("-inf")] * 6,  # 2 tokens: both, whatever their scores
            [0.1, 0.4, 0.3, 0.2] + [float("-inf")] * 4,  # exactly k tokens
            [0.5, 9.0, 0.1, 3.0, 7.0, 0.2, 8.0, float("-inf")],  # 7 tokens: the best 4
        ]
    )
    row_len = torch.tensor([0, 2, 4, 7], dtype=torch.int32)
    got = select_topk(scores, row_len, k)
    assert got.dtype == torch.int32
    assert got.tolist() == [[-1] * 4, [0, 1, -1, -1], [0, 1, 2, 3], [1, 3, 4, 6]]
    # Narrow scores (every row short): leading positions, no selection.
    assert select_topk(scores[:, :3], torch.tensor([0, 2, 3, 3]), k).tolist()[1:] == [
        [0, 1, -1, -1],
        [0, 1, 2, -1],
        [0, 1, 2, -1],
    ]


@pytest.mark.parametrize("use_kernel", [False, True])
def test_indexer_topk_in_row_chunks(use_kernel):
    k = 8
    case = IndexerCase(heads=4, dim=32, block_size=4, dtype=torch.float32, seed=2)
    reference = indexer_scores_ref(*case.args("cpu", nan=False), WIDTH)
    expected = select_topk(reference, case.row_len, k)
    got = indexer_topk(*case.args(DEVICE), k, WIDTH, row_chunk=3, use_kernel=use_kernel)
    got = got.cpu()
    # max_len 0: the longest row_len, read from the device.
    unknown = indexer_topk(*case.args(DEVICE), k, 0, row_chunk=3, use_kernel=use_kernel)
    assert torch.equal(unknown.cpu(), got)
    assert got.shape == (len(ROWS), k) and got.dtype == torch.int32
    if not use_kernel:
        assert torch.equal(got, expected)
        return
    # The kernel's float32 sums may order near-equal scores differently: the chosen
    # positions are the reference's (short rows) or score what the reference's best do.
    for n, length in enumerate(case.row_len.tolist()):
        if length <= k:
            assert torch.equal(got[n], expected[n])
        else:
            assert torch.equal(got[n], got[n].sort().values)
            chosen = reference[n, got[n].long()].sort().values
            best = reference[n, expected[n].long()].sort().values
            assert torch.allclose(chosen, best, atol=1e-5)


def test_indexer_topk_short_contexts_score_nothing():
    """With max_len <= k every row takes its whole context: q is not read (NaN here)."""
    case = IndexerCase(heads=4, dim=32, block_size=4, dtype=torch.float32)
    q, weights, cache, tables, row_req, row_len = case.args("cpu")
    q = torch.full_like(q, float("nan"))
    got = indexer_topk(q, weights, cache, tables, row_req, row_len, 64, 40, row_chunk=2)
    assert got.shape == (len(ROWS), 64)
    for n, length in enumerate(row_len.tolist()):
        assert got[n].tolist() == list(range(length)) + [-1] * (64 - length)
