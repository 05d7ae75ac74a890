"""Short-context decode graphs: at small batches a second decode CUDA graph per size,
planned with fewer context slices (paged_decode.short_context_splits), replayed when the
step's longest context is within its bound.

Covered on CPU (the kernels under TRITON_INTERPRET=1): the split plan (which batch sizes
get the second graph and with how many slices), the backend's capture plan and what it
refuses, the graph runner's keys and its choice by the step's longest context, and a
replay of the short plan over contexts past its bound (slower there, never wrong: each
slice's length comes from the device's seq_lens) against the torch reference.
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
from helpers.kv_pool_helpers import store_and_attend  # noqa: E402
from helpers.paged_attention_case import Case  # noqa: E402

from pagoda.attention.torch_ref import TorchRefBackend  # noqa: E402
from pagoda.attention.triton_backend import TritonBackend  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
SMS = 132  # an H200's, so the plans below are the GPU's

kernel_modules(
    "attention.store_kv",
    "attention.paged_attention",
    "attention.fp8_decode_words",
    "attention.paged_decode_slices",
    "attention.paged_decode_words",
    "attention.paged_decode",
)


def test_the_short_plan_exists_only_where_the_long_one_has_more_slices():
    from dataclasses import replace

    from pagoda.kernels.attention.decode_config import DecodeAttentionConfig
    from pagoda.kernels.attention.paged_decode import choose_num_splits, short_context_splits

    config = DecodeAttentionConfig.for_capability((9, 0))
    assert (config.short_context_tokens, config.short_context_splits) == (512, 8)
    # Batch 1 and 4 over Llama-8B's 8 KV heads, a 2304-token block table: 32 and 17 slices.
    assert choose_num_splits(1, 8, 2304, SMS) == 32
    assert short_context_splits(1, 8, 2304, SMS, config) == 8
    assert choose_num_splits(4, 8, 2304, SMS) == 17
    assert short_context_splits(4, 8, 2304, SMS, config) == 8
    # 64 requests fill the GPU with 2 slices already; a table of 512 tokens is short itself.
    assert short_context_splits(64, 8, 2304, SMS, config) is None
    assert short_context_splits(1, 8, 512, SMS, config) is None
    # A variant with 4 slices for contexts up to 1024 tokens.
    variant = replace(config, short_context_tokens=1024, short_context_splits=4)
    assert short_context_splits(1, 8, 2304, SMS, variant) == 4
    assert short_context_splits(1, 8, 1024, SMS, variant) is None


def _backend(monkeypatch, max_batch=8, max_blocks=144, block_size=16, **kwargs):
    backend = TritonBackend(8, 2, 64, 1 / 8, **kwargs)
    monkeypatch.setattr(backend, "_sm_count", lambda device: SMS)
    backend.init_cuda_graph_state(
        max_batch_size=max_batch,
        max_blocks_per_req=max_blocks,
        block_size=block_size,
        device=DEVICE,
    )
    return backend


def test_backend_plans_the_short_graph_and_refuses_other_bounds(monkeypatch):
    backend = _backend(monkeypatch)
    assert backend.short_context_graph(1) == 512
    assert backend.metadata_for_capture(1).num_splits == 32
    short = backend.metadata_for_capture(1, None, 512)
    assert (short.num_splits, short.num_decodes, short.zero_padding_rows) == (8, 1, False)
    with pytest.raises(ValueError, match="short-context"):
        backend.metadata_for_capture(1, None, 1024)
    with pytest.raises(ValueError, match="short-context"):
        backend.metadata_for_capture(1, 4, 512)  # mixed graphs have one plan
    from dataclasses import replace

    variant = _backend(
        monkeypatch,
        config=replace(backend.config, short_context_tokens=256, short_context_splits=2),
    )
    assert variant.short_context_graph(1) == 256
    assert variant.metadata_for_capture(1, None, 256).num_splits == 2
    fixed = _backend(monkeypatch, num_decode_splits=4)  # a fixed split count: one graph
    assert fixed.short_context_graph(1) is None
    short_table = _backend(monkeypatch, max_blocks=32)  # 512 tokens: every context short
    assert short_table.short_context_graph(1) is None


def test_graph_runner_keys_and_choice_by_longest_context(monkeypatch):
    from pagoda.worker.cuda_graph import CudaGraphRunner

    backend = _backend(monkeypatch, max_batch=8)
    runner = CudaGraphRunner(
        torch.nn.Identity(),
        backend,
        None,
        max_batch_size=8,
        max_blocks_per_req=144,
        device=torch.device(DEVICE),
        max_num_tokens=32,
    )
    keys = runner._keys()
    short = {k[0] for k in keys if k[2] is not None}
    # Sizes 1, 2, 4, 8 over 2 KV heads all plan more than 8 slices for 2304 tokens.
    assert short == {1, 2, 4, 8} and all(k[2] in (None, 512) for k in keys)
    assert len(keys) == len(set(keys))
    runner.short_bounds = {bs: 512 for bs in short}
    assert runner.graph_for(1, 1, 300) == (1, None, 512)
    assert runner.graph_for(3, 3, 512) == (4, None, 512)
    assert runner.graph_for(3, 3, 513) == (4, None, None)
    assert runner.graph_for(1, 1) == (1, None, None)  # no context given: the general graph
    assert runner.graph_for(16, 2, 100) == (8, 16, None)  # a mixed step


def test_short_plan_replays_contexts_past_its_bound_correctly(monkeypatch):
    """The short plan's 8 slices over contexts of 3 to 700 tokens (past the 512 bound):
    each slice reads its length from seq_lens on the device, so the result is exact."""
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    backend = _backend(monkeypatch, max_batch=4, max_blocks=144)
    plan = backend.metadata_for_capture(4, None, 512)
    case = Case(
        [(700, 1), (3, 1), (250, 1)],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        torch.float16,
        pad_rows=1,
        seed=4,
    )
    backend.prepare_replay(case.md, batch_size=4)
    ref = store_and_attend(
        TorchRefBackend(num_heads, num_kv_heads, head_dim, 1 / 8),
        case.pool_ref,
        0,
        case.q,
        case.k,
        case.v,
        case.md,
    )
    out = store_and_attend(
        backend, case.pool_tri, 0, case.q, case.k, case.v, plan.common, plan=plan
    )
    torch.testing.assert_close(out[:3].float(), ref[:3].float(), atol=3e-3, rtol=3e-3)
