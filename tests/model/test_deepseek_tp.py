"""DeepSeek (MLA + MoE) at tensor-parallel size 2, two CPU processes joined through gloo,
against the same checkpoint at size 1: heads split across the ranks (q / kv_b
column-parallel, o_proj row-parallel), the latent cache and its projections
replicated, experts' intermediates split; V3.2's sparse-attention indexer replicated,
so every rank selects the same tokens. Steps as tests/distributed/test_tp_forward.py drives
them (prefill, a chunk beside a decode, pure decode) through the MLA reference backend
with each rank's heads.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from helpers.tiny_models import save_tiny_hf_model
from helpers.tp_helpers import STEPS, assert_fp32_close, free_port, paged_forward, run_ranks

from pagoda.attention.selector import make_attention_backend
from pagoda.distributed.parallel_state import destroy_distributed, init_distributed
from pagoda.model.loader import load_model
from pagoda.model.parallel import TensorParallel

WORLD = 2
MODELS = {"deepseek_v2": {}, "deepseek_v3": {"q_lora_rank": 24}, "deepseek_v32": {}}


def forward(path: str, tp: TensorParallel):
    model, arch = load_model(path, "safetensors", "float32", "cpu", tp=tp)
    backend = make_attention_backend("torch_ref", "cpu", arch.attention_shape(tp.size))
    assert backend.num_heads == arch.num_attention_heads // tp.size
    return paged_forward(model, STEPS, backend=backend)


def rank_main(rank: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    init_distributed(rank, WORLD, f"tcp://127.0.0.1:{port}", "gloo")
    try:
        results = {
            name: forward(str(pathlib.Path(root) / name), TensorParallel(rank, WORLD))
            for name in MODELS
        }
        torch.save(results, pathlib.Path(root) / f"rank{rank}.pt")
    finally:
        destroy_distributed()


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek-tp2")
    for seed, (name, overrides) in enumerate(MODELS.items()):
        save_tiny_hf_model(root / name, name, seed=seed, **overrides)
    run_ranks(rank_main, WORLD, (free_port(), str(root)), timeout_s=120)
    return [torch.load(root / f"rank{r}.pt") for r in range(WORLD)], root


@pytest.mark.parametrize("name", list(MODELS))
def test_deepseek_at_tp2_matches_tp1(tp_results, name):
    ranks, root = tp_results
    want_hidden, want_logits = forward(str(root / name), TensorParallel())
    for out in ranks:
        hidden, logits = out[name]
        assert_fp32_close(hidden, want_hidden)
        assert_fp32_close(logits, want_logits)
        assert torch.equal(logits.argmax(-1), want_logits.argmax(-1))
