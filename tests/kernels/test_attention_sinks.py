"""Attention sinks (gpt-oss): TorchRefBackend against the definition (each head's sink
logit joins the softmax denominator, with no value, as transformers' eager gpt-oss
attention), then the Triton chunk and split-K decode kernels (through TritonBackend)
against TorchRefBackend, with and without a sliding window, one and several decode
slices (the merge counts the sink once), and over an FP8 cache (the word kernel).

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes in float16 and
float32. Outputs are poisoned (NaN) first: each row must be written.
"""

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

# (cached tokens, query length): prompts, a chunk after a context, decodes.
SHAPES = [(0, 21), (30, 9), (5, 3), (45, 1), (0, 1), (70, 1)]


def make_sinks(num_heads: int, seed: int) -> torch.Tensor:
    """Logits of the scores' size and above it (a sink that dominates some heads)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_heads, generator=gen) * 2.0 + 1.0).to(DEVICE)


def dense_reference(case: Case, scale: float, window, sinks) -> torch.Tensor:
    """The definition, one query row at a time, in float64."""
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    group = case.q.shape[1] // case.k.shape[1]
    qsl = case.md.query_start_loc_cpu.tolist()
    sink = sinks.double().cpu()[:, None]
    for i, (ctx, qlen) in enumerate(case.shapes):
        k, v = gather_context(case.cache_ref, case.md.block_tables[i], ctx + qlen)
        k = k.double().cpu().repeat_interleave(group, dim=1)
        v = v.double().cpu().repeat_interleave(group, dim=1)
        for j in range(qlen):
            pos = ctx + j
            lo = 0 if window is None else max(0, pos - window + 1)
            q = case.q[qsl[i] + j].double().cpu()
            scores = torch.einsum("hd,khd->hk", q, k[lo : pos + 1]) * scale
            probs = torch.cat((scores, sink), dim=-1).softmax(-1)[:, :-1]
            out[qsl[i] + j] = torch.einsum("hk,khd->hd", probs, v[lo : pos + 1])
    return out


@pytest.mark.parametrize("batched_decode", [True, False])
@pytest.mark.parametrize("window", [None, 6])
def test_torch_ref_sinks_match_definition(window, batched_decode):
    case = Case(SHAPES, 4, 2, 16, 8, torch.float32, seed=11)
    sinks = make_sinks(4, 1)
    backend = TorchRefBackend(4, 2, 16, 0.25, batched_decode=batched_decode)
    out = store_and_attend(
        backend,
        case.pool_ref,
        0,
        case.q,
        case.k,
        case.v,
        case.md,
        sliding_window=window,
        sinks=sinks,
    )
    expected = dense_reference(case, 0.25, window, sinks)
    torch.testing.assert_close(out.double().cpu(), expected, atol=1e-5, rtol=1e-5)
    plain = backend.forward(
        case.q, case.pool_ref.cache(0), backend.build_metadata(case.md), sliding_window=window
    )
    assert (plain.float() - out.float()).abs().max() > 0.05  # the sinks mattered


def run_both(case: Case, backend: TritonBackend, window, sinks, tol: float) -> None:
    ref_backend = TorchRefBackend(
        backend.num_heads, backend.num_kv_heads, backend.head_dim, backend.scale
    )
    kw = dict(sliding_window=window, sinks=sinks)
    ref = store_and_attend(ref_backend, case.pool_ref, 0, case.q, case.k, case.v, case.md, **kw)
    out = torch.full_like(case.q, float("nan"))
    store_and_attend(backend, case.pool_tri, 0, case.q, case.k, case.v, case.md, out=out, **kw)
    if ON_GPU:
        torch.cuda.synchronize()
    assert not out.isnan().any(), "an output row was not written"
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "dtype,num_heads,num_kv_heads,splits,window",
    [
        (torch.float32, 4, 2, 1, None),  # one slice: the decode kernel adds the sink
        (torch.float32, 2, 2, 3, None),  # split-K: the merge adds it once
        (torch.float16, 8, 2, None, 20),  # GQA 4, automatic slices, a window
        (torch.float32, 4, 1, 4, 7),  # slices split the window
    ],
)
def test_triton_sinks_match_reference(dtype, num_heads, num_kv_heads, splits, window):
    case = Case(SHAPES, num_heads, num_kv_heads, 32, 16, dtype, pad_rows=2, seed=12)
    backend = TritonBackend(num_heads, num_kv_heads, 32, 1 / 6, num_decode_splits=splits)
    sinks = make_sinks(num_heads, 2)
    run_both(case, backend, window, sinks, 1e-5 if dtype == torch.float32 else 3e-3)


def test_triton_sinks_over_an_fp8_cache():
    """The word kernel (16-bit queries, FP8 cache): one slice and several."""
    case = Case([(40, 1), (13, 1), (20, 6)], 4, 1, 64, 16, torch.float16, seed=13)
    scales = torch.tensor([0.05, 0.04], device=DEVICE)
    cache = torch.stack([(case.cache_ref[0] / scales[0]), (case.cache_ref[1] / scales[1])]).to(
        torch.float8_e4m3fn
    )
    sinks = make_sinks(4, 3)
    ref = TorchRefBackend(4, 1, 64, 1 / 8)
    expected = ref.forward(
        case.q, cache, ref.build_metadata(case.md), kv_scales=scales, sinks=sinks
    )
    for splits in (1, 3):
        tri = TritonBackend(4, 1, 64, 1 / 8, num_decode_splits=splits)
        out = tri.forward(case.q, cache, tri.build_metadata(case.md), kv_scales=scales, sinks=sinks)
        # The word kernel rounds the queries to e4m3: FP8 query error, not sink error.
        torch.testing.assert_close(out.float(), expected.float(), atol=0.05, rtol=0.05)


def test_backends_refuse_bad_sinks():
    case = Case([(0, 2)], 2, 1, 16, 8, torch.float32, seed=14)
    ref = TorchRefBackend(2, 1, 16, 0.25)
    for bad in (torch.zeros(3, device=DEVICE), torch.zeros(2, device=DEVICE).half()):
        with pytest.raises(ValueError, match="sinks"):
            store_and_attend(ref, case.pool_ref, 0, case.q, case.k, case.v, case.md, sinks=bad)
        tri = TritonBackend(2, 1, 16, 0.25)
        with pytest.raises(ValueError, match="sinks"):
            tri.forward(case.q, case.pool_ref.cache(0), tri.build_metadata(case.md), sinks=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 128])
def test_gpu_bf16_gpt_oss_shape(window):
    """bfloat16 at gpt-oss's attention shape (64 heads over 8 KV heads of 64, window
    128 on the sliding layers): prefill chunks and decodes of contexts up to 5k tokens,
    automatic decode slices."""
    shapes = [(0, 1000), (2000, 300), (5000, 1), (90, 1), (3000, 1)]
    case = Case(shapes, 64, 8, 64, 16, torch.bfloat16, seed=15)
    run_both(case, TritonBackend(64, 8, 64, 0.125), window, make_sinks(64, 4), 2e-2)
