"""GPU-only checks of the fast path (skipped without CUDA): CUDA-graph replay equals an
eager forward through the reference backend, and the engine runs end to end on graphs."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def llm():
    from pagoda import LLM

    with LLM(
        "smollm2-135m",
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=1024,
        max_num_seqs=48,
        gpu_memory_utilization=0.3,
    ) as llm:
        yield llm


def test_graph_replay_matches_eager_reference(llm):
    from helpers.kv_pool_helpers import pool_holding

    from pagoda.attention.forward_context import forward_context
    from pagoda.attention.kv_pool import FullAttentionLayout
    from pagoda.attention.metadata import build_attention_metadata
    from pagoda.attention.torch_ref import TorchRefBackend
    from pagoda.core.kv_cache_spec import FullAttentionSpec

    runner = llm.llm_engine.executor.runner
    assert runner.graph_runner is not None and runner.backend.name == "triton"
    arch, device, bs = runner.arch, runner.device, 16
    ref = TorchRefBackend(
        arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, arch.head_dim**-0.5
    )
    gen = torch.Generator(device="cpu").manual_seed(0)
    lens = torch.randint(20, 700, (37,), generator=gen).tolist()  # 37: a padded graph size (48)
    tables, nxt = [], 0
    for n in lens:
        nb = -(-(n + 1) // bs)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    # The reference stores with torch's index_copy, as torch_ref did on its own.
    ref_pool = pool_holding(
        runner.kv_pool.caches, {FullAttentionSpec: FullAttentionLayout(use_triton=False)}
    )
    with torch.inference_mode():
        # Prefill every context with the reference backend into both cache copies.
        md = build_attention_metadata(lens, lens, tables, bs, device)
        ids = torch.randint(0, arch.vocab_size, (sum(lens),), generator=gen).to(device)
        pos = torch.cat([torch.arange(n) for n in lens]).to(device)
        with forward_context(ref, ref.build_metadata(md), ref_pool):
            runner.model(ids, pos)
        for dst, src in zip(runner.kv_pool.caches, ref_pool.caches):
            dst.copy_(src)
        # One decode token per request: graph (triton) vs eager (reference).
        md = build_attention_metadata([1] * len(lens), [n + 1 for n in lens], tables, bs, device)
        ids = torch.randint(0, arch.vocab_size, (len(lens),), generator=gen).to(device)
        pos = torch.tensor(lens, device=device)
        assert runner.graph_runner.can_run(md, len(lens))
        out_graph = runner.graph_runner.run(ids, pos, md).float().clone()
        with forward_context(ref, ref.build_metadata(md), ref_pool):
            out_ref = runner.model(ids, pos).float()
    err = (out_graph - out_ref).norm() / out_ref.norm()
    assert err < 2e-2, f"relative error {err:.3e}"
    for a, b in zip(runner.kv_pool.caches, ref_pool.caches):
        assert (a.float() - b.float()).abs().max() < 5e-2


def test_mixed_step_graph_matches_eager_reference(llm):
    """A step mixing a prefill chunk after a cached context, a fresh prompt and decodes
    replays a mixed-step graph (padded rows and requests) and matches the reference."""
    from helpers.kv_pool_helpers import pool_holding

    from pagoda.attention.forward_context import forward_context
    from pagoda.attention.kv_pool import FullAttentionLayout
    from pagoda.attention.metadata import build_attention_metadata
    from pagoda.attention.torch_ref import TorchRefBackend
    from pagoda.core.kv_cache_spec import FullAttentionSpec

    runner = llm.llm_engine.executor.runner
    graphs = runner.graph_runner
    arch, device, bs = runner.arch, runner.device, 16
    ref = TorchRefBackend(
        arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, arch.head_dim**-0.5
    )
    gen = torch.Generator(device="cpu").manual_seed(1)
    contexts = [100, 33, 250, 61, 17, 90, 0]  # tokens already in the cache
    queries = [40, 1, 1, 1, 1, 1, 30]  # this step: a chunk, five decodes, a fresh prompt
    seq_lens = [c + q for c, q in zip(contexts, queries)]
    tables, nxt = [], 0
    for n in seq_lens:
        nb = -(-n // bs)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    ref_pool = pool_holding(
        runner.kv_pool.caches, {FullAttentionSpec: FullAttentionLayout(use_triton=False)}
    )
    with torch.inference_mode():
        cached = [i for i, c in enumerate(contexts) if c]
        md = build_attention_metadata(
            [contexts[i] for i in cached],
            [contexts[i] for i in cached],
            [tables[i] for i in cached],
            bs,
            device,
        )
        ids = torch.randint(0, arch.vocab_size, (sum(contexts),), generator=gen).to(device)
        pos = torch.cat([torch.arange(contexts[i]) for i in cached]).to(device)
        with forward_context(ref, ref.build_metadata(md), ref_pool):
            runner.model(ids, pos)
        for dst, src in zip(runner.kv_pool.caches, ref_pool.caches):
            dst.copy_(src)
        md = build_attention_metadata(queries, seq_lens, tables, bs, device)
        ids = torch.randint(0, arch.vocab_size, (sum(queries),), generator=gen).to(device)
        pos = torch.cat([torch.arange(c, c + q) for c, q in zip(contexts, queries)]).to(device)
        assert graphs.graph_for(sum(queries), len(queries)) == (48, 128, None)
        assert graphs.can_run(md, sum(queries))
        out_graph = graphs.run(ids, pos, md).float().clone()
        with forward_context(ref, ref.build_metadata(md), ref_pool):
            out_ref = runner.model(ids, pos).float()
    err = (out_graph - out_ref).norm() / out_ref.norm()
    assert err < 2e-2, f"relative error {err:.3e}"
    for a, b in zip(runner.kv_pool.caches, ref_pool.caches):
        assert (a.float() - b.float()).abs().max() < 5e-2


def test_padded_eager_forward_matches_unpadded(llm):
    """An eager step padded to its shape bucket (padding rows: token 0, slot -1) gives
    the real rows the same hidden states and KV as the unpadded step, and writes no KV
    for the padding rows."""
    from helpers.kv_pool_helpers import pool_holding

    from pagoda.attention.forward_context import forward_context
    from pagoda.attention.metadata import build_attention_metadata
    from pagoda.worker.shape_buckets import eager_tokens_bucket

    runner = llm.llm_engine.executor.runner
    arch, device, bs = runner.arch, runner.device, 16
    gen = torch.Generator(device="cpu").manual_seed(1)
    lens = [37, 5, 120]
    num_tokens = sum(lens)
    padded = eager_tokens_bucket(num_tokens, 16384)
    assert padded > num_tokens
    tables, nxt = [], 1  # block 0 stays unused: padding must not write there
    for n in lens:
        tables.append(list(range(nxt, nxt + -(-n // bs))))
        nxt += len(tables[-1])
    ids = torch.randint(0, arch.vocab_size, (num_tokens,), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lens])
    # Small caches of our own: the engine's pool is large, and must not be touched.
    original = [
        torch.randn(2, nxt, bs, arch.num_key_value_heads, arch.head_dim, generator=gen).to(
            device=device, dtype=runner.dtype
        )
        for _ in runner.kv_pool.caches
    ]
    results = []
    with torch.inference_mode():
        for pad_to in (None, padded):
            pool = pool_holding(original)
            md = build_attention_metadata(lens, lens, tables, bs, device, pad_to=pad_to)
            extra = (pad_to or num_tokens) - num_tokens
            step_ids = torch.cat([ids, torch.zeros(extra, dtype=ids.dtype)]).to(device)
            step_pos = torch.cat([pos, torch.zeros(extra, dtype=pos.dtype)]).to(device)
            with forward_context(runner.backend, runner.backend.build_metadata(md), pool):
                hidden = runner.model(step_ids, step_pos)
            assert hidden.shape[0] == (pad_to or num_tokens)
            results.append((hidden[:num_tokens].float(), pool.caches))
    (plain, plain_caches), (pad, pad_caches) = results
    err = (pad - plain).norm() / plain.norm()
    assert err < 1e-2, f"relative error {err:.3e}"
    for a, b, before in zip(plain_caches, pad_caches, original):
        assert (a.float() - b.float()).abs().max() < 5e-2
        assert torch.equal(b[:, 0], before[:, 0])  # block 0: untouched


def test_engine_end_to_end_on_graphs(llm):
    from pagoda import SamplingParams

    runner = llm.llm_engine.executor.runner
    assert runner.block_table is not None  # block ids live on the device between steps
    prompts = [[(i * 7 + j) % 1000 + 5 for j in range(10 + 13 * i)] for i in range(40)]
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False
    )
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
    assert set(runner.block_table.row_of) == set(runner.states)
    audit = llm.llm_engine.audit_kv_cache()
    assert audit.in_use == 0


def _mixed_params():
    """Every request runs to max_tokens (no eos), so both loops batch the same rows."""
    from pagoda import SamplingParams

    return [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(
            max_tokens=24,
            temperature=0.8,
            seed=5,
            repetition_penalty=1.2,
            frequency_penalty=0.3,
            ignore_eos=True,
        ),
        SamplingParams(max_tokens=16, temperature=0, logprobs=3, ignore_eos=True),
        SamplingParams(
            max_tokens=12,
            temperature=0.7,
            seed=9,
            top_k=50,
            top_p=0.9,
            min_tokens=6,
            prompt_logprobs=2,
            ignore_eos=True,
        ),
    ]


def test_async_step_launch_never_waits_for_the_device(llm, monkeypatch):
    """Launching a step (inputs and forward, then sampling and output copies) makes no host sync:
    torch's sync debug mode turns any synchronizing call into an error."""
    engine = llm.llm_engine
    assert engine.async_scheduling  # the CUDA default
    executor = engine.executor

    def checked(launch):
        def launch_checked(*args):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return launch(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return launch_checked

    for name in ("execute_model", "sample_tokens"):
        monkeypatch.setattr(executor, name, checked(getattr(executor, name)))
    prompts = [[(i * 11 + j) % 900 + 3 for j in range(5 + 17 * i)] for i in range(24)]
    params = _mixed_params() * 6
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert engine.audit_kv_cache().in_use == 0


def test_async_scheduling_equals_sync_on_graphs():
    """Two fresh engines (no prefix-cache history, so both compute every prompt the
    same way), KV pools sized explicitly: a profiled pool would count the module
    fixture's memory as used."""
    from pagoda import LLM

    prompts = [[(i * 13 + j) % 800 + 7 for j in range(3 + 11 * i)] for i in range(40)]
    params = _mixed_params() * 10
    results = []
    for async_scheduling in (True, False):
        engine_llm = LLM(
            "smollm2-135m",
            load_format="dummy",
            dtype="bfloat16",
            max_model_len=1024,
            max_num_seqs=48,
            kv_cache_memory=1 << 30,
            async_scheduling=async_scheduling,
        )
        assert engine_llm.llm_engine.async_scheduling is async_scheduling
        outs = engine_llm.generate(prompts, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
        del engine_llm
    assert results[0] == results[1]
