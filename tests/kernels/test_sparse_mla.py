"""Sparse latent attention (pagoda/kernels/attention/sparse_mla.py): its torch reference
against dense latent attention and a direct computation, and the Triton kernel (whole
and split, with and without a count) against the reference.

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

from pagoda.attention.mla_backend import latent_attention_ref  # noqa: E402
from pagoda.kernels.attention.dsa_config import DSAKernelConfig, SparseMLATiles  # noqa: E402
from pagoda.kernels.attention.dsa_indexer import leading_positions  # noqa: E402
from pagoda.kernels.attention.sparse_mla import (  # noqa: E402
    sparse_latent_attention,
    sparse_latent_attention_ref,
)

DEVICE = "cuda" if ON_GPU else "cpu"
kernel_modules("attention.mla_decode", "attention.sparse_mla_kernel")

SEQ_LENS = [0, 1, 5, 17, 38]
# (request, context length): a row per request, two earlier rows of the longest, padding.
ROWS = [(0, 0), (1, 1), (2, 5), (3, 17), (4, 36), (4, 37), (4, 38), (3, 0)]
SCALE = 0.3
# Tiles of 16 entries: a list of 40 spans three splits of 16 (the last part-full).
SMALL_TILES = SparseMLATiles(block_h=16, block_n=16, num_warps=4, num_stages=1)


def row_tensors():
    return (
        torch.tensor([r for r, _ in ROWS], dtype=torch.int32),
        torch.tensor([n for _, n in ROWS], dtype=torch.int32),
    )


def scattered_positions(row_len, k, seed):
    """Per row a random subset of its context (at most k, about half of it) at random
    places of a list of k, -1 elsewhere; the row at index 3 gets only -1s."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((len(row_len), k), -1, dtype=torch.int32)
    for n, length in enumerate(row_len.tolist()):
        if n == 3 or length == 0:
            continue
        take = min(k, max(1, length // 2))
        chosen = torch.randperm(length, generator=gen)[:take]
        places = torch.randperm(k, generator=gen)[:take]
        out[n, places] = chosen.to(torch.int32)
    return out


def test_reference_with_every_position_is_dense_latent_attention():
    case = PagedCase(SEQ_LENS, 4, 32 + 16, torch.float32)
    q = case.randn(len(ROWS), 4, 48)
    row_req, row_len = row_tensors()
    # latent_attention_ref multiplies unused slots by 0: it needs them finite.
    dense = latent_attention_ref(q, case.cache, case.tables, row_req, row_len, SCALE, 32)
    positions = leading_positions(row_len, 40)
    got = sparse_latent_attention_ref(q, case.cache_nan, case.tables, row_req, positions, SCALE, 32)
    assert torch.allclose(got, dense, atol=1e-5, rtol=1e-5)
    # Order does not matter, nor where the -1s are.
    gen = torch.Generator().manual_seed(5)
    shuffled = torch.stack([p[torch.randperm(40, generator=gen)] for p in positions])
    got = sparse_latent_attention_ref(q, case.cache_nan, case.tables, row_req, shuffled, SCALE, 32)
    assert torch.allclose(got, dense, atol=1e-5, rtol=1e-5)


def test_reference_matches_direct_computation():
    case = PagedCase(SEQ_LENS, 4, 24 + 8, torch.float32, seed=1)
    q = case.randn(len(ROWS), 3, 32)
    row_req, row_len = row_tensors()
    positions = scattered_positions(row_len, 12, seed=2)
    got = sparse_latent_attention_ref(q, case.cache_nan, case.tables, row_req, positions, SCALE, 24)
    for n, (req, _) in enumerate(ROWS):
        picked = [p for p in positions[n].tolist() if p >= 0]
        if not picked:
            assert torch.equal(got[n], torch.zeros(3, 24))
            continue
        entries = torch.stack([case.token(req, p) for p in picked])  # [K', E]
        probs = torch.softmax(q[n] @ entries.T * SCALE, dim=-1)
        assert torch.allclose(got[n], probs @ entries[:, :24], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kv_lora_rank,rope,heads", [(32, 16, 4), (24, 8, 20)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kernel_matches_reference(dtype, kv_lora_rank, rope, heads, num_splits):
    entry = kv_lora_rank + rope
    case = PagedCase(SEQ_LENS, 4, entry, dtype, seed=3)
    q = case.randn(len(ROWS), heads, entry, dtype=dtype)
    row_req, row_len = row_tensors()
    positions = scattered_positions(row_len, 40, seed=4)
    expected = sparse_latent_attention_ref(
        q, case.cache, case.tables, row_req, positions, SCALE, kv_lora_rank
    )
    config = DSAKernelConfig.for_device(torch.device(DEVICE))
    config = dataclasses.replace(config, sparse_16bit=SMALL_TILES, sparse_fp32=SMALL_TILES)
    out = torch.full((len(ROWS), heads, kv_lora_rank), float("nan"), dtype=dtype, device=DEVICE)
    tensors = [t.to(DEVICE) for t in (q, case.cache_nan, case.tables, row_req, positions)]
    got = sparse_latent_attention(
        *tensors, SCALE, kv_lora_rank, num_splits=num_splits, out=out, config=config
    )
    assert got is out
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert not out.isnan().any()
    assert torch.allclose(out.float().cpu(), expected, atol=tol, rtol=tol)
    assert not out[3].any() and not out[-1].any()  # nothing selected: zeros


@pytest.mark.parametrize("num_splits", [1, 4])
def test_kernel_with_counts_of_selected_lists(num_splits):
    """select_topk's lists (positions then -1s) read up to count = row_len, float32 out
    from float16 inputs, the device's default tiles; k >= every length: dense."""
    case = PagedCase(SEQ_LENS, 16, 32 + 16, torch.float16, seed=6)
    q = case.randn(len(ROWS), 4, 48, dtype=torch.float16)
    row_req, row_len = row_tensors()
    positions = leading_positions(row_len, 48)
    expected = latent_attention_ref(q, case.cache, case.tables, row_req, row_len, SCALE, 32)
    out = torch.full((len(ROWS), 4, 32), float("nan"), device=DEVICE)
    tensors = [t.to(DEVICE) for t in (q, case.cache_nan, case.tables, row_req, positions)]
    sparse_latent_attention(
        *tensors, SCALE, 32, num_splits=num_splits, count=row_len.to(DEVICE), out=out
    )
    assert torch.allclose(out.cpu(), expected, atol=2e-3, rtol=2e-3)


def test_default_output_and_splits():
    """Without out and num_splits: a new tensor in q's dtype, splits by the config."""
    case = PagedCase(SEQ_LENS, 4, 32 + 16, torch.float16, seed=7)
    q = case.randn(len(ROWS), 4, 48, dtype=torch.float16)
    row_req, row_len = row_tensors()
    positions = scattered_positions(row_len, 24, seed=8)
    expected = sparse_latent_attention_ref(
        q, case.cache, case.tables, row_req, positions, SCALE, 32
    )
    tensors = [t.to(DEVICE) for t in (q, case.cache_nan, case.tables, row_req, positions)]
    got = sparse_latent_attention(*tensors, SCALE, 32)
    assert got.dtype == torch.float16 and got.shape == (len(ROWS), 4, 32)
    assert torch.allclose(got.float().cpu(), expected, atol=2e-3, rtol=2e-3)


def test_split_count_by_device():
    config = DSAKernelConfig.for_capability((9, 0))
    bf16 = torch.bfloat16
    # Decode at batch 1 (128 heads, 2048 selected, 132 SMs): split by length, 8 x 256.
    assert config.sparse_splits(1, 128, 2048, 132, bf16) == 8
    # A large batch fills the GPU alone.
    assert config.sparse_splits(256, 128, 2048, 132, bf16) == 1
    assert config.sparse_splits(4, 16, 100, 132, bf16) == 1
