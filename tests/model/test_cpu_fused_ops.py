"""The CPU decode path's shorter forms of small ops give the same bits as their references.

- RMSNorm on float32 CPU tensors calls torch.rms_norm; it must equal the HF-order reference
  (`_normalize_reference`) exactly, with and without the residual add.
- Rotary through full-width tables (rotary_tables + apply_rotary_tables, what the Llama
  model uses on the CPU) must equal apply_rotary exactly.
- The decode plan drops the padding mask when no slot has positions past its context;
  attention then equals the per-layer reference as before.
"""

import math

import pytest
import torch
from helpers.decode_steps import BLOCK, HEAD_DIM, LAYERS, make_step, run_layers, tables_for
from helpers.kv_pool_helpers import pool_holding

from pagoda.attention.torch_ref import TorchRefBackend
from pagoda.model.layers.layernorm import RMSNorm
from pagoda.model.layers.rotary import (
    RotaryEmbedding,
    apply_rotary,
    apply_rotary_tables,
    rotary_tables,
)


@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 64), (32, 576), (5, 4096)])
def test_rmsnorm_cpu_float32_matches_reference_bits(rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    norm = RMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden, generator=gen)
    x = torch.randn(rows, hidden, generator=gen) * 4
    residual = torch.randn(rows, hidden, generator=gen)
    assert torch.equal(norm(x), norm._normalize_reference(x))
    got, summed = norm(x, residual)
    assert torch.equal(summed, x + residual)
    assert torch.equal(got, norm._normalize_reference(x + residual))
    heads = x.view(rows, -1, 16) if hidden % 16 == 0 else None  # Qwen3's per-head q/k norm
    if heads is not None:
        head_norm = RMSNorm(16, eps=1e-6)
        head_norm.weight.data = torch.randn(16, generator=gen)
        assert torch.equal(head_norm(heads), head_norm._normalize_reference(heads))


def test_rmsnorm_bfloat16_keeps_the_reference_path():
    norm = RMSNorm(64).to(torch.bfloat16)
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(norm(x), norm._normalize_reference(x))


@pytest.mark.parametrize("tokens,heads", [(1, 12), (5, 3), (33, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_tables_match_apply_rotary_bits(tokens, heads, dtype):
    gen = torch.Generator().manual_seed(tokens * 100 + heads)
    rope = RotaryEmbedding(
        64,
        4096,
        10000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    )
    cos, sin = rope(torch.randint(0, 4096, (tokens,), generator=gen))
    x = (torch.randn(tokens, heads, 64, generator=gen) * 3).to(dtype)
    cos_full, sin_signed = rotary_tables(cos, sin)
    assert cos_full.shape == sin_signed.shape == (tokens, 1, 64)
    got = apply_rotary_tables(x, cos_full, sin_signed)
    assert got.dtype == dtype
    assert torch.equal(got, apply_rotary(x, cos, sin))


def test_rotary_tables_on_a_strided_view_of_qkv():
    """The Llama model rotates q and k heads together as a view of the qkv rows."""
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(4, (6 + 2 + 2) * 32, generator=gen)
    heads = qkv[:, : 8 * 32].view(4, 8, 32)
    cos, sin = RotaryEmbedding(32, 64, 500.0)(torch.tensor([0, 3, 9, 63]))
    assert torch.equal(
        apply_rotary_tables(heads, *rotary_tables(cos, sin)), apply_rotary(heads, cos, sin)
    )


@pytest.mark.parametrize("lengths,masked", [([6, 6, 6], False), ([6, 3, 6], True)])
def test_decode_plan_masks_only_when_a_slot_is_short(lengths, masked):
    gen = torch.Generator().manual_seed(len(lengths) + masked)
    scale = 1 / math.sqrt(HEAD_DIM)
    fast = TorchRefBackend(4, 2, HEAD_DIM, scale)
    ref = TorchRefBackend(4, 2, HEAD_DIM, scale, batched_decode=False)
    initial = [torch.randn(2, 32, BLOCK, 2, HEAD_DIM, generator=gen) for _ in range(LAYERS)]
    pool, ref_pool = pool_holding(initial), pool_holding(initial)
    shapes = [(n - 1, 1) for n in lengths]
    tables = tables_for([(n + 1, 1) for n in lengths], list(range(32)))
    for step in range(2):  # the second step carries the workspace
        md, qkv = make_step(gen, [(c + step, 1) for c, _ in shapes], 4, 2, tables, 0)
        # q as the model hands it over: a column slice of wider rows (not contiguous).
        qkv = [(torch.cat((q, k), dim=1)[:, :4], k, v) for q, k, v in qkv]
        got, plan = run_layers(fast, md, qkv, pool)
        want, _ = run_layers(ref, md, qkv, ref_pool)
        assert (plan.decode.padding is not None) == masked
        for layer in range(LAYERS):
            torch.testing.assert_close(got[layer], want[layer], atol=1e-6, rtol=1e-6)
