"""DeepSeek V4's non-attention layers against transformers' own submodules, with the same
random weights, float32 on the CPU: the hyper-connection mixing and its Sinkhorn
projection, the hyper head, the grouped output projection (whole and split over
tensor-parallel ranks), and the MoE block (hash and top-k routing, clamped SwiGLU
experts that the inputs drive into the clamp, tensor- and expert-parallel partials)."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4

from pagoda.model.layers.grouped_linear import (
    GroupedLinear,
    grouped_output_projection,
    make_grouped_output_projection,
)
from pagoda.model.layers.hyper_connection import (
    HyperConnection,
    HyperHead,
    expand_streams,
    sinkhorn_project,
)
from pagoda.model.layers.linear import materialize_module
from pagoda.model.layers.moe.deepseek_v4_moe import (
    DeepseekV4MoE,
    DeepseekV4MoEConfig,
    clamped_silu_and_mul,
    expert_weight_loads,
    mlp_layer_types,
)
from pagoda.model.parallel import SINGLE_RANK, TensorParallel
from pagoda.model.quant.base import LinearMethod

HIDDEN, HC, EXPERTS, INTER, TOP_K, VOCAB = 32, 4, 8, 12, 3, 64
GEN = torch.Generator().manual_seed(0)


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN) * scale


def hf_config(**overrides) -> DeepseekV4Config:
    fields = dict(
        hidden_size=HIDDEN,
        hc_mult=HC,
        hc_sinkhorn_iters=20,
        moe_intermediate_size=INTER,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        vocab_size=VOCAB,
        num_hidden_layers=4,
        num_attention_heads=8,
        head_dim=16,
        o_groups=4,
        o_lora_rank=6,
        routed_scaling_factor=1.5,
        swiglu_limit=0.75,
    )
    fields.update(overrides)
    return DeepseekV4Config(**fields)


def randomize(module: torch.nn.Module, scale: float) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(randn(*p.shape, scale=scale))


def copy_into(pagoda_module: torch.nn.Module, named: dict[str, torch.Tensor]) -> None:
    """Loads named tensors through each parameter's weight_loader; every one is filled."""
    params = dict(pagoda_module.named_parameters())
    assert set(named) == set(params)
    for name, tensor in named.items():
        params[name].weight_loader(params[name], tensor)


# ---- hyper-connections -----------------------------------------------------------------


def test_sinkhorn_projection_is_doubly_stochastic():
    # Columns are normalised last, so they sum to 1 exactly; rows after 20 rounds of
    # softmax-of-unit-logits matrices are within ~3e-5 (sharper matrices converge slower).
    comb = torch.softmax(randn(50, HC, HC), dim=-1) + 1e-6
    projected = sinkhorn_project(comb, iters=20, eps=1e-6)
    ones = torch.ones(50, HC)
    torch.testing.assert_close(projected.sum(-1), ones, rtol=0, atol=1e-4)
    torch.testing.assert_close(projected.sum(-2), ones, rtol=0, atol=1e-5)


def hyper_pair(cfg: DeepseekV4Config) -> tuple[torch.nn.Module, HyperConnection]:
    hf = hf_v4.DeepseekV4HyperConnection(cfg)
    randomize(hf, 0.5)
    with torch.no_grad():
        hf.scale.copy_(torch.tensor([0.7, 1.3, 2.0]))
    ours = HyperConnection(HIDDEN, HC, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    copy_into(ours, {n: t.detach() for n, t in hf.state_dict().items()})
    return hf, ours


def test_hyper_connection_matches_transformers():
    cfg = hf_config()
    hf, ours = hyper_pair(cfg)
    streams = randn(9, HC, HIDDEN)
    block_out = randn(9, HIDDEN)
    with torch.no_grad():
        post, comb, collapsed = hf(streams.unsqueeze(0))
        # transformers' decoder layer: post * block output + comb^T @ streams
        expected = post.unsqueeze(-1) * block_out.unsqueeze(0).unsqueeze(-2) + torch.matmul(
            comb.transpose(-1, -2), streams.unsqueeze(0)
        )
        mix = ours(streams)
        merged = ours.merge(block_out, streams, mix.post, mix.comb)
    # float32; the only difference is where the RMS factor is applied (max error ~5e-6).
    torch.testing.assert_close(mix.collapsed, collapsed[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(mix.post, post[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(mix.comb, comb[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(merged, expected[0], rtol=0, atol=1e-5)
    assert not torch.allclose(mix.comb, mix.comb.transpose(-1, -2))  # the direction matters


def test_hyper_connection_keeps_float32_weights_and_the_streams_dtype():
    cfg = hf_config()
    with torch.device("meta"):
        hc = HyperConnection(HIDDEN, HC, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    materialize_module(hc, "cpu", torch.bfloat16)
    assert {p.dtype for p in hc.parameters()} == {torch.float32}
    _, ref = hyper_pair(cfg)
    hc.load_state_dict(ref.state_dict())
    streams = expand_streams(randn(3, HIDDEN).to(torch.bfloat16), HC)
    mix = hc(streams)
    assert mix.collapsed.dtype == torch.bfloat16 and mix.comb.dtype == torch.float32
    assert hc.merge(randn(3, HIDDEN).bfloat16(), streams, mix.post, mix.comb).dtype == (
        torch.bfloat16
    )


def test_hyper_head_matches_transformers():
    cfg = hf_config()
    hf = hf_v4.DeepseekV4HyperHead(cfg)
    randomize(hf, 0.5)
    ours = HyperHead(HIDDEN, HC, cfg.hc_eps, cfg.rms_norm_eps)
    copy_into(ours, {n: t.detach() for n, t in hf.state_dict().items()})
    streams = randn(7, HC, HIDDEN)
    with torch.no_grad():
        expected = hf(streams.unsqueeze(0))[0]
        got = ours(streams)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)  # max error ~5e-7


def test_expand_streams_copies_the_embedding_into_every_stream():
    x = randn(2, HIDDEN)
    streams = expand_streams(x, HC)
    assert streams.shape == (2, HC, HIDDEN) and streams.is_contiguous()
    torch.testing.assert_close(streams[:, 3], x, rtol=0, atol=0)


# ---- grouped output projection ---------------------------------------------------------


def test_grouped_linear_matches_transformers():
    cfg = hf_config()
    in_per_group = cfg.num_attention_heads * cfg.head_dim // cfg.o_groups
    hf = hf_v4.DeepseekV4GroupedLinear(in_per_group, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups)
    randomize(hf, 0.3)
    ours = GroupedLinear(in_per_group, cfg.o_lora_rank, cfg.o_groups)
    copy_into(ours, {"weight": hf.weight.detach()})
    x = randn(5, cfg.o_groups, in_per_group)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x.unsqueeze(0))[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_grouped_output_projection_matches_transformers_on_every_rank_split(tp_size):
    """Each rank's heads make whole groups; the ranks' partial outputs sum to the whole."""
    cfg = hf_config()
    heads, head_dim, groups, rank_dim = 8, 16, 4, 6
    in_per_group = heads * head_dim // groups
    o_a = hf_v4.DeepseekV4GroupedLinear(in_per_group, groups * rank_dim, groups)
    o_b = torch.nn.Linear(groups * rank_dim, cfg.hidden_size, bias=False)
    randomize(o_a, 0.3)
    randomize(o_b, 0.3)
    attn_out = randn(6, heads * head_dim)
    with torch.no_grad():  # transformers' attention tail
        expected = o_b(o_a(attn_out.view(1, 6, groups, -1)).flatten(2))[0]
        total = torch.zeros_like(expected)
        heads_per_rank = heads // tp_size
        for rank in range(tp_size):
            ours_a, ours_b = make_grouped_output_projection(
                heads, head_dim, groups, rank_dim, cfg.hidden_size, rank, tp_size, False
            )
            ours_a.weight.weight_loader(ours_a.weight, o_a.weight.detach())
            ours_b.weight.weight_loader(ours_b.weight, o_b.weight.detach())
            cols = slice(rank * heads_per_rank * head_dim, (rank + 1) * heads_per_rank * head_dim)
            total += grouped_output_projection(attn_out[:, cols], ours_a, ours_b)
    torch.testing.assert_close(total, expected, rtol=0, atol=1e-5)


def test_grouped_linear_refuses_a_quantized_method_and_bad_splits():
    class Fake(LinearMethod):
        name = "fp8 (block)"

        def create_weights(self, layer, in_per_rank, out_per_rank, num_shards):
            pass

        def apply(self, layer, x, bias=None):
            raise AssertionError

    with pytest.raises(ValueError, match="'fp8 \\(block\\)' linear method has no grouped"):
        GroupedLinear(8, 4, 2).set_quant_method(Fake())
    with pytest.raises(ValueError, match="o_groups"):
        GroupedLinear(8, 4, 3, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="not divisible by o_groups"):
        make_grouped_output_projection(6, 4, 4, 2, 8)


# ---- MoE -------------------------------------------------------------------------------


def moe_cfg(cfg: DeepseekV4Config) -> DeepseekV4MoEConfig:
    return DeepseekV4MoEConfig.from_hf_config(cfg.to_dict())


def hf_moe(cfg: DeepseekV4Config, layer_idx: int) -> torch.nn.Module:
    hf = hf_v4.DeepseekV4SparseMoeBlock(cfg, layer_idx).eval()
    randomize(hf, 0.4)
    if hf.is_hash:
        hf.gate.tid2eid.copy_(
            torch.stack([torch.randperm(EXPERTS, generator=GEN)[:TOP_K] for _ in range(VOCAB)])
        )
    else:
        hf.gate.e_score_correction_bias.copy_(randn(EXPERTS, scale=0.5))
    return hf


def build_block(cfg, hashed: bool, tp: TensorParallel = SINGLE_RANK, ep: bool = False):
    with torch.device("meta"):
        block = DeepseekV4MoE(moe_cfg(cfg), hashed, tp, torch.float32, expert_parallel=ep)
    materialize_module(block, "cpu", torch.float32)
    return block


def load_from_hf(block: DeepseekV4MoE, hf: torch.nn.Module) -> None:
    """transformers' state dict (stacked experts, separate shared gate / up) -> block."""
    params = dict(block.named_parameters())
    filled = set()
    for name, tensor in hf.state_dict().items():
        loads = expert_weight_loads(name, tensor)
        if loads is None:
            shard = {".gate_proj.": 0, ".up_proj.": 1}
            hit = next((k for k in shard if k in name), None)
            target = name.replace(hit, ".gate_up_proj.") if hit else name
            loads = [(target, shard[hit] if hit else None, tensor)]
        for target, shard_id, t in loads:
            params[target].weight_loader(params[target], t, shard_id)
            filled.add(target)
    assert filled == set(params)


@pytest.mark.parametrize("layer_idx,hashed", [(0, True), (3, False)])
def test_moe_block_matches_transformers(layer_idx, hashed):
    cfg = hf_config()
    assert mlp_layer_types(cfg.to_dict())[layer_idx] == ("hash_moe" if hashed else "moe")
    hf = hf_moe(cfg, layer_idx)
    block = build_block(cfg, hashed)
    load_from_hf(block, hf)
    x = randn(13, HIDDEN, scale=2.0)
    ids = torch.randint(0, VOCAB, (13,), generator=GEN)
    with torch.no_grad():
        expected = hf(x.unsqueeze(0), input_ids=ids.unsqueeze(0))[0]
        got = block(x, ids)
        # The inputs reach the clamp on both sides (else the test would not see it).
        gate_up = torch.cat([x @ block.experts.w13_weight[e].T for e in range(EXPERTS)])
        gate, up = gate_up.chunk(2, dim=-1)
        assert (gate > cfg.swiglu_limit).any() and (up.abs() > cfg.swiglu_limit).any()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)  # max error ~5e-7


def test_routing_matches_transformers_routers():
    cfg = hf_config()
    for layer_idx, hashed in ((0, True), (3, False)):
        hf = hf_moe(cfg, layer_idx)
        block = build_block(cfg, hashed)
        load_from_hf(block, hf)
        x, ids = randn(11, HIDDEN), torch.randint(0, VOCAB, (11,), generator=GEN)
        with torch.no_grad():
            args = (x, ids) if hashed else (x,)
            _, hf_weights, hf_ids = hf.gate(*args)
            weights, chosen = block.gate.route(x, ids)
        assert chosen.dtype == torch.int32
        order, hf_order = chosen.long().sort(-1), hf_ids.sort(-1)
        assert torch.equal(order.values, hf_order.values)
        torch.testing.assert_close(
            weights.gather(1, order.indices),
            hf_weights.gather(1, hf_order.indices),
            rtol=0,
            atol=1e-6,
        )


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_moe_partials_of_two_ranks_sum_to_the_whole(expert_parallel):
    cfg = hf_config()
    hf = hf_moe(cfg, 3)
    whole = build_block(cfg, hashed=False)
    load_from_hf(whole, hf)
    x = randn(6, HIDDEN, scale=2.0)
    with torch.no_grad():
        expected = whole(x)
        total = torch.zeros_like(expected)
        for rank in range(2):
            block = build_block(cfg, False, TensorParallel(rank, 2), ep=expert_parallel)
            load_from_hf(block, hf)
            topk = block.gate.route(x, None)
            total += block.experts(x, topk) + block.shared_experts(x)
    torch.testing.assert_close(total, expected, rtol=0, atol=1e-5)


def test_clamped_silu_and_mul_clamps_gate_above_and_up_both_ways():
    gate_up = torch.tensor([[5.0, -5.0, 5.0, -5.0]])
    got = clamped_silu_and_mul(gate_up, 1.0)
    want = torch.nn.functional.silu(torch.tensor([1.0, -5.0])) * torch.tensor([1.0, -1.0])
    torch.testing.assert_close(got[0], want, rtol=0, atol=0)


def test_original_checkpoint_expert_names_map_to_the_fused_weights():
    t = randn(INTER, HIDDEN)
    assert expert_weight_loads("layers.2.mlp.experts.5.w3.weight", t) == [
        ("layers.2.mlp.experts.w13_weight", (5, "up"), t)
    ]
    (load,) = expert_weight_loads("model.layers.0.mlp.experts.1.down_proj.weight", t)
    assert load[:2] == ("model.layers.0.mlp.experts.w2_weight", (1, "down"))
    assert expert_weight_loads("model.layers.0.mlp.gate.weight", t) is None


def test_moe_refusals():
    cfg = hf_config()
    block = build_block(cfg, hashed=True)
    with pytest.raises(ValueError, match="needs the step's input ids"):
        block(randn(2, HIDDEN))
    with pytest.raises(ValueError, match="one token id per row"):
        block(randn(2, HIDDEN), torch.zeros(3, dtype=torch.long))
    for key, value in (
        ("norm_topk_prob", False),
        ("n_shared_experts", 2),
        ("scoring_func", "softmax"),
        ("hidden_act", "gelu"),
    ):
        with pytest.raises(ValueError, match=key if key != "scoring_func" else "scoring_func"):
            DeepseekV4MoEConfig.from_hf_config({**cfg.to_dict(), key: value})


def test_bfloat16_block_keeps_router_tables_and_hyper_weights_exact():
    cfg = hf_config()
    for hashed in (True, False):
        with torch.device("meta"):
            block = DeepseekV4MoE(moe_cfg(cfg), hashed, SINGLE_RANK, torch.bfloat16)
        materialize_module(block, "cpu", torch.bfloat16)
        assert block.gate.weight.dtype == torch.float32
        table = block.gate.tid2eid if hashed else block.gate.e_score_correction_bias
        assert table.dtype == (torch.int32 if hashed else torch.float32)
        assert block.experts.w13_weight.dtype == torch.bfloat16


def test_hyper_connection_takes_an_empty_step():
    cfg = hf_config()
    _, hc = hyper_pair(cfg)
    mix = hc(torch.zeros(0, HC, HIDDEN))
    assert mix.collapsed.shape == (0, HIDDEN) and mix.comb.shape == (0, HC, HC)
