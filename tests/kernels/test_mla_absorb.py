"""The MLA absorbed-query kernel (pagoda.kernels.attention.mla_absorb) against its torch reference
(pagoda.model.layers.mla.absorbed_query's bmm + rotary + cat), under TRITON_INTERPRET=1
without CUDA, on the strided views the layer passes: q_nope / q_rope slices of the q
projection's output, W_UK a slice of kv_b_proj's weight. Shapes leave partial blocks
(kv_lora_rank not a multiple of BLOCK_R, qk_nope not one of BLOCK_D)."""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
from helpers.interpreted_kernels import kernel_modules  # noqa: E402

from pagoda.model.layers import mla as mla_layer  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture(scope="module")
def ab():
    return kernel_modules("attention.mla_absorb")[0]


def _case(tokens, heads, nope, rope, rank, v, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads * (nope + rope), generator=gen).to(dtype).to(DEVICE)
    q_nope, q_rope = q.view(tokens, heads, nope + rope).split([nope, rope], dim=-1)
    kv_b = (torch.randn(heads * (nope + v), rank, generator=gen) * rank**-0.5).to(dtype)
    w_uk = kv_b.to(DEVICE).view(heads, nope + v, rank)[:, :nope]
    angles = torch.rand(tokens, rope // 2, generator=gen) * 6.0
    return q_nope, q_rope, w_uk, angles.cos().to(DEVICE), angles.sin().to(DEVICE)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize(
    "tokens,heads,nope,rope,rank,v",
    [
        (1, 2, 16, 8, 40, 16),
        (3, 3, 48, 16, 72, 8),
    ],
)
def test_absorb_q_matches_torch_path(ab, dtype, tol, tokens, heads, nope, rope, rank, v):
    args = _case(tokens, heads, nope, rope, rank, v, dtype, seed=tokens)
    got = ab.absorb_q(*args)
    q_nope, q_rope, w_uk, cos, sin = args
    q_lat = torch.bmm(q_nope.transpose(0, 1).float(), w_uk.float()).transpose(0, 1)
    want = torch.cat((q_lat.to(dtype), mla_layer.apply_rotary(q_rope, cos, sin)), dim=-1)
    assert got.shape == (tokens, heads, rank + rope) and got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_absorb_q_refuses_mismatched_shapes(ab):
    q_nope, q_rope, w_uk, cos, sin = _case(2, 2, 16, 8, 40, 16, torch.float32)
    with pytest.raises(ValueError, match="disagree"):
        ab.absorb_q(q_nope, q_rope, w_uk[:1], cos, sin)
    with pytest.raises(ValueError, match="cos / sin"):
        ab.absorb_q(q_nope, q_rope, w_uk, cos[:, :2], sin[:, :2])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("tokens,heads,rank,nope,v", [(1, 2, 40, 16, 16), (3, 3, 72, 8, 24)])
def test_project_v_matches_bmm(ab, dtype, tol, tokens, heads, rank, nope, v):
    """W_UV is the strided slice of kv_b_proj's weight the layer passes; v is not a
    multiple of BLOCK_V in the second case; the result is contiguous."""
    gen = torch.Generator().manual_seed(tokens)
    kv_b = (torch.randn(heads * (nope + v), rank, generator=gen) * rank**-0.5).to(dtype)
    w_uv = kv_b.to(DEVICE).view(heads, nope + v, rank)[:, nope:]
    o_lat = torch.randn(tokens, heads, rank, generator=gen).to(dtype).to(DEVICE)
    got = ab.project_v(o_lat, w_uv)
    want = torch.bmm(o_lat.transpose(0, 1).float(), w_uv.transpose(1, 2).float())
    assert got.shape == (tokens, heads, v) and got.is_contiguous() and got.dtype == dtype
    torch.testing.assert_close(got, want.transpose(0, 1).to(dtype), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="disagree"):
        ab.project_v(o_lat, w_uv[:1])
