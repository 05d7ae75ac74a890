"""The MLA Triton kernels (latent decode, latent store) against their torch references,
and the Triton MLA backend's graph-mode plan against the eager one. The prefill kernel
has its own tests (test_mla_prefill.py); the model test here runs it too.

Without CUDA the kernels run under TRITON_INTERPRET=1 (set before Triton is imported,
by conftest or here) on small shapes in float16 and float32. Cache slots no request
uses hold NaN in the kernel's cache: a kernel reading past a context would poison its
output.
"""

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
from helpers.interpreted_kernels import kernel_modules  # noqa: E402

from pagoda.attention.metadata import build_attention_metadata  # noqa: E402
from pagoda.attention.mla_backend import latent_attention_ref, plan_eager  # noqa: E402
from pagoda.attention.mla_triton import MLATritonBackend, row_context  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


MLA_DECODE, MLA_STORE, _ = kernel_modules(
    "attention.mla_decode", "attention.mla_store", "attention.mla_prefill"
)
BLOCK_SIZE = 4


class LatentCase:
    """Requests given as (seq_len, query_len), their latent cache (scrambled blocks) and
    each query row's (request, context length); cache_nan has NaN in unused slots."""

    def __init__(self, reqs, kv_lora_rank, rope, dtype, num_heads=4, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.kv_lora_rank, self.entry = kv_lora_rank, kv_lora_rank + rope
        blocks_needed = [-(-s // BLOCK_SIZE) for s, _ in reqs]
        num_blocks = sum(blocks_needed) + 3
        order = torch.randperm(num_blocks, generator=gen).tolist()
        tables, self.lens, self.row_req, self.row_len = [], [], [], []
        used = torch.zeros(num_blocks, BLOCK_SIZE, dtype=torch.bool)
        for i, ((seq_len, qlen), n) in enumerate(zip(reqs, blocks_needed)):
            table = [order.pop() for _ in range(n)]
            tables.append(table)
            for pos in range(seq_len):
                used[table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = True
            self.row_req += [i] * qlen
            self.row_len += list(range(seq_len - qlen + 1, seq_len + 1))
        width = max(blocks_needed)
        self.tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        self.cache = (torch.randn(num_blocks, BLOCK_SIZE, self.entry, generator=gen) * 0.5).to(
            dtype
        )
        self.cache_nan = self.cache.clone()
        self.cache_nan[~used] = float("nan")
        self.q = torch.randn(len(self.row_req), num_heads, self.entry, generator=gen).to(dtype)

    def tensors(self, device):
        return (
            self.q.to(device),
            self.cache_nan.to(device),
            self.tables.to(device),
            torch.tensor(self.row_req, dtype=torch.int32, device=device),
            torch.tensor(self.row_len, dtype=torch.int32, device=device),
        )


# Context lengths across block boundaries (BLOCK_SIZE 4): 1, 3, 4, 5, 17, 38; a
# request of 3 query rows; and a padding row (length 0).
REQS = [(1, 1), (3, 1), (4, 1), (5, 1), (17, 3), (38, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kv_lora_rank,rope", [(32, 16), (24, 8)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla_decode_kernel_matches_reference(dtype, kv_lora_rank, rope, num_splits):
    case = LatentCase(REQS, kv_lora_rank, rope, dtype)
    q, cache, tables, row_req, row_len = case.tensors(DEVICE)
    row_len = torch.cat([row_len, row_len.new_zeros(1)])  # a padding row
    row_req = torch.cat([row_req, row_req.new_zeros(1)])
    q = torch.cat([q, q[:1]])
    scale = 0.3
    expected = latent_attention_ref(
        q.cpu(), case.cache, case.tables, row_req.cpu(), row_len.cpu(), scale, kv_lora_rank
    )
    out = torch.full(
        (q.shape[0], q.shape[1], kv_lora_rank), float("nan"), dtype=dtype, device=DEVICE
    )
    MLA_DECODE.mla_decode(
        out, q, cache, tables, row_req, row_len, scale, kv_lora_rank, num_splits, min_split_tokens=1
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert not out.isnan().any()
    assert torch.allclose(out.float().cpu(), expected, atol=tol, rtol=tol)
    assert torch.equal(out[-1].float().cpu(), torch.zeros_like(expected[-1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_latent_kernel_matches_index_copy(dtype):
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(5, BLOCK_SIZE, 40, generator=gen).to(dtype)
    latent = torch.randn(6, 40, generator=gen).to(dtype)
    slots = torch.tensor([3, 17, -1, 0, 19, -1])
    expected = cache.clone()
    real = slots >= 0
    expected.view(-1, 40).index_copy_(0, slots[real], latent[real])
    got = cache.to(DEVICE)
    MLA_STORE.store_latent(latent.to(DEVICE), got, slots.to(DEVICE))
    assert torch.equal(got.cpu(), expected)


def test_graph_mode_rows_match_eager_plan():
    """row_context (the device computation graphs replay) gives every row the request
    and context length the eager plan gives it, and length 0 to padding rows."""
    query_lens, seq_lens = [1, 5, 1, 3], [9, 5, 2, 12]
    tables = [list(range(i * 4, i * 4 + 4)) for i in range(4)]
    md = build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, "cpu")
    eager = plan_eager(md, "all")
    req, length = row_context(md.query_start_loc, md.seq_lens, md.num_reqs, 13)
    assert eager.latent_rows is None  # every row, in order
    assert req[:10].tolist() == eager.row_req.tolist()
    assert length[:10].tolist() == eager.row_len.tolist()
    assert length[10:].tolist() == [0, 0, 0]


def test_triton_backend_graph_buffers_replay_a_batch():
    """prepare_replay fills the graph buffers so that the captured plan's rows are the
    real batch's (padding requests and rows get length 0)."""
    backend = MLATritonBackend(4, 32, 16, 0.3, num_decode_splits=2)
    backend.init_cuda_graph_state(8, 6, BLOCK_SIZE, DEVICE, max_num_tokens=16)
    plan = backend.metadata_for_capture(4, 16)
    md = build_attention_metadata([1, 3], [7, 10], [[0, 1], [2, 3, 4]], BLOCK_SIZE, DEVICE)
    backend.prepare_replay(md, 4, 16)
    assert plan.num_splits == 2
    assert plan.row_len.tolist() == [7, 8, 9, 10] + [0] * 12
    assert plan.row_req[:4].tolist() == [0, 1, 1, 1]
    assert plan.common.slot_mapping[4:].tolist() == [-1] * 12


def _tiny_deepseek(tmp_path, kind: str = "deepseek_v2", seed: int = 4, **overrides):
    from helpers.tiny_models import save_tiny_hf_model

    from pagoda.model.loader import load_model

    save_tiny_hf_model(tmp_path, kind, seed=seed, **overrides)
    return load_model(str(tmp_path), dtype="float32", device=DEVICE)


def _backend_args(arch) -> tuple:
    """The MLA backends' (heads, kv_lora_rank, qk_rope_head_dim, scale) for arch."""
    from pagoda.model.mla_config import mla_softmax_scale

    mla = arch.mla
    return (
        arch.num_attention_heads,
        mla.kv_lora_rank,
        mla.qk_rope_head_dim,
        mla_softmax_scale(mla, arch.rope_scaling),
    )


def _fresh_pool(model):
    """A new 32-block float32 KV pool for model's layers."""
    from pagoda.attention.kv_pool import KVCachePool
    from pagoda.core.kv_cache_spec import KVCacheConfig
    from pagoda.model.layers.attention import kv_cache_specs

    specs = kv_cache_specs(model, BLOCK_SIZE, torch.float32)
    return KVCachePool(KVCacheConfig(32, specs), DEVICE)


def _run(model, backend, pool, steps, graphs=None):
    """Runs steps (request -> tokens) through pool; with graphs (a (batch_size, rows)
    key per step) each step goes through metadata_for_capture + prepare_replay, as a
    CUDA graph replays it (inputs padded to the graph's rows). Returns the logits of
    every step's rows."""
    from pagoda.attention.forward_context import forward_context

    tables, lens, out = {}, {}, []
    next_block = iter(range(1000))
    for step, chunks in enumerate(steps):
        ids, pos, qlens, slens, step_tables = [], [], [], [], []
        for req, tokens in chunks.items():
            start = lens.get(req, 0)
            table = tables.setdefault(req, [])
            while len(table) * BLOCK_SIZE < start + len(tokens):
                table.append(next(next_block))
            ids += tokens
            pos += range(start, start + len(tokens))
            qlens.append(len(tokens))
            slens.append(start + len(tokens))
            step_tables.append(table)
            lens[req] = start + len(tokens)
        md = build_attention_metadata(qlens, slens, step_tables, BLOCK_SIZE, DEVICE)
        n = len(ids)
        if graphs is None:
            plan = backend.build_metadata(md)
        else:
            graph = graphs[step]
            plan = backend.metadata_for_capture(*graph)
            backend.prepare_replay(md, *graph)
            rows = graph[1] or graph[0]
            ids, pos = ids + [0] * (rows - n), pos + [0] * (rows - n)
        with torch.no_grad(), forward_context(backend, plan, pool):
            hidden = model(torch.tensor(ids, device=DEVICE), torch.tensor(pos, device=DEVICE))
            out.append(model.compute_logits(hidden[:n]).cpu())
    return torch.cat(out)


STEPS = [
    {"a": list(range(3, 10)), "b": list(range(40, 43))},  # two prefills
    {"a": list(range(50, 53)), "b": [7]},  # a chunk beside a decode
    {"a": [9], "b": [8]},
    {"a": [10], "b": [11]},
]  # decodes


def test_triton_backend_runs_a_model_eagerly_and_as_graphs_replay(tmp_path):
    """A tiny DeepSeek through the Triton MLA backend (interpreter on CPU): eager steps
    (prefills on the decompressed kernel, decodes on the latent one) and graph-mode
    steps (every row on the latent kernel, buffers filled by prepare_replay, padded rows
    and requests) give the reference backend's logits."""
    from pagoda.attention.mla_backend import MLATorchBackend

    model, arch = _tiny_deepseek(tmp_path, q_lora_rank=24)
    args = _backend_args(arch)
    expected = _run(model, MLATorchBackend(*args), _fresh_pool(model), STEPS)
    eager = _run(model, MLATritonBackend(*args, num_decode_splits=2), _fresh_pool(model), STEPS)
    assert (eager - expected).abs().max().item() < 1e-4
    graphs = MLATritonBackend(*args, num_decode_splits=1)
    graphs.init_cuda_graph_state(3, 8, BLOCK_SIZE, DEVICE, max_num_tokens=12)
    replayed = _run(
        model, graphs, _fresh_pool(model), STEPS, graphs=[(3, 12), (2, 6), (3, None), (2, None)]
    )
    assert (replayed - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norm_rope_store_matches_the_unfused_path(dtype):
    """kv_a_proj_with_mqa's output (rows strided, as a slice of a wider buffer) -> the
    cache entry [rms_norm(c) * w, rope(k_rope)], as the layer's torch path builds and
    store_latent writes it; -1 slots write nothing."""
    from pagoda.model.layers.layernorm import RMSNorm
    from pagoda.model.layers.rotary import apply_rotary

    gen = torch.Generator().manual_seed(5)
    rank, rope, tokens = 24, 8, 5
    wide = torch.randn(tokens, rank + rope + 6, generator=gen).to(dtype)
    kv_a = wide[:, : rank + rope]
    norm = RMSNorm(rank, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(rank, generator=gen) + 0.5)
    norm = norm.to(dtype)
    angles = torch.rand(tokens, rope // 2, generator=gen) * 6.0
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([3, 17, -1, 0, 19])
    cache = torch.randn(5, BLOCK_SIZE, rank + rope, generator=gen).to(dtype)
    c, k_rope = kv_a.split([rank, rope], dim=-1)
    latent = torch.cat(
        (
            norm._normalize_reference(c.contiguous()),
            apply_rotary(k_rope.unsqueeze(1), cos, sin).squeeze(1),
        ),
        dim=-1,
    )
    expected = cache.clone()
    real = slots >= 0
    expected.view(-1, rank + rope).index_copy_(0, slots[real], latent[real])
    got = cache.to(DEVICE)
    MLA_STORE.norm_rope_store_latent(
        kv_a.to(DEVICE),
        norm.weight.to(DEVICE),
        1e-6,
        cos.to(DEVICE),
        sin.to(DEVICE),
        got,
        slots.to(DEVICE),
    )
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got.cpu(), expected, rtol=tol, atol=tol)


def test_triton_backend_runs_sparse_mla_as_the_reference_does(tmp_path):
    """A tiny DeepSeek-V3.2 (an indexer keeping 8 tokens, so rows past the 8th attend
    sparsely) through the Triton MLA backend (interpreter on CPU): the indexer's scoring
    kernel and the sparse latent kernel give the reference backend's logits, chunked
    prefill with a cached prefix and decodes beside it included."""
    from pagoda.attention.mla_backend import MLATorchBackend

    kernel_modules("attention.dsa_indexer_kernel", "attention.sparse_mla_kernel")
    model, arch = _tiny_deepseek(tmp_path, "deepseek_v32", seed=5)
    args = _backend_args(arch)

    steps = [
        {"a": list(range(3, 15)), "b": list(range(20, 26))},
        {"a": list(range(40, 52)), "b": [7]},
        {"a": [9], "b": [8]},
    ]
    expected = _run(model, MLATorchBackend(*args, "all"), _fresh_pool(model), steps)
    got = _run(model, MLATritonBackend(*args, latent_rows="all"), _fresh_pool(model), steps)
    assert (got - expected).abs().max().item() < 1e-4


def test_sparse_mla_graph_plans_give_the_eager_logits(tmp_path):
    """Sparse MLA through graph-mode plans (metadata_for_capture + prepare_replay:
    every row's context bounded by the block table, padded rows and requests) gives the
    eager reference's logits."""
    from pagoda.attention.mla_backend import MLATorchBackend

    kernel_modules("attention.dsa_indexer_kernel", "attention.sparse_mla_kernel")
    model, arch = _tiny_deepseek(tmp_path, "deepseek_v32", seed=6)
    args = _backend_args(arch)

    steps = [
        {"a": list(range(3, 15)), "b": list(range(20, 26))},
        {"a": [9], "b": [8]},
        {"a": [10], "b": [11]},
    ]
    expected = _run(model, MLATorchBackend(*args, "all"), _fresh_pool(model), steps)
    graphs = MLATritonBackend(*args, latent_rows="all", num_decode_splits=1)
    graphs.init_cuda_graph_state(3, 8, BLOCK_SIZE, DEVICE, max_num_tokens=24)
    replayed = _run(
        model, graphs, _fresh_pool(model), steps, graphs=[(3, 24), (3, None), (2, None)]
    )
    assert (replayed - expected).abs().max().item() < 1e-4
