"""The one-kernel expert routing (pagoda.kernels.moe.routing) against select_experts'
torch path (itself tested against transformers' routers in test_moe_routing.py).

Without CUDA the kernel runs under TRITON_INTERPRET=1 on small shapes: every routing
method, softmax and sigmoid, float32 and float16 logits, expert counts and top-k that
are not powers of two, group counts that are not, renormalisation and the scaling
factor. The expert ids must be exactly the torch path's (as sets per row: the grouped
torch path returns them unsorted); the weights agree to float32 rounding. With CUDA,
select_experts dispatches to the kernel for small batches: checked at real shapes, in a
CUDA graph, and above the row threshold (torch path).
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
from pagoda.model.moe_config import MoEConfig  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def mr():
    return kernel_modules("moe.routing")[0]


CONFIGS = {
    "qwen3_softmax_norm": MoEConfig(16, 4, 8, renormalize=True),
    "softmax_plain_k6_e60": MoEConfig(60, 6, 8),
    "softmax_k1": MoEConfig(8, 1, 8, renormalize=True, routed_scaling_factor=2.0),
    "v2_group_limited": MoEConfig(
        16,
        3,
        8,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=16.0,
    ),
    "v2_group_limited_3_groups": MoEConfig(
        24, 5, 8, topk_method="group_limited_greedy", n_group=3, topk_group=2
    ),
    "v3_noaux_tc": MoEConfig(
        32,
        8,
        8,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=8,
        topk_group=3,
        renormalize=True,
        routed_scaling_factor=2.5,
    ),
    "v3_noaux_tc_unnormalised": MoEConfig(
        48,
        6,
        8,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=6,
        topk_group=4,
        routed_scaling_factor=1.5,
    ),
}


def _inputs(cfg: MoEConfig, tokens: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, cfg.num_experts, generator=gen) * 2).to(dtype)
    bias = None
    if cfg.topk_method == "noaux_tc":
        bias = torch.randn(cfg.num_experts, generator=gen) * 0.1
    return logits.to(DEVICE), None if bias is None else bias.to(DEVICE)


def _by_id(weights: torch.Tensor, ids: torch.Tensor):
    order = ids.long().argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def _check(got, want):
    (gw, gi), (ww, wi) = _by_id(*got), _by_id(*want)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.int32
    assert torch.equal(gi, wi)
    torch.testing.assert_close(gw, ww, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_kernel_matches_torch_routing(mr, name, dtype):
    cfg = CONFIGS[name]
    for tokens, seed in ((1, 0), (13, 1)):
        logits, bias = _inputs(cfg, tokens, dtype, seed)
        got = mr.route_topk(logits, cfg, bias)
        _check(got, routing.select_experts_torch(logits, cfg, bias))
        # Best first, as torch.topk(sorted=True) orders them: by the choice values.
        scores = (
            logits.float().softmax(-1)
            if cfg.scoring_func == "softmax"
            else logits.float().sigmoid()
        )
        choice = scores + bias if bias is not None else scores
        picked = choice.gather(1, got[1].long())
        assert (picked[:, :-1] >= picked[:, 1:]).all()


def test_kernel_strided_logits_and_empty(mr):
    cfg = CONFIGS["qwen3_softmax_norm"]
    wide, _ = _inputs(MoEConfig(32, 4, 8), 5, torch.float32, 3)
    logits = wide[:, 8:24]  # a row stride of 32: not contiguous rows
    _check(mr.route_topk(logits, cfg), routing.select_experts_torch(logits, cfg))
    weights, ids = mr.route_topk(logits[:0], cfg)
    assert weights.shape == (0, 4) and ids.shape == (0, 4)


def test_kernel_refuses_too_many_experts(mr):
    cfg = MoEConfig(mr.MAX_KERNEL_EXPERTS + 1, 2, 8)
    with pytest.raises(ValueError, match="at most"):
        mr.route_topk(torch.zeros(1, cfg.num_experts, device=DEVICE), cfg)


@gpu
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_select_experts_dispatches_on_cuda(mr, name, monkeypatch):
    cfg = CONFIGS[name]
    logits, bias = _inputs(cfg, 7, torch.bfloat16, 5)
    calls = []
    real = mr.route_topk
    monkeypatch.setattr(mr, "route_topk", lambda *a: calls.append(1) or real(*a))
    _check(
        routing.select_experts(logits, cfg, bias), routing.select_experts_torch(logits, cfg, bias)
    )
    assert calls == [1]
    big, big_bias = _inputs(cfg, 3000, torch.float32, 6)  # prefill-sized: the kernel too
    _check(
        routing.select_experts(big, cfg, big_bias), routing.select_experts_torch(big, cfg, big_bias)
    )
    assert calls == [1, 1]


@gpu
def test_real_shapes_and_cuda_graph(mr):
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
    qwen = MoEConfig(128, 8, 768, renormalize=True)
    for cfg in (v3, qwen):
        for tokens in (1, 64, 256, 4096):
            logits, bias = _inputs(cfg, tokens, torch.float32, tokens)
            _check(
                mr.route_topk(logits, cfg, bias), routing.select_experts_torch(logits, cfg, bias)
            )
    logits, bias = _inputs(v3, 4, torch.float32, 9)
    mr.route_topk(logits, v3, bias)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mr.route_topk(logits, v3, bias)
    fresh, _ = _inputs(v3, 4, torch.float32, 10)
    logits.copy_(fresh)
    graph.replay()
    _check(out, routing.select_experts_torch(fresh, v3, bias))
