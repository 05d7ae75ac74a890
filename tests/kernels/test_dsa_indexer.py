"""The DeepSeek Sparse Attention indexer (pagoda/kernels/attention/dsa_indexer.py): its
torch reference against a direct loop, the Triton score kernel against the reference,
the top-k selection (select_topk against a stable sort, the Triton top-k of
dsa_topk_kernel.py against select_topk), and both in chunks of rows.

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

from pagoda.kernels.attention.dsa_config import (  # noqa: E402
    DSAKernelConfig,
    IndexerTiles,
    TopkTiles,
)
from pagoda.kernels.attention.dsa_indexer import (  # noqa: E402
    indexer_scores,
    indexer_scores_ref,
    indexer_topk,
    select_topk,
    topk_positions,
)

DEVICE = "cuda" if ON_GPU else "cpu"
kernel_modules("attention.dsa_indexer_kernel", "attention.dsa_topk_kernel")

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
    # Without the fill only t < row_len is written: the rest keeps its NaN.
    unfilled = torch.full((len(ROWS), WIDTH), float("nan"), device=DEVICE)
    indexer_scores(unfilled, *case.args(DEVICE), config=config, fill=False)
    indexer_scores(out, *case.args(DEVICE), config=config)
    out = out.cpu()
    assert not out.isnan().any()
    assert torch.equal(torch.isinf(out), torch.isinf(expected))
    seen = torch.arange(WIDTH)[None, :] < case.row_len[:, None]
    assert torch.equal(unfilled.cpu()[seen], out[seen]) and unfilled.cpu()[~seen].isnan().all()
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


def stable_topk(scores, row_len, k):
    """The tie rule spelled out: a long row's first k positions by (-score, position),
    ascending; a short row all its positions."""
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int32)
    for n, length in enumerate(row_len.tolist()):
        if length <= k:
            out[n, :length] = torch.arange(length)
        else:
            order = torch.sort(scores[n, :length], descending=True, stable=True).indices
            out[n] = order[:k].sort().values
    return out


def topk_rows(width, k, seed):
    """Scores [R, width] and row_len [R]: rows of 0, fewer than k, k, k + 1 and more
    tokens; whole rows of few distinct values (ties at the threshold), of one value, of
    +0 and -0, with -inf, with fewer than k finite scores. Past row_len: NaN, +inf and
    huge values, which must never be read."""
    gen = torch.Generator().manual_seed(seed)
    lens = [0, 1, k - 1, k, k + 1, 2 * k + 3, width // 2 + 1, width - 1, width]
    scores = torch.randn(len(lens) + 6, width, generator=gen)
    rand = torch.rand(6, width, generator=gen)
    scores[-6] = torch.randint(0, 4, (width,), generator=gen).float()
    scores[-5] = 0.5
    scores[-4] = torch.where(rand[0] < 0.5, 0.0, -0.0)
    scores[-4, :: width // 3] = 1.0
    scores[-3] = torch.where(rand[1] < 0.5, float("-inf"), scores[-3])
    scores[-2] = float("-inf")
    scores[-2, -k // 2 :] = 1.0  # fewer than k finite: the first -inf fill the rest
    scores[-1] = torch.where(rand[2] < 0.3, -1.0, scores[-1].abs().neg())
    row_len = torch.tensor(lens + [width] * 5 + [width - 3], dtype=torch.int32)
    garbage = torch.tensor([float("nan"), float("inf"), 3e38, -0.0])
    past = torch.arange(width)[None, :] >= row_len[:, None]
    junk = garbage[torch.randint(0, 4, scores.shape, generator=gen)]
    return torch.where(past, junk, scores), row_len


def test_select_topk_tie_rule():
    for width, k, seed in ((40, 4, 0), (300, 16, 1)):
        scores, row_len = topk_rows(width, k, seed)
        assert torch.equal(select_topk(scores, row_len, k), stable_topk(scores, row_len, k))


@pytest.mark.parametrize(
    "width,k,block,segments",
    [
        (40, 4, 16, 1),
        (300, 16, 64, 1),
        (1000, 64, 256, 1),
        (3000, 64, None, 1),
        # Rows cut into segments of a few tiles, rows ending in any of them.
        (40, 4, 16, 3),
        (300, 16, 16, 5),
        (1000, 64, 64, 7),
        (3000, 64, None, 2),
    ],
)
def test_topk_positions_matches_reference(width, k, block, segments):
    scores, row_len = topk_rows(width, k, seed=width)
    config = DSAKernelConfig.for_device(torch.device(DEVICE))
    if block is not None:  # several tiles a row, rows ending mid-tile
        config = dataclasses.replace(config, topk=TopkTiles(block=block, num_warps=4))
    got = topk_positions(
        scores.to(DEVICE), row_len.to(DEVICE), k, config=config, segments=segments
    ).cpu()
    assert got.dtype == torch.int32 and got.shape == (scores.shape[0], k)
    assert torch.equal(got, select_topk(scores, row_len, k))


def test_topk_segments():
    tiles = TopkTiles(block=2048, num_warps=8, min_segment=16384, max_segments=32)
    assert tiles.segments(4096, 163840, 132, 2) == 1  # a prefill fills the GPU alone
    assert tiles.segments(8, 163840, 132, 2) == 10  # by length: segments of 16384
    assert tiles.segments(64, 1 << 20, 132, 2) == 5  # by occupancy
    assert tiles.segments(1, 1 << 22, 132, 2) == 32  # at most max_segments
    assert tiles.segments(8, 4096, 132, 2) == 1  # short rows


def test_topk_positions_into_strided_out():
    k = 8
    scores, row_len = topk_rows(100, k, seed=3)
    buffer = torch.full((scores.shape[0], k + 3), 7777, dtype=torch.int32, device=DEVICE)
    out = topk_positions(
        scores.to(DEVICE), row_len.long().to(DEVICE), k, out=buffer[:, :k]
    )  # fmt: skip
    assert out.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:, :k].cpu(), select_topk(scores, row_len, k))
    assert (buffer[:, k:] == 7777).all()  # nothing written past the view
    with pytest.raises(ValueError):
        topk_positions(scores.to(DEVICE), row_len.to(DEVICE), k, out=buffer)


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
    # A loose bound (a CUDA graph's) selects the same.
    loose = indexer_topk(*case.args(DEVICE), k, WIDTH + 37, row_chunk=3, use_kernel=use_kernel)
    assert torch.equal(loose.cpu(), got)
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
