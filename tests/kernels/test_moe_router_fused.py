"""The fused MoE router (pagoda.kernels.moe.router_fused: router linear + routing in one
launch) against its reference, MoEGate's logits routed by select_experts_torch.

Without CUDA the kernel runs under TRITON_INTERPRET=1 on small shapes, float32 and
float16 hidden states: Qwen3-like softmax greedy (gate in the model dtype, logits
rounded to it), DeepSeek-like float32 gates with group_limited_greedy and sigmoid
noaux_tc (bias, groups), T = 1, 3 and MAX_FUSED_TOKENS, default tiles and small tiles
(several hidden steps, several programs per row tile, the last program routing in
several row tiles). Expert ids must be exactly the reference's where a row has no tied
choice values (and the same multiset of choice values where it has); weights agree to
float32 rounding. After a call the arrival counter is back to 0, and a second call
gives the same result (what a CUDA-graph replay relies on).
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

from pagoda.model.layers.moe import routing  # noqa: E402
from pagoda.model.layers.moe.gate import MoEGate  # noqa: E402
from pagoda.model.moe_config import MoEConfig  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def mrf():
    return kernel_modules("moe.routing", "moe.router_fused")[1]


# name -> (MoEConfig, hidden size, float32 gate)
CASES = {
    "qwen3_softmax_norm": (MoEConfig(16, 4, 8, renormalize=True), 64, False),
    "qwen3_softmax_plain": (MoEConfig(16, 4, 8), 64, False),
    "softmax_e24_k5_h80": (MoEConfig(24, 5, 8, renormalize=True), 80, False),
    "v2_group_limited": (
        MoEConfig(
            16,
            3,
            8,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=16.0,
        ),
        48,
        True,
    ),
    "v2_lite_greedy_fp32": (MoEConfig(16, 6, 8), 64, True),
    "v3_noaux_tc": (
        MoEConfig(
            32,
            4,
            8,
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            n_group=4,
            topk_group=2,
            renormalize=True,
            routed_scaling_factor=2.5,
        ),
        64,
        True,
    ),
}


def _gate(num_experts: int, hidden_size: int, fp32: bool, dtype: torch.dtype, seed: int) -> MoEGate:
    gen = torch.Generator().manual_seed(seed)
    gate = MoEGate(hidden_size, num_experts, fp32=fp32)
    weight = torch.randn(num_experts, hidden_size, generator=gen) * 2 / hidden_size**0.5
    gate.weight.data = weight.to(torch.float32 if fp32 else dtype).to(DEVICE)
    return gate


def _inputs(cfg: MoEConfig, hidden_size: int, tokens: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(1000 + seed)
    hidden = torch.randn(tokens, hidden_size, generator=gen).to(dtype).to(DEVICE)
    bias = None
    if cfg.topk_method == "noaux_tc":
        bias = (torch.randn(cfg.num_experts, generator=gen) * 0.1).to(DEVICE)
    return hidden, bias


def _choice(logits: torch.Tensor, cfg: MoEConfig, bias) -> torch.Tensor:
    scores = (
        logits.float().softmax(-1) if cfg.scoring_func == "softmax" else logits.float().sigmoid()
    )
    return scores + bias if bias is not None else scores


def _check(got, want, logits, cfg, bias) -> int:
    """got vs want (weights, ids) for the reference logits; returns the untied rows."""
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.int32
    assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
    choice = _choice(logits, cfg, bias)
    untied = 0
    for row in range(choice.shape[0]):
        gi, wi = got[1][row].long(), want[1][row].long()
        assert len(set(gi.tolist())) == cfg.num_experts_per_tok
        if choice[row].unique().numel() == cfg.num_experts:
            untied += 1
            assert sorted(gi.tolist()) == sorted(wi.tolist()), row
        else:  # tied experts are interchangeable: the same choice values
            assert torch.equal(choice[row][gi].sort().values, choice[row][wi].sort().values)
        torch.testing.assert_close(
            got[0][row].sort().values, want[0][row].sort().values, rtol=2e-6, atol=1e-7
        )
    return untied


def _check_compiled(got, scratch, logits, cfg, bias) -> None:
    """GPU: the kernel sums the gate's dot products in its own order, so its logits (the
    scratch's) may differ from cuBLAS's by one unit in the last place of the logit dtype,
    and a softmax weight by ~1 % then (bf16 logits near 3 are 2^-6 apart). The logits
    are held to that, and the routing is checked exactly on the kernel's own logits."""
    own = scratch.logits[: logits.shape[0]]
    torch.testing.assert_close(own, logits.float(), rtol=torch.finfo(logits.dtype).eps, atol=1e-4)
    own = own.to(logits.dtype)  # exact: the kernel rounds them to that dtype
    _check(got, routing.select_experts_torch(own, cfg, bias), own, cfg, bias)


def _run(mrf, gate, cfg, hidden, bias, tiles=None):
    scratch = mrf.RouterScratch.create(cfg.num_experts, hidden.device)
    got = mrf.fused_route(hidden, gate.weight, cfg, bias, gate.fp32, scratch, tiles)
    return got, scratch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_router_matches_gate_and_select_experts(mrf, name, dtype):
    cfg, hidden_size, fp32 = CASES[name]
    gate = _gate(cfg.num_experts, hidden_size, fp32, dtype, seed=len(name))
    untied = 0
    for tokens in (1, 3, mrf.MAX_FUSED_TOKENS):
        hidden, bias = _inputs(cfg, hidden_size, tokens, dtype, tokens)
        logits = gate(hidden)
        assert logits.dtype == (torch.float32 if fp32 else dtype)
        got, scratch = _run(mrf, gate, cfg, hidden, bias)
        untied += _check(got, routing.select_experts_torch(logits, cfg, bias), logits, cfg, bias)
        # The scratch holds MoEGate's logits (rounded to its dtype) up to summation order.
        torch.testing.assert_close(
            scratch.logits[:tokens],
            logits.float(),
            rtol=2e-3,
            atol=2e-3 if dtype == torch.float16 else 1e-5,
        )
        assert scratch.counter.item() == 0
        again = mrf.fused_route(hidden, gate.weight, cfg, bias, gate.fp32, scratch)
        assert torch.equal(again[0], got[0]) and torch.equal(again[1], got[1])
        assert scratch.counter.item() == 0
    assert untied >= 10  # most rows carry no tie: the ids were compared exactly


@pytest.mark.parametrize("name", ["qwen3_softmax_norm", "softmax_e24_k5_h80", "v3_noaux_tc"])
def test_fused_router_small_tiles(mrf, name):
    """Several hidden steps (a ragged last one), several experts per program (a ragged
    last program), and the last program routing the rows two at a time."""
    cfg, hidden_size, fp32 = CASES[name]
    tiles = mrf.FusedRouterTiles(
        block_x=4 if cfg.num_experts % 4 else 8, block_h=32, route_t=2, num_warps=4
    )
    gate = _gate(cfg.num_experts, hidden_size, fp32, torch.float16, seed=7)
    for tokens in (5, mrf.MAX_FUSED_TOKENS):
        hidden, bias = _inputs(cfg, hidden_size, tokens, torch.float16, 50 + tokens)
        logits = gate(hidden)
        got, scratch = _run(mrf, gate, cfg, hidden, bias, tiles)
        _check(got, routing.select_experts_torch(logits, cfg, bias), logits, cfg, bias)
        assert scratch.counter.item() == 0


def test_fused_router_strided_hidden(mrf):
    cfg, hidden_size, fp32 = CASES["qwen3_softmax_norm"]
    gate = _gate(cfg.num_experts, hidden_size, fp32, torch.float32, seed=3)
    wide, _ = _inputs(cfg, 2 * hidden_size, 4, torch.float32, 3)
    hidden = wide[:, hidden_size:]  # row stride 2 * hidden_size
    logits = gate(hidden)
    got, _ = _run(mrf, gate, cfg, hidden, None)
    _check(got, routing.select_experts_torch(logits, cfg), logits, cfg, None)


def test_fused_router_refuses_what_it_does_not_cover(mrf):
    cfg, hidden_size, fp32 = CASES["qwen3_softmax_norm"]
    gate = _gate(cfg.num_experts, hidden_size, fp32, torch.float32, seed=4)
    scratch = mrf.RouterScratch.create(cfg.num_experts, torch.device(DEVICE))
    too_many = torch.zeros(mrf.MAX_FUSED_TOKENS + 1, hidden_size, device=DEVICE)
    with pytest.raises(ValueError, match="not covered"):
        mrf.fused_route(too_many, gate.weight, cfg, None, False, scratch)
    half = torch.zeros(2, hidden_size, device=DEVICE, dtype=torch.float16)
    assert not mrf.fused_router_covers(half, gate.weight, False)  # float32 weight
    assert mrf.fused_router_covers(half, gate.weight, True)
    other = MoEConfig(8, 2, 8)
    with pytest.raises(ValueError, match="8 experts"):
        mrf.fused_route(half.float(), gate.weight, other, None, False, scratch)


def test_route_on_cpu_is_gate_then_select_experts():
    """route() off CUDA: exactly select_experts on the gate's logits."""
    cfg, hidden_size, fp32 = CASES["v3_noaux_tc"]
    gate = _gate(cfg.num_experts, hidden_size, fp32, torch.float32, seed=5)
    hidden, bias = _inputs(cfg, hidden_size, 3, torch.float32, 5)
    got = routing.route(hidden.cpu(), gate.cpu(), cfg, bias.cpu())
    want = routing.select_experts(gate(hidden.cpu()), cfg, bias.cpu())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="needs an e_score_correction_bias"):
        routing.route(hidden.cpu(), gate.cpu(), cfg, None)


def test_fused_moe_takes_precomputed_topk():
    """FusedMoE.forward(hidden, topk=route(...)) is forward(hidden, router_logits);
    exactly one of the two is accepted."""
    from pagoda.model.layers.moe.fused_moe import FusedMoE
    from pagoda.model.parallel import SINGLE_RANK

    cfg, hidden_size, fp32 = CASES["v2_group_limited"]
    experts = FusedMoE(
        cfg.num_experts, cfg.num_experts_per_tok, hidden_size, 8, cfg, SINGLE_RANK, torch.float32
    )
    gen = torch.Generator().manual_seed(12)
    for param in (experts.w13_weight, experts.w2_weight):
        param.data = torch.randn(param.shape, generator=gen) * 0.2
    gate = _gate(cfg.num_experts, hidden_size, fp32, torch.float32, seed=12).cpu()
    hidden = torch.randn(3, hidden_size, generator=gen)
    want = experts(hidden, gate(hidden))
    assert torch.equal(experts(hidden, topk=routing.route(hidden, gate, cfg)), want)
    for bad in ({}, {"router_logits": gate(hidden), "topk": routing.route(hidden, gate, cfg)}):
        with pytest.raises(ValueError, match="exactly one"):
            experts(hidden, **bad)


@gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_route_dispatches_on_cuda(mrf, name, monkeypatch):
    cfg, hidden_size, fp32 = CASES[name]
    gate = _gate(cfg.num_experts, hidden_size, fp32, torch.bfloat16, seed=6)
    calls = []
    real = mrf.fused_route
    monkeypatch.setattr(mrf, "fused_route", lambda *a: calls.append(1) or real(*a))
    for tokens in (1, 7, routing.FUSED_ROUTER_MAX_TOKENS):
        hidden, bias = _inputs(cfg, hidden_size, tokens, torch.bfloat16, tokens)
        got = routing.route(hidden, gate, cfg, bias)
        _check_compiled(got, gate.router_scratch, gate(hidden), cfg, bias)
    assert len(calls) == 3 and gate.router_scratch.counter.item() == 0
    hidden, bias = _inputs(
        cfg, hidden_size, routing.FUSED_ROUTER_MAX_TOKENS + 1, torch.bfloat16, 99
    )
    routing.route(hidden, gate, cfg, bias)
    assert len(calls) == 3  # above the threshold: the gate's linear + select_experts


@gpu
def test_real_shapes_and_cuda_graph(mrf):
    qwen = MoEConfig(128, 8, 768, renormalize=True)
    v3 = MoEConfig(
        256,
        8,
        2048,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=8,
        topk_group=4,
        renormalize=True,
        routed_scaling_factor=2.5,
    )
    for cfg, fp32, dtype in ((qwen, False, torch.bfloat16), (v3, True, torch.bfloat16)):
        gate = _gate(cfg.num_experts, 2048, fp32, dtype, seed=8)
        for tokens in (1, 8, 16):
            hidden, bias = _inputs(cfg, 2048, tokens, dtype, tokens)
            got, scratch = _run(mrf, gate, cfg, hidden, bias)
            _check_compiled(got, scratch, gate(hidden), cfg, bias)
    gate = _gate(qwen.num_experts, 2048, False, torch.bfloat16, seed=9)
    hidden, _ = _inputs(qwen, 2048, 4, torch.bfloat16, 9)
    routing.route(hidden, gate, qwen)  # scratch and compilation outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = routing.route(hidden, gate, qwen)
    for seed in (10, 11):  # two replays: the counter is back to 0 after each
        fresh, _ = _inputs(qwen, 2048, 4, torch.bfloat16, seed)
        hidden.copy_(fresh)
        graph.replay()
        _check_compiled(out, gate.router_scratch, gate(fresh), qwen, None)
        assert gate.router_scratch.counter.item() == 0
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        routing.route(hidden, gate, qwen)  # the layer's scratch exists: captured
        with pytest.raises(RuntimeError, match="before CUDA-graph capture"):
            mrf.RouterScratch.create(qwen.num_experts, hidden.device)


@pytest.mark.parametrize("name", ["qwen3_softmax_norm", "softmax_e24_k5_h80", "v3_noaux_tc"])
def test_fused_router_preloaded_weights(mrf, name):
    """One token, each program's expert row loaded in one chunk before the PDL wait (the
    hidden size 80 padded to 128): the same routing as the reference, counter back at 0."""
    cfg, hidden_size, fp32 = CASES[name]
    tiles = mrf.default_tiles(1, cfg.num_experts, hidden_size, cfg)
    assert tiles.block_h >= hidden_size
    gate = _gate(cfg.num_experts, hidden_size, fp32, torch.float32, seed=11)
    hidden, bias = _inputs(cfg, hidden_size, 1, torch.float32, 21)
    logits = gate(hidden)
    got, scratch = _run(mrf, gate, cfg, hidden, bias)
    _check(got, routing.select_experts_torch(logits, cfg, bias), logits, cfg, bias)
    assert scratch.counter.item() == 0


@pytest.mark.parametrize("name", ["qwen3_softmax_norm", "softmax_e24_k5_h80"])
def test_fused_router_with_the_input_norm(mrf, name):
    """fused_route_norm at one row: the new residual is x + residual rounded (bitwise),
    the normed row RMSNorm's (float32 order of the sum of squares aside), and the
    routing exactly select_experts' on the normed row's logits; counter back at 0."""
    from pagoda.model.layers.layernorm import RMSNorm

    cfg, hidden_size, fp32 = CASES[name]
    dtype = torch.float16
    gate = _gate(cfg.num_experts, hidden_size, fp32, dtype, seed=5)
    hidden, _ = _inputs(cfg, hidden_size, 1, dtype, 31)
    residual, _ = _inputs(cfg, hidden_size, 1, dtype, 32)
    norm = RMSNorm(hidden_size, 1e-6).to(DEVICE)
    norm.weight.data = (1 + 0.1 * _inputs(cfg, hidden_size, 1, dtype, 33)[0][0]).to(dtype)
    assert mrf.fused_route_norm_covers(hidden, residual, norm.weight, gate.weight, fp32)
    assert not mrf.fused_route_norm_covers(
        hidden.repeat(2, 1), residual.repeat(2, 1), norm.weight, gate.weight, fp32
    )
    # Past 128 experts default_tiles puts two a program (no one-chunk tiles): declined,
    # where fused_route would refuse the folded-in norm.
    wide = torch.zeros(256, hidden_size, dtype=gate.weight.dtype, device=DEVICE)
    assert mrf.experts_per_program(256) == 2
    assert not mrf.fused_route_norm_covers(hidden, residual, norm.weight, wide, fp32)
    scratch = mrf.RouterScratch.create(cfg.num_experts, hidden.device)
    weights, ids, normed, new_residual = mrf.fused_route_norm(
        hidden, residual, norm.weight, norm.eps, gate.weight, cfg, None, scratch
    )
    summed = hidden + residual
    assert torch.equal(new_residual, summed)
    want = norm._normalize_reference(summed)
    torch.testing.assert_close(normed, want, atol=2e-3, rtol=2e-3)
    logits = gate(normed)
    _check((weights, ids), routing.select_experts_torch(logits, cfg, None), logits, cfg, None)
    assert scratch.counter.item() == 0


def test_decoder_layer_takes_the_fused_norm_with_the_same_result(mrf, monkeypatch, tmp_path):
    """The seam: a tiny Qwen3-MoE layer in float16 (the router kernel interpreted on the
    CPU) at one row. LlamaDecoderLayer asks its MoE block for forward_after_norm, which
    returns the block's output of the normed row and the new residual; both agree with
    the post-attention norm followed by the block's forward (the routed experts alike),
    and the residual bit for bit."""
    from helpers.tiny_models import save_tiny_hf_model

    from pagoda.model.loader import load_model

    monkeypatch.setattr(routing, "FUSED_NORM_DEVICES", ("cuda", "cpu"))
    save_tiny_hf_model(tmp_path, "qwen3_moe")
    model, _ = load_model(str(tmp_path), dtype="float16", device=DEVICE)
    layer = model.model.layers[0]
    assert hasattr(layer.mlp, "forward_after_norm")
    hidden_size = layer.post_attention_layernorm.weight.shape[0]
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, hidden_size, generator=gen).to(torch.float16).to(DEVICE)
    residual = (torch.randn(1, hidden_size, generator=gen) * 3).to(torch.float16).to(DEVICE)
    calls = []
    real = mrf.fused_route_norm
    monkeypatch.setattr(mrf, "fused_route_norm", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        out, new_residual = layer.mlp.forward_after_norm(
            hidden, residual, layer.post_attention_layernorm
        )
        normed, want_residual = layer.post_attention_layernorm(hidden, residual)
        want = layer.mlp(normed)
    assert calls == [1]
    assert torch.equal(new_residual, want_residual)
    torch.testing.assert_close(out, want, atol=5e-3, rtol=5e-3)
    # More than one row: not fused (the caller runs the norm, then the block).
    assert (
        layer.mlp.forward_after_norm(
            hidden.repeat(2, 1), residual.repeat(2, 1), layer.post_attention_layernorm
        )
        is None
    )
