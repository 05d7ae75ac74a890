"""Tensor parallelism without a process group: every sharding weight loader against a
slice of the full tensor (exact, every rank of tp_size 2 and 4), the model-shape check
(check_tensor_parallel), and the engine's parallel config and CLI flags."""

from __future__ import annotations

import argparse

import pytest
import torch

from pagoda import config as config_module
from pagoda.config import EngineArgs, ParallelConfig
from pagoda.entrypoints.cli_args import add_engine_args, engine_args_from_namespace
from pagoda.model.arch_config import ArchConfig
from pagoda.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagoda.model.loader import load_arch_config, load_model
from pagoda.model.parallel import TensorParallel, check_tensor_parallel, valid_tp_sizes

GEN = torch.Generator().manual_seed(0)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


def load(param, tensor, shard=None) -> None:
    param.weight_loader(param, tensor, shard)


# ---- weight loaders: each rank's share is exactly a slice of the full tensor ----


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("num_kv_heads", [8, 4, 2, 1])  # divisible at 8 and 4 (tp 4: 4)
def test_qkv_shards_heads_and_replicates_kv_heads(tp_size, num_kv_heads):
    heads, head_dim, hidden = 8, 3, 5
    q, qb = randn(heads * head_dim, hidden), randn(heads * head_dim)
    k, kb = randn(num_kv_heads * head_dim, hidden), randn(num_kv_heads * head_dim)
    v, vb = randn(num_kv_heads * head_dim, hidden), randn(num_kv_heads * head_dim)
    q_rows = heads // tp_size * head_dim
    for rank in range(tp_size):
        layer = QKVParallelLinear(
            hidden, head_dim, heads, num_kv_heads, bias=True, tp_rank=rank, tp_size=tp_size
        )
        for shard, w, b in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
            load(layer.weight, w, shard)
            load(layer.bias, b, shard)
        if num_kv_heads >= tp_size:
            assert layer.num_kv_heads == num_kv_heads // tp_size
            kv_head = rank * layer.num_kv_heads
        else:  # one KV head per rank, shared by tp_size / num_kv_heads neighbours
            assert layer.num_kv_heads == 1
            kv_head = rank // (tp_size // num_kv_heads)
        kv = slice(kv_head * head_dim, (kv_head + layer.num_kv_heads) * head_dim)
        qs = slice(rank * q_rows, (rank + 1) * q_rows)
        assert torch.equal(layer.weight, torch.cat([q[qs], k[kv], v[kv]]))
        assert torch.equal(layer.bias, torch.cat([qb[qs], kb[kv], vb[kv]]))


@pytest.mark.parametrize("tp_size", [2, 4])
def test_column_and_merged_gate_up_take_their_rows(tp_size):
    gate, up, bias = randn(16, 6), randn(16, 6), randn(16)
    rows = 16 // tp_size
    for rank in range(tp_size):
        own = slice(rank * rows, (rank + 1) * rows)
        merged = MergedColumnParallelLinear(6, [16, 16], tp_rank=rank, tp_size=tp_size)
        load(merged.weight, gate, 0)
        load(merged.weight, up, 1)
        assert torch.equal(merged.weight, torch.cat([gate[own], up[own]]))
        column = ColumnParallelLinear(6, 16, bias=True, tp_rank=rank, tp_size=tp_size)
        load(column.weight, gate)
        load(column.bias, bias)
        assert torch.equal(column.weight, gate[own]) and torch.equal(column.bias, bias[own])


@pytest.mark.parametrize("tp_size", [2, 4])
def test_row_parallel_takes_its_columns_and_the_whole_bias(tp_size):
    weight, bias = randn(6, 16), randn(6)
    cols = 16 // tp_size
    for rank in range(tp_size):
        row = RowParallelLinear(16, 6, bias=True, tp_rank=rank, tp_size=tp_size)
        load(row.weight, weight)
        load(row.bias, bias)
        assert torch.equal(row.weight, weight[:, rank * cols : (rank + 1) * cols])
        assert torch.equal(row.bias, bias)  # replicated: added once, after the all-reduce


@pytest.mark.parametrize("cls", [VocabParallelEmbedding, ParallelLMHead])
@pytest.mark.parametrize("tp_size,vocab", [(2, 11), (4, 10), (4, 9), (2, 12)])
def test_vocab_shards_are_contiguous_with_a_zero_padded_tail(cls, tp_size, vocab):
    # (4, 9): ceil(9/4) = 3 rows per rank, so rank 3 owns no id at all, only padding.
    table = randn(vocab, 5)
    rows = -(-vocab // tp_size)
    shards = []
    for rank in range(tp_size):
        layer = cls(vocab, 5, tp_rank=rank, tp_size=tp_size)
        load(layer.weight, table)
        assert layer.weight.shape == (rows, 5)
        assert (layer.vocab_start, layer.vocab_end) == (
            min(rank * rows, vocab),
            min((rank + 1) * rows, vocab),
        )
        shards.append(layer.weight)
    stacked = torch.cat(shards)
    assert torch.equal(stacked[:vocab], table)
    assert torch.equal(stacked[vocab:], torch.zeros(rows * tp_size - vocab, 5))


def test_sharded_layers_refuse_to_run_outside_their_group():
    """Built for rank 1 of 2 in a process that joined no group: the collectives would be
    the identity and each output a silent partial, so forward raises instead."""
    layers = [
        (RowParallelLinear(8, 6, tp_rank=1, tp_size=2), torch.randn(2, 4)),
        (VocabParallelEmbedding(7, 3, tp_rank=1, tp_size=2), torch.tensor([0, 6])),
        (ParallelLMHead(7, 3, tp_rank=1, tp_size=2), torch.randn(2, 3)),
    ]
    for layer, x in layers:
        torch.nn.init.zeros_(layer.weight)
        with pytest.raises(RuntimeError, match="rank 1 of 2.*rank 0 of 1.*init_distributed"):
            layer(x)


# ---- which model shapes split over which sizes ----


def arch(heads: int, kv_heads: int, intermediate: int = 1536) -> ArchConfig:
    return ArchConfig(
        "LlamaForCausalLM",
        hidden_size=heads * 64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=64,
        intermediate_size=intermediate,
        vocab_size=49152,
    )


@pytest.mark.parametrize(
    "heads,kv_heads,tp_size",
    [(32, 8, 2), (32, 8, 8), (32, 8, 16), (4, 1, 4), (4, 2, 4), (9, 3, 3), (9, 3, 1)],
)
def test_valid_splits_pass(heads, kv_heads, tp_size):
    check_tensor_parallel(arch(heads, kv_heads), tp_size)


def test_smollm2_shape_at_tp_2_is_refused_with_the_reason_and_the_valid_sizes():
    with pytest.raises(ValueError) as e:
        check_tensor_parallel(arch(9, 3), 2)
    message = str(e.value)
    assert "tensor_parallel_size 2" in message
    assert "num_attention_heads (9) is not divisible" in message
    assert "num_key_value_heads (3) is neither a multiple nor a divisor" in message
    assert "Valid sizes for this model: [1, 3]" in message
    assert valid_tp_sizes(arch(32, 8, 14336)) == [1, 2, 4, 8, 16, 32]


@pytest.mark.parametrize(
    "heads,kv_heads,intermediate,tp_size,reason",
    [
        (6, 3, 1536, 2, r"num_key_value_heads \(3\)"),  # neither 3 % 2 nor 2 % 3
        (8, 4, 1536, 8, None),  # replicated x2: valid
        (8, 8, 1024, 16, r"num_attention_heads \(8\)"),
        (8, 8, 1001, 8, r"intermediate_size \(1001\)"),
    ],
)
def test_each_constraint(heads, kv_heads, intermediate, tp_size, reason):
    shape = arch(heads, kv_heads, intermediate)
    if reason is None:
        check_tensor_parallel(shape, tp_size)
    else:
        with pytest.raises(ValueError, match=reason):
            check_tensor_parallel(shape, tp_size)


def test_loading_an_invalid_split_fails_before_building_the_model():
    # The smollm2-135m preset (9 heads / 3 KV heads) at tp 2: refused by build_model with
    # the model-level message, not by the first layer that fails to divide.
    assert load_arch_config("smollm2-135m", "dummy").num_attention_heads == 9
    with pytest.raises(ValueError, match=r"cannot be split over tensor_parallel_size 2"):
        load_model("smollm2-135m", "dummy", "float32", "cpu", tp=TensorParallel(0, 2))


# ---- engine config and CLI ----


def test_parallel_config_accepts_sizes_and_backend_names():
    cfg = EngineArgs(
        model="tiny-llama", load_format="dummy", device="cpu", tensor_parallel_size=2
    ).create_engine_config()
    assert cfg.parallel == ParallelConfig(2, "mp")
    # "ray" is a valid name here (the engine checks that Ray is installed when it starts).
    assert ParallelConfig(4, "ray").distributed_executor_backend == "ray"
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of mp, ray"):
        ParallelConfig(2, "gloo")
    for bad in (0, -1, None, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
            ParallelConfig(bad)


def test_more_ranks_than_gpus_is_refused_on_cuda(monkeypatch):
    monkeypatch.setattr(config_module, "_cuda_available", lambda: True)
    monkeypatch.setattr(config_module, "_cuda_device_count", lambda: 2)
    args = dict(model="tiny-llama", load_format="dummy", device="cuda")
    assert (
        EngineArgs(**args, tensor_parallel_size=2)
        .create_engine_config()
        .parallel.tensor_parallel_size
        == 2
    )
    with pytest.raises(ValueError, match="tensor_parallel_size is 4 but only 2 CUDA GPU"):
        EngineArgs(**args, tensor_parallel_size=4).create_engine_config()
    # Ray's ranks may be on other machines: its executor counts the cluster's GPUs.
    ray_args = dict(args, tensor_parallel_size=4, distributed_executor_backend="ray")
    assert EngineArgs(**ray_args).create_engine_config().parallel.tensor_parallel_size == 4


def test_cli_flags():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["-tp", "2", "--distributed-executor-backend", "ray"])
    args = engine_args_from_namespace(ns)
    assert (args.tensor_parallel_size, args.distributed_executor_backend) == (2, "ray")
    assert engine_args_from_namespace(parser.parse_args([])).distributed_executor_backend == "mp"
    with pytest.raises(SystemExit):
        parser.parse_args(["--distributed-executor-backend", "uni"])
