"""The gated delta rule and the causal conv1d of hybrid linear-attention layers
(pagoda/kernels/linear_attention/): the torch references against transformers' own
functions (Qwen3-Next GatedDeltaNet, Kimi Delta Attention), the chunked form against the
recurrent one, a state carried across calls against one call over the concatenation,
and the Triton kernels (decode step, chunked prefill, conv1d prefill and update) against
the references over a slot pool.

Without CUDA the kernels run under TRITON_INTERPRET=1 (set before Triton is imported, by
conftest or here) on small shapes in float32 and float16: H 2, Dk 16, Dv 32, sequences
of 0 to 70 tokens concatenated, chunk boundaries inside them.
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

from pagoda.kernels.linear_attention import reference as ref  # noqa: E402
from pagoda.kernels.linear_attention.config import (  # noqa: E402
    ConvTiles,
    DecodeTiles,
    PrefillTiles,
)

DEVICE = "cuda" if ON_GPU else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3)}
STATE_TOL = dict(atol=2e-4, rtol=2e-4)
DK, DV = 16, 32
# An empty sequence, one of a single token, one crossing a chunk of 64 (two of 16).
LENS = [5, 0, 70, 1]
# The pool slot of each sequence; -1 marks a padding row.
SLOTS = [4, 0, 2, 6]
# Chunks of 16 (boundaries inside the 70-token sequence) and two value tiles of 16.
SMALL_PREFILL = PrefillTiles(chunk=16, block_v=16, num_warps=4)
SMALL_CONV = ConvTiles(block_t=16, block_c=32, num_warps=4)


@pytest.fixture(scope="module")
def dr():
    return kernel_modules("linear_attention.delta_rule")[0]


@pytest.fixture(scope="module")
def conv():
    return kernel_modules("linear_attention.conv1d")[0]


def cu_of(lens) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def inputs(total, num_k_heads=1, num_v_heads=2, per_channel=False, seed=0, decay=0.5):
    """q, k, v, g, beta (float32, on the CPU) for `total` tokens."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total, num_k_heads, DK, generator=gen)
    k = torch.randn(total, num_k_heads, DK, generator=gen)
    v = torch.randn(total, num_v_heads, DV, generator=gen)
    g_shape = (total, num_v_heads, DK) if per_channel else (total, num_v_heads)
    g = -torch.rand(g_shape, generator=gen) * decay
    beta = torch.rand(total, num_v_heads, generator=gen)
    return q, k, v, g, beta


def initial_states(num_seqs, heads=2, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_seqs, heads, DK, DV, generator=gen) * 0.5


def pool_with(states, slots, num_slots=8):
    """A slot pool holding states[n] at slots[n] (the rest NaN-free noise)."""
    pool = torch.randn(num_slots, *states.shape[1:], generator=torch.Generator().manual_seed(9))
    live = [n for n, s in enumerate(slots) if s >= 0]
    pool[torch.tensor([slots[n] for n in live])] = states[live]
    return pool.to(DEVICE), torch.tensor(slots, dtype=torch.int32, device=DEVICE)


def on_device(*xs, dtype=None):
    return [x.to(DEVICE) if dtype is None else x.to(DEVICE, dtype) for x in xs]


# -- the references against transformers -------------------------------------------


@pytest.mark.parametrize("l2", [False, True])
def test_reference_matches_qwen3_next(l2):
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta = inputs(45, num_k_heads=1, num_v_heads=2)
    if not l2:  # keys of norm ~1 keep the un-normalised delta rule contractive
        q, k = q * DK**-0.5, k * DK**-0.5
    s0 = initial_states(1)
    args = [x.unsqueeze(0) for x in (q, k, v, g, beta)]
    hf_kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    o_rec, s_rec = hf.torch_recurrent_gated_delta_rule(*args, **hf_kw)
    o_chk, s_chk = hf.torch_chunk_gated_delta_rule(*args, chunk_size=16, **hf_kw)
    for fn in (ref.gated_delta_rule_recurrent, ref.gated_delta_rule_chunked):
        o, s = fn(q, k, v, g, beta, s0, use_qk_l2norm=l2)
        torch.testing.assert_close(o, o_rec[0], **TOL[torch.float32])
        torch.testing.assert_close(o, o_chk[0], **TOL[torch.float32])
        torch.testing.assert_close(s, s_rec, **STATE_TOL)
        torch.testing.assert_close(s, s_chk, **STATE_TOL)


def test_reference_matches_kimi_delta_attention():
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    q, k, v, g, beta = inputs(45, num_k_heads=2, num_v_heads=2, per_channel=True)
    s0 = initial_states(1)
    args = [x.unsqueeze(0) for x in (q, k, v, g, beta)]
    hf_kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_rec, s_rec = hf.recurrent_kimi_delta_attention(*args, **hf_kw)
    o_chk, s_chk = hf.chunk_kimi_delta_attention(*args, chunk_size=16, **hf_kw)
    for fn in (ref.gated_delta_rule_recurrent, ref.gated_delta_rule_chunked):
        o, s = fn(q, k, v, g, beta, s0, use_qk_l2norm=True)
        torch.testing.assert_close(o, o_rec[0], **TOL[torch.float32])
        torch.testing.assert_close(o, o_chk[0], **TOL[torch.float32])
        torch.testing.assert_close(s, s_rec, **STATE_TOL)
        torch.testing.assert_close(s, s_chk, **STATE_TOL)


def test_conv_reference_matches_transformers():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    gen = torch.Generator().manual_seed(3)
    channels, width = 24, 4
    x = torch.randn(9, channels, generator=gen)
    weight, bias = torch.randn(channels, width, generator=gen), torch.randn(channels, generator=gen)
    out, state = ref.causal_conv1d(x, weight, bias, activation="silu")
    expected = hf.causal_conv1d_fn(x.t().unsqueeze(0), weight, bias, activation="silu")
    torch.testing.assert_close(out, expected[0].t(), **TOL[torch.float32])
    torch.testing.assert_close(state[0], x[-(width - 1) :])
    hf_state = state.transpose(1, 2).contiguous()  # transformers keeps [N, C, K-1]
    token = torch.randn(1, channels, generator=gen)
    out, state = ref.causal_conv1d_update(token, state, weight, bias, "silu")
    expected = hf.causal_conv1d_update(token.unsqueeze(-1), hf_state, weight, bias, "silu")
    torch.testing.assert_close(out, expected[..., 0], **TOL[torch.float32])
    torch.testing.assert_close(state, hf_state.transpose(1, 2))


# -- the references among themselves ------------------------------------------------


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_equals_recurrent(per_channel, chunk):
    cu = cu_of(LENS)
    q, k, v, g, beta = inputs(int(cu[-1]), per_channel=per_channel)
    s0 = initial_states(len(LENS))
    o_rec, s_rec = ref.gated_delta_rule_recurrent(q, k, v, g, beta, s0, cu, use_qk_l2norm=True)
    o_chk, s_chk = ref.gated_delta_rule_chunked(
        q, k, v, g, beta, s0, cu, use_qk_l2norm=True, chunk=chunk
    )
    torch.testing.assert_close(o_chk, o_rec, **TOL[torch.float32])
    torch.testing.assert_close(s_chk, s_rec, **STATE_TOL)
    torch.testing.assert_close(s_rec[1], s0[1])  # the empty sequence keeps its state


def test_reference_state_carries_across_calls():
    q, k, v, g, beta = inputs(70, num_k_heads=2, num_v_heads=2, per_channel=True)
    whole_o, whole_s = ref.gated_delta_rule_chunked(q, k, v, g, beta, chunk=16)
    first_o, state = ref.gated_delta_rule_chunked(*(x[:23] for x in (q, k, v, g, beta)), chunk=16)
    second_o, state = ref.gated_delta_rule_chunked(
        *(x[23:] for x in (q, k, v, g, beta)), initial_state=state, chunk=16
    )
    torch.testing.assert_close(torch.cat([first_o, second_o]), whole_o, **TOL[torch.float32])
    torch.testing.assert_close(state, whole_s, **STATE_TOL)


# -- the Triton delta-rule kernels --------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("per_channel", [False, True])
def test_prefill_kernel(dr, dtype, per_channel):
    cu = cu_of(LENS)
    heads = (2, 2) if per_channel else (1, 2)  # the scalar gate with two value heads per key head
    q, k, v, g, beta = inputs(int(cu[-1]), *heads, per_channel=per_channel)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    s0 = initial_states(len(LENS))
    o_ref, s_ref = ref.gated_delta_rule_recurrent(q, k, v, g, beta, s0, cu, use_qk_l2norm=True)
    pool, slots = pool_with(s0, SLOTS)
    untouched = pool[[1, 3, 5, 7]].clone()
    o = dr.gated_delta_rule_prefill(
        *on_device(q, k, v, g, beta),
        pool,
        slots,
        cu.to(DEVICE),
        use_qk_l2norm=True,
        tiles=SMALL_PREFILL,
    )
    torch.testing.assert_close(o.cpu().float(), o_ref.float(), **TOL[dtype])
    torch.testing.assert_close(pool[slots.long()].cpu(), s_ref, **STATE_TOL)
    assert torch.equal(pool[[1, 3, 5, 7]], untouched)


def test_prefill_kernel_chunk_64_and_padding_row(dr):
    lens = [70, 3]
    cu = cu_of(lens)
    q, k, v, g, beta = inputs(int(cu[-1]), 1, 2)
    s0 = initial_states(2)
    o_ref, s_ref = ref.gated_delta_rule_chunked(q, k, v, g, beta, s0, cu, use_qk_l2norm=True)
    pool, slots = pool_with(s0, [3, -1])
    before = pool.clone()
    tiles = PrefillTiles(chunk=64, block_v=32, num_warps=4)
    o = dr.gated_delta_rule_prefill(
        *on_device(q, k, v, g, beta), pool, slots, cu.to(DEVICE), use_qk_l2norm=True, tiles=tiles
    )
    torch.testing.assert_close(o[:70].cpu(), o_ref[:70], **TOL[torch.float32])
    torch.testing.assert_close(pool[3].cpu(), s_ref[0], **STATE_TOL)
    pool[3] = before[3]
    assert torch.equal(pool, before)  # the padding row wrote nothing


def test_prefill_kernel_strong_per_channel_decay(dr):
    """Log decays of -8 a token on average: a chunk of 32 spans exp(-256), past float32's
    range, so the kernel must never form exp(-G) on its own."""
    cu = cu_of([40])
    q, k, v, g, beta = inputs(40, 2, 2, per_channel=True, decay=16.0)
    s0 = initial_states(1)
    o_ref, s_ref = ref.gated_delta_rule_recurrent(q, k, v, g, beta, s0, cu, use_qk_l2norm=True)
    pool, slots = pool_with(s0, [0])
    o = dr.gated_delta_rule_prefill(
        *on_device(q, k, v, g, beta), pool, slots, cu.to(DEVICE), use_qk_l2norm=True,
        tiles=PrefillTiles(chunk=32, block_v=16, num_warps=4),
    )  # fmt: skip
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o.cpu(), o_ref, **TOL[torch.float32])
    torch.testing.assert_close(pool[0].cpu(), s_ref[0], **STATE_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("per_channel", [False, True])
def test_decode_kernel_one_token(dr, dtype, per_channel):
    heads = (2, 2) if per_channel else (1, 2)
    q, k, v, g, beta = inputs(4, *heads, per_channel=per_channel, seed=5)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    s0 = initial_states(4)
    slots = [4, 0, -1, 6]
    pool, slot_t = pool_with(s0, slots)
    before = pool.clone()
    tiles = DecodeTiles(block_v=16, num_warps=4)  # two value tiles
    o = dr.gated_delta_rule_decode(
        *on_device(q, k, v, g, beta), pool, slot_t, use_qk_l2norm=True, tiles=tiles
    )
    o_ref, s_ref = ref.gated_delta_rule_recurrent(
        q, k, v, g, beta, s0, cu_of([1, 1, 1, 1]), use_qk_l2norm=True
    )
    live = [0, 1, 3]
    torch.testing.assert_close(o[live].cpu().float(), o_ref[live].float(), **TOL[dtype])
    torch.testing.assert_close(pool[[4, 0, 6]].cpu(), s_ref[live], **STATE_TOL)
    assert torch.equal(pool[[1, 2, 3, 5, 7]], before[[1, 2, 3, 5, 7]])


def test_decode_kernel_several_tokens(dr):
    """Draft verification: a few tokens per sequence, one after another in one program,
    the state after each of the first sequence's tokens also written to a slot of its own."""
    lens = [3, 1, 4]
    cu = cu_of(lens)
    q, k, v, g, beta = inputs(8, 2, 2, per_channel=True, seed=6)
    s0 = initial_states(3)
    o_ref, s_ref = ref.gated_delta_rule_recurrent(q, k, v, g, beta, s0, cu, use_qk_l2norm=True)
    pool, slots = pool_with(s0, [1, 5, 2], num_slots=10)
    snapshots = torch.tensor([7, 8, 9, -1, -1, -1, -1, -1], dtype=torch.int32, device=DEVICE)
    before = pool.clone()
    o = dr.gated_delta_rule_decode(
        *on_device(q, k, v, g, beta), pool, slots, cu.to(DEVICE), use_qk_l2norm=True,
        token_state_slots=snapshots,
    )  # fmt: skip
    torch.testing.assert_close(o.cpu(), o_ref, **TOL[torch.float32])
    torch.testing.assert_close(pool[slots.long()].cpu(), s_ref, **STATE_TOL)
    for n in range(3):
        _, prefix_state = ref.gated_delta_rule_recurrent(
            *(x[: n + 1] for x in (q, k, v, g, beta)), s0[:1], use_qk_l2norm=True
        )
        torch.testing.assert_close(pool[7 + n].cpu(), prefix_state[0], **STATE_TOL)
    assert torch.equal(pool[[0, 3, 4, 6]], before[[0, 3, 4, 6]])


@pytest.mark.parametrize("per_channel", [False, True])
def test_state_carried_across_engine_steps(dr, per_channel):
    """A prompt prefilled over two steps (split inside a chunk), then two decode steps,
    through one slot, equals the reference over the whole sequence in one call."""
    total = 45
    q, k, v, g, beta = inputs(total, 2, 2, per_channel=per_channel, seed=7)
    o_ref, s_ref = ref.gated_delta_rule_chunked(q, k, v, g, beta, use_qk_l2norm=True)
    pool = torch.zeros(3, 2, DK, DV, device=DEVICE)
    slot = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    outs = []
    for start, end in ((0, 21), (21, 43)):
        part = on_device(*(x[start:end] for x in (q, k, v, g, beta)))
        cu = cu_of([end - start]).to(DEVICE)
        outs.append(
            dr.gated_delta_rule_prefill(
                *part, pool, slot, cu, use_qk_l2norm=True, tiles=SMALL_PREFILL
            )
        )
    for t in (43, 44):
        part = on_device(*(x[t : t + 1] for x in (q, k, v, g, beta)))
        outs.append(dr.gated_delta_rule_decode(*part, pool, slot, use_qk_l2norm=True))
    torch.testing.assert_close(torch.cat(outs).cpu(), o_ref, **TOL[torch.float32])
    torch.testing.assert_close(pool[1].cpu(), s_ref[0], **STATE_TOL)
    assert not pool[[0, 2]].any()


def test_kernels_reject_bad_shapes(dr):
    q, k, v, g, beta = inputs(4, 1, 2)
    pool, slots = pool_with(initial_states(4), [0, 1, 2, 3])
    with pytest.raises(ValueError, match="state pool"):
        dr.gated_delta_rule_decode(q, k, v, g, beta, pool[:, :1].contiguous(), slots)
    with pytest.raises(ValueError, match="g "):
        dr.gated_delta_rule_decode(q, k, v, g[:, :1], beta, pool, slots)
    with pytest.raises(ValueError, match="chunk"):
        PrefillTiles(chunk=24, block_v=16, num_warps=4)


# -- the Triton conv1d kernels ------------------------------------------------------


def conv_case(total, channels=40, width=4, num_seqs=4, seed=11):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(total, channels, generator=gen)
    weight, bias = torch.randn(channels, width, generator=gen), torch.randn(channels, generator=gen)
    state = torch.randn(num_seqs, width - 1, channels, generator=gen)
    return x, weight, bias, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width", [2, 4])
def test_conv_prefill_kernel(conv, dtype, width):
    lens = [5, 0, 70, 2]
    cu = cu_of(lens)
    x, weight, bias, s0 = conv_case(int(cu[-1]), width=width)
    x = x.to(dtype)
    out_ref, s_ref = ref.causal_conv1d(x, weight, bias, s0, cu, "silu")
    pool, slots = pool_with(s0, SLOTS)
    before = pool.clone()
    out = conv.causal_conv1d_prefill(
        x.to(DEVICE), pool, weight.to(DEVICE), slots, cu.to(DEVICE), bias.to(DEVICE), "silu",
        tiles=SMALL_CONV,
    )  # fmt: skip
    torch.testing.assert_close(out.cpu().float(), out_ref.float(), **TOL[dtype])
    torch.testing.assert_close(pool[slots.long()].cpu(), s_ref)
    assert torch.equal(pool[[1, 3, 5, 7]], before[[1, 3, 5, 7]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_conv_update_kernel(conv, dtype):
    x, weight, bias, s0 = conv_case(4)
    x = x.to(dtype)
    out_ref, s_ref = ref.causal_conv1d_update(x, s0, weight, bias, "silu")
    pool, slots = pool_with(s0, [4, 0, -1, 6])
    before = pool.clone()
    out = conv.causal_conv1d_update(
        x.to(DEVICE), pool, weight.to(DEVICE), slots, bias.to(DEVICE), "silu", SMALL_CONV
    )
    live = [0, 1, 3]
    torch.testing.assert_close(out[live].cpu().float(), out_ref[live].float(), **TOL[dtype])
    torch.testing.assert_close(pool[[4, 0, 6]].cpu(), s_ref[live])
    assert torch.equal(pool[[1, 2, 3, 5, 7]], before[[1, 2, 3, 5, 7]])


def test_conv_state_carried_across_steps(conv):
    """Prefill in two steps (the second shorter than the kernel), then one update, equals
    the reference over the whole sequence."""
    x, weight, bias, _ = conv_case(12, num_seqs=1)
    out_ref, s_ref = ref.causal_conv1d(x, weight, None, None, None, None)
    pool = torch.zeros(2, 3, x.shape[1], device=DEVICE)
    slot = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    w = weight.to(DEVICE)
    outs = []
    for start, end in ((0, 9), (9, 11)):
        cu = cu_of([end - start]).to(DEVICE)
        outs.append(
            conv.causal_conv1d_prefill(x[start:end].to(DEVICE), pool, w, slot, cu, tiles=SMALL_CONV)
        )
    outs.append(conv.causal_conv1d_update(x[11:].to(DEVICE), pool, w, slot))
    torch.testing.assert_close(torch.cat(outs).cpu(), out_ref, **TOL[torch.float32])
    torch.testing.assert_close(pool[1].cpu(), s_ref[0])
    assert not pool[0].any()
