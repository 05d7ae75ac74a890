"""Sliding-window attention: the Triton chunk and split-K decode kernels (through
TritonBackend) against TorchRefBackend, and TorchRefBackend against the definition
(a query at position p sees keys p - W + 1 .. p, as transformers' sliding-window mask).

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes in float16 and
float32; windows are shorter than the contexts, so key tiles left of a window are
skipped, straddling tiles masked, and decode slices split the window only. Every run
poisons the output and the unused cache slots (NaN): each output row must be written
and no unused slot read.
"""

import math
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
from helpers.interpreted_kernels import kernel_modules  # noqa: E402
from helpers.kv_pool_helpers import store_and_attend  # noqa: E402
from helpers.paged_attention_case import Case  # noqa: E402

from pagoda.attention.metadata import build_attention_metadata  # noqa: E402
from pagoda.attention.torch_ref import TorchRefBackend, gather_context  # noqa: E402
from pagoda.attention.triton_backend import TritonBackend  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"

kernel_modules(
    "attention.store_kv",
    "attention.paged_attention",
    "attention.fp8_decode_words",
    "attention.paged_decode_slices",
    "attention.paged_decode_words",
    "attention.paged_decode",
)

# (cached tokens, query length): fresh prompts longer than the window, chunks after a
# context that crosses it, a short chunk, and decodes before and past the window.
SHAPES = [(0, 45), (70, 40), (5, 3), (45, 1), (0, 1), (130, 1), (9, 1)]


def dense_reference(case: Case, scale: float, window: int | None) -> torch.Tensor:
    """The definition, one request and one query row at a time, in float64."""
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    num_heads, num_kv_heads = case.q.shape[1], case.k.shape[1]
    group = num_heads // num_kv_heads
    qsl = case.md.query_start_loc_cpu.tolist()
    for i, (ctx, qlen) in enumerate(case.shapes):
        k, v = gather_context(case.cache_ref, case.md.block_tables[i], ctx + qlen)
        k = k.double().cpu().repeat_interleave(group, dim=1)
        v = v.double().cpu().repeat_interleave(group, dim=1)
        for j in range(qlen):
            pos = ctx + j
            lo = 0 if window is None else max(0, pos - window + 1)
            q = case.q[qsl[i] + j].double().cpu()  # [H, D]
            scores = torch.einsum("hd,khd->hk", q, k[lo : pos + 1]) * scale
            out[qsl[i] + j] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[lo : pos + 1])
    return out


@pytest.mark.parametrize("batched_decode", [True, False])
@pytest.mark.parametrize("window", [1, 7, 32])
def test_torch_ref_window_matches_definition(window, batched_decode):
    case = Case(SHAPES, 4, 2, 16, 8, torch.float32, seed=4)
    backend = TorchRefBackend(4, 2, 16, 0.25, batched_decode=batched_decode)
    out = store_and_attend(
        backend, case.pool_ref, 0, case.q, case.k, case.v, case.md, sliding_window=window
    )
    expected = dense_reference(case, 0.25, window)
    torch.testing.assert_close(out.double().cpu(), expected, atol=1e-5, rtol=1e-5)


def test_window_longer_than_every_context_is_full_attention():
    case = Case(SHAPES, 4, 2, 16, 8, torch.float32, seed=5)
    backend = TorchRefBackend(4, 2, 16, 0.25)
    full = store_and_attend(backend, case.pool_ref, 0, case.q, case.k, case.v, case.md)
    plan = backend.build_metadata(case.md)
    wide = backend.forward(case.q, case.pool_ref.cache(0), plan, sliding_window=1000)
    torch.testing.assert_close(wide, full, atol=1e-6, rtol=1e-6)


def run_both(case: Case, backend: TritonBackend, window: int, tol: float) -> None:
    ref_backend = TorchRefBackend(
        backend.num_heads, backend.num_kv_heads, backend.head_dim, backend.scale
    )
    ref = store_and_attend(
        ref_backend, case.pool_ref, 0, case.q, case.k, case.v, case.md, sliding_window=window
    )
    out = torch.full_like(case.q, float("nan"))
    store_and_attend(
        backend, case.pool_tri, 0, case.q, case.k, case.v, case.md, out=out, sliding_window=window
    )
    if ON_GPU:
        torch.cuda.synchronize()
    assert not out.isnan().any(), "an output row was not written"
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    assert torch.equal(case.cache_tri[:, case.used], case.cache_ref[:, case.used])
    full = ref_backend.forward(case.q, case.pool_ref.cache(0), ref_backend.build_metadata(case.md))
    assert (full.float() - ref.float()).abs().max() > 0.05  # the window mattered


@pytest.mark.parametrize(
    "dtype,num_heads,num_kv_heads,block_size,splits,window",
    [
        (torch.float16, 8, 2, 16, None, 20),  # GQA 4, windows cross key tiles (64 keys)
        (torch.float32, 2, 2, 8, 3, 37),  # decode slices split the window
        (torch.float32, 4, 1, 16, 4, 1),  # a window of one key: the query's own
        (torch.float16, 4, 2, 16, 2, 64),  # window one key tile wide
    ],
)
def test_triton_window_matches_reference(
    dtype, num_heads, num_kv_heads, block_size, splits, window
):
    case = Case(SHAPES, num_heads, num_kv_heads, 64, block_size, dtype, pad_rows=2, seed=6)
    backend = TritonBackend(num_heads, num_kv_heads, 64, 1 / 8, num_decode_splits=splits)
    run_both(case, backend, window, 1e-5 if dtype == torch.float32 else 3e-3)


@pytest.mark.parametrize("window", [24, 100])
def test_triton_long_chunk_skips_tiles_left_of_the_window(window):
    """A 150-row prompt chunk after 200 cached tokens: most key tiles of a query tile
    lie left of its window and are skipped. Small query tiles (float32: 16 rows at GQA
    4, 32-key tiles) make every kind of tile appear: skipped, straddling a window start
    (masked), inside every row's window (unmasked: window 100 only) and causal edge."""
    case = Case([(200, 150), (3, 1), (260, 1)], 8, 2, 64, 16, torch.float32, seed=7)
    backend = TritonBackend(8, 2, 64, 1 / 8, num_decode_splits=5)
    run_both(case, backend, window, 1e-5)


def test_triton_window_over_an_fp8_cache():
    """The word kernel (16-bit queries, FP8 cache) and the chunk kernel split only the
    window too."""
    case = Case([(90, 1), (33, 1), (50, 12)], 4, 1, 64, 16, torch.float16, seed=8)
    scales = torch.tensor([0.05, 0.04], device=DEVICE)
    cache = torch.stack([(case.cache_ref[0] / scales[0]), (case.cache_ref[1] / scales[1])]).to(
        torch.float8_e4m3fn
    )
    ref = TorchRefBackend(4, 1, 64, 1 / 8)
    tri = TritonBackend(4, 1, 64, 1 / 8, num_decode_splits=3)
    expected = ref.forward(
        case.q, cache, ref.build_metadata(case.md), kv_scales=scales, sliding_window=30
    )
    out = tri.forward(
        case.q, cache, tri.build_metadata(case.md), kv_scales=scales, sliding_window=30
    )
    # The word kernel rounds the queries to e4m3: FP8 query error, not window error.
    torch.testing.assert_close(out.float(), expected.float(), atol=0.05, rtol=0.05)
    full = ref.forward(case.q, cache, ref.build_metadata(case.md), kv_scales=scales)
    assert (full.float() - expected.float()).abs().max() > 0.1  # the window mattered


def test_kernels_refuse_a_bad_window():
    from pagoda.kernels.attention.paged_decode import paged_attention_decode

    md = build_attention_metadata([1], [3], [[0]], 16, DEVICE)
    q = torch.zeros(1, 2, 16, device=DEVICE)
    cache = torch.zeros(2, 1, 16, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention_decode(
            q.clone(), q, cache, md.block_tables, md.query_start_loc, md.seq_lens, 1,
            1 / math.sqrt(16), 1, sliding_window=0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="sliding_window"):
        TorchRefBackend(2, 1, 16, 0.25).forward(
            q, cache, TorchRefBackend(2, 1, 16, 0.25).build_metadata(md), sliding_window=-1
        )


@pytest.mark.gpu
@pytest.mark.parametrize("window", [1024, 4096])
def test_gpu_bf16_long_contexts(window):
    """bfloat16 at Gemma 3's window and head size: prefill chunks and decodes of contexts
    up to 9k tokens, automatic decode slices."""
    shapes = [(0, 2000), (3000, 517), (9000, 1), (700, 1), (5000, 1)]
    case = Case(shapes, 16, 8, 128, 16, torch.bfloat16, seed=9)
    run_both(case, TritonBackend(16, 8, 128, 168**-0.5), window, 2e-2)
