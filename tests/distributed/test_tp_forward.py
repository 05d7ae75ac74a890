"""Tensor parallelism at tp_size 2, two CPU processes joined through gloo: the sharded
layers' collectives, and whole tiny models (Llama with divided and with replicated KV
heads and a padded vocabulary, Qwen2's q/k/v bias, Qwen3's q/k norms with tied
embeddings) against the same checkpoint at tp_size 1.

Driven as the model runner drives a model: flattened steps through a paged KV cache
and the torch_ref backend with each rank's heads (prefill, a chunked prefill beside a
decode, pure decode). Every rank must see the full logits; values agree with tp_size 1
to float32 rounding (partial sums are added in another order) and greedy argmaxes are
identical. One spawn serves every case, to pay the children's start-up once.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.nn.functional as F
from helpers.tiny_models import save_tiny_hf_model
from helpers.tp_helpers import STEPS, assert_fp32_close, free_port, paged_forward, run_ranks

from pagoda.distributed.parallel_state import (
    destroy_distributed,
    init_distributed,
    tp_all_gather,
    tp_all_reduce,
)
from pagoda.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.model.layers.linear import RowParallelLinear
from pagoda.model.loader import load_model
from pagoda.model.parallel import TensorParallel

WORLD = 2
# name -> (save_tiny_hf_model arch, config overrides)
MODELS = {
    "llama": ("llama", {}),  # 4 heads / 2 KV heads: one KV head per rank
    "llama-kv1": ("llama", {"num_key_value_heads": 1, "vocab_size": 385}),  # replicated; padded
    "qwen2": ("qwen2", {}),  # q/k/v bias, sharded with the heads
    "qwen3": ("qwen3", {"tie_word_embeddings": True}),  # q/k norms; tied, sharded once
}


def layer_inputs() -> dict[str, torch.Tensor]:
    """Full weights and inputs of the layer-level checks (same seed in every process)."""
    gen = torch.Generator().manual_seed(3)
    return {
        "row_w": torch.randn(6, 8, generator=gen),
        "row_b": torch.randn(6, generator=gen),
        "row_x": torch.randn(3, 8, generator=gen),
        "table": torch.randn(7, 5, generator=gen),
        "ids": torch.tensor([0, 6, 3, 4, 2, 5, 1]),
        "hidden": torch.randn(3, 5, generator=gen),
    }


def layer_outputs(rank: int) -> dict[str, torch.Tensor]:
    """This rank's row-parallel (with bias), embedding and LM head outputs, vocab 7 over
    2 ranks (4 rows each, the last one padding)."""
    t = layer_inputs()
    row = RowParallelLinear(8, 6, bias=True, tp_rank=rank, tp_size=WORLD)
    emb = VocabParallelEmbedding(7, 5, tp_rank=rank, tp_size=WORLD)
    head = ParallelLMHead(7, 5, tp_rank=rank, tp_size=WORLD)
    for param, full in (
        (row.weight, t["row_w"]),
        (row.bias, t["row_b"]),
        (emb.weight, t["table"]),
        (head.weight, t["table"]),
    ):
        param.weight_loader(param, full)
    cols = slice(rank * 4, rank * 4 + 4)
    gathered = tp_all_gather(torch.full((2, 3), float(rank)), dim=1)
    return {
        "row": row(t["row_x"][:, cols]),
        "emb": emb(t["ids"]),
        "head": head(t["hidden"]),
        "gather_dim1": gathered,
        "reduce": tp_all_reduce(torch.full((2,), rank + 1.0)),
    }


def rank_main(rank: int, port: int, root: str) -> None:
    """One process of the group: layer checks, then every model's forward, saved."""
    torch.set_num_threads(1)
    init_distributed(rank, WORLD, f"tcp://127.0.0.1:{port}", "gloo")
    try:
        results = {"layers": layer_outputs(rank)}
        for name in MODELS:
            model, _ = load_model(
                str(pathlib.Path(root) / name),
                "safetensors",
                "float32",
                "cpu",
                tp=TensorParallel(rank, WORLD),
            )
            results[name] = paged_forward(model, STEPS)
        torch.save(results, pathlib.Path(root) / f"rank{rank}.pt")
    finally:
        destroy_distributed()


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    """(per-rank results of the 2-process run, the checkpoints' directory)."""
    root = tmp_path_factory.mktemp("tp2")
    for name, (arch, overrides) in MODELS.items():
        save_tiny_hf_model(root / name, arch, seed=len(name), **overrides)
    run_ranks(rank_main, WORLD, (free_port(), str(root)), timeout_s=120)
    return [torch.load(root / f"rank{r}.pt") for r in range(WORLD)], root


def test_layer_collectives(tp_results):
    ranks, _ = tp_results
    t = layer_inputs()
    for _rank, out in enumerate(ranks):
        layers = out["layers"]
        assert torch.equal(layers["reduce"], torch.full((2,), 3.0))
        assert torch.equal(layers["gather_dim1"], torch.tensor([[0.0] * 3 + [1.0] * 3] * 2))
        # The bias is added once, after the sum of the two partial products.
        assert_fp32_close(layers["row"], F.linear(t["row_x"], t["row_w"], t["row_b"]))
        # Each id's row comes from exactly one rank (the others add zeros): exact.
        assert torch.equal(layers["emb"], F.embedding(t["ids"], t["table"]))
        # Vocab 7: the padded 8th column is dropped.
        assert layers["head"].shape == (3, 7)
        assert_fp32_close(layers["head"], F.linear(t["hidden"], t["table"]))


@pytest.mark.parametrize("name", list(MODELS))
def test_model_at_tp2_matches_tp1(tp_results, name):
    ranks, root = tp_results
    model, arch = load_model(str(root / name), "safetensors", "float32", "cpu")
    want_hidden, want_logits = paged_forward(model, STEPS)
    tokens = sum(len(t) for step in STEPS for t in step.values())
    assert want_logits.shape == (tokens, arch.vocab_size)
    for out in ranks:  # every rank holds the full hidden states and logits
        hidden, logits = out[name]
        assert_fp32_close(hidden, want_hidden)
        assert_fp32_close(logits, want_logits)
        assert torch.equal(logits.argmax(-1), want_logits.argmax(-1))
