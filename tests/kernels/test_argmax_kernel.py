"""The row-wise argmax kernel (pagoda.kernels.sample.argmax) against torch.argmax, and the
sampler's use of it.

Without CUDA the kernel runs under TRITON_INTERPRET=1 in float32 and float16 (the
interpreter gets bfloat16 wrong: bfloat16 runs only compiled, on CUDA). Small V with
small chunks for most cases (many chunks per row, so every cross-chunk rule is
exercised), and Llama-3's V = 128256 once at a large chunk. Covered: random rows at
several V (one chunk, shorter than a chunk, not a multiple of it) and row counts up to
MAX_ROWS; maxima tied across chunk boundaries and within a chunk (the lowest index
wins, -0.0 ties +0.0); NaN (the first NaN wins, also from a later chunk than a larger
finite value or +inf; a row of NaN); -inf rows; a strided row view; the arrival counters
back at 0 after a call and a second call on new values; the default chunk arithmetic
and the refused arguments. With CUDA: bfloat16, the default chunks, and the sampler's
greedy paths equal to torch.argmax of the float32 logits.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
from helpers.interpreted_kernels import kernel_modules  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
gpu = pytest.mark.gpu
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def am():
    return kernel_modules("sample.argmax")[0]


def _randn(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen).to(dtype).to(DEVICE)


def _check(am, x: torch.Tensor, chunk=None) -> torch.Tensor:
    got = am.argmax_rows(x, chunk)
    assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
    assert torch.equal(got.cpu(), am.argmax_rows_ref(x).cpu()), (got, am.argmax_rows_ref(x))
    assert int(am.argmax_workspace(x.device).counters.abs().sum()) == 0
    return got


# ------------------------------------------------------------------- random rows ----
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows,vocab,chunk",
    [
        (1, 1, 16),
        (1, 5, 16),
        (3, 100, 16),
        (2, 1000, 64),
        (4, 1000, None),
        (1, 4096, 256),
        (5, 777, 128),
    ],
)
def test_random_rows_equal_torch(am, dtype, rows, vocab, chunk):
    _check(am, _randn(rows, vocab, dtype, seed=rows * 7919 + vocab), chunk)


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_rows_with_heavy_ties(am, dtype):
    """MAX_ROWS rows of small integers: every row's maximum repeats, in several chunks."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 6, (am.MAX_ROWS, 300), generator=gen).to(dtype).to(DEVICE)
    _check(am, x, 32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_llama3_vocabulary(am, dtype):
    x = _randn(2, 128256, dtype, seed=3)
    x[1, 128255] = 100.0  # the last element of the last, partial chunk
    _check(am, x, 8192)


# ---------------------------------------------------------------------- ties --------
@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_across_chunk_boundaries_take_the_lowest_index(am, dtype):
    chunk, vocab = 16, 100
    x = torch.zeros(5, vocab, dtype=dtype)
    x[0, [15, 16]] = 3.0  # the last of chunk 0 and the first of chunk 1
    x[1, [47, 48, 99]] = 3.0  # across 2|3 and in the last, partial chunk
    x[2, [31, 32, 33, 64]] = 3.0  # several in one chunk and in a later one
    x[3, [99]] = 3.0  # only in the partial chunk
    x[4] = -1.0
    x[4, [20, 40]] = torch.tensor([-0.0, 0.0], dtype=dtype)  # -0.0 ties +0.0: 20 wins
    got = _check(am, x.to(DEVICE), chunk)
    assert got.tolist() == [15, 47, 31, 99, 20]


# ----------------------------------------------------------------------- NaN --------
@pytest.mark.parametrize("dtype", DTYPES)
def test_first_nan_wins(am, dtype):
    chunk, vocab = 16, 70
    x = _randn(6, vocab, dtype, seed=5).cpu()
    x[0, 40] = NAN  # a NaN in a later chunk than a larger finite value
    x[0, 3] = 1000.0
    x[1, 2] = INF  # +inf first, NaN later: NaN wins
    x[1, 50] = NAN
    x[2, [60, 20, 17]] = NAN  # several NaN in several chunks: the first
    x[3, [9, 5]] = NAN  # two in one chunk
    x[4] = NAN  # all NaN
    x[5, 69] = NAN  # in the last, partial chunk
    got = _check(am, x.to(DEVICE), chunk)
    assert got.tolist() == [40, 50, 17, 5, 0, 69]


# ----------------------------------------------------------------------- -inf -------
@pytest.mark.parametrize("dtype", DTYPES)
def test_minus_inf_rows(am, dtype):
    x = torch.full((3, 50), -INF, dtype=dtype)
    x[1, 33] = -1e4  # one finite value among -inf
    x[2, [17, 40]] = INF
    got = _check(am, x.to(DEVICE), 16)
    assert got.tolist() == [0, 33, 17]


def test_strided_rows(am):
    """A column slice of a wider tensor: rows a stride apart, elements contiguous."""
    wide = _randn(3, 200, torch.float32, seed=9)
    _check(am, wide[:, :130], 32)


# ------------------------------------------------------- counters and relaunch ------
def test_second_call_on_new_values(am):
    """The counters are 0 after a call (checked by _check), so a second launch on the
    same workspace (a CUDA-graph replay) reduces its own values."""
    x = _randn(3, 500, torch.float32, seed=11)
    _check(am, x, 64)
    x[:, 0] = 50.0
    assert _check(am, x, 64).tolist() == [0, 0, 0]


# ------------------------------------------------------------------ arguments -------
def test_default_chunks(am):
    assert am.default_chunk(1, 128256) == 1024  # 126 programs: about one wave
    assert am.default_chunk(1, 151936) == 2048
    assert am.default_chunk(64, 128256) == am._MAX_CHUNK
    assert am.default_chunk(1, 10) == 16 and am.default_chunk(2, 700) == 1024
    for rows in (1, 7, am.MAX_ROWS):
        chunk = am.default_chunk(rows, am.MAX_VOCAB)
        assert -(-am.MAX_VOCAB // chunk) <= am.MAX_CHUNKS


def test_refused_arguments(am):
    x = torch.zeros(2, 64, device=DEVICE)
    for bad in (
        torch.zeros(0, 64),
        torch.zeros(am.MAX_ROWS + 1, 64),
        torch.zeros(64),
        torch.zeros(2, 64, dtype=torch.int32),
        torch.zeros(2, 64, dtype=torch.float64),
    ):
        assert not am.argmax_covers(bad)
        with pytest.raises(ValueError):
            am.argmax_rows(bad.to(DEVICE))
    for chunk in (8, 48):
        with pytest.raises(ValueError):
            am.argmax_rows(x, chunk)
    with pytest.raises(ValueError):  # more than MAX_CHUNKS chunks
        am.argmax_rows(torch.zeros(1, 16 * am.MAX_CHUNKS + 1, device=DEVICE), 16)


# ------------------------------------------------------------ compiled only -------
@gpu
@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("vocab", [32000, 128256, 151936, 262144])
def test_default_chunks_on_gpu(am, rows, vocab):
    for dtype in DTYPES:
        _check(am, _randn(rows, vocab, dtype, seed=rows + vocab))


@gpu
def test_sampler_greedy_paths_on_gpu():
    """All-greedy bf16 logits (the direct path), with a penalty (float32 path) and a
    mixed batch: the tokens of torch.argmax on the float32 logits as processed."""
    from pagoda.sample.metadata import SamplingRow, build_sampling_metadata
    from pagoda.sample.sampler import Sampler, process_logits, takes_model_logits_argmax
    from pagoda.sampling_params import SamplingParams

    vocab = 128256
    logits = _randn(4, vocab, torch.bfloat16, seed=13)
    logits[2, [5, 70000]] = 40.0  # a tie across chunks
    cases = {
        "greedy": [SamplingParams(temperature=0.0)] * 4,
        "penalty": [SamplingParams(temperature=0.0, presence_penalty=1.5)] * 4,
        "mixed": [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(temperature=1.0)],
    }
    for name, params in cases.items():
        rows = [SamplingRow(p, [1, 2], [3, 70000]) for p in params]
        metadata = build_sampling_metadata(rows, vocab, logits.device)
        assert takes_model_logits_argmax(logits, metadata) == (name == "greedy")
        got = Sampler()(logits, metadata).sampled_token_ids
        want = process_logits(logits.float(), metadata).argmax(dim=-1)
        greedy = slice(0, 3) if name == "mixed" else slice(None)
        assert torch.equal(got[greedy], want[greedy]), name
