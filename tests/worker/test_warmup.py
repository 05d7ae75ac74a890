"""The start-up kernel warm-up: which batches it runs, and that they run through a model."""

from __future__ import annotations

from pagoda.worker.warmup import WIDE_PREFILL_ROWS, warm_up_kernels, warmup_batches


def test_warmup_batches_cover_every_attention_path():
    batches = warmup_batches(
        max_model_len=4096, num_blocks=2000, block_size=16, max_num_tokens=16384
    )
    assert batches == [
        ([48, 48], [48, 48]),
        ([520], [520]),
        ([4096], [4096]),
        ([4096] * 4, [4096] * 4),
        ([1, 1, 48], [600, 300, 48]),
        ([1, 1], [8, 600]),
        ([1], [8]),
    ]
    # Wide prefills only as wide as a step may be, in prompts of at most max_model_len.
    assert warmup_batches(2304, 2000, 16, max_num_tokens=512) == [
        ([48, 48], [48, 48]),
        ([512], [512]),
        ([1, 1, 48], [600, 300, 48]),
        ([1, 1], [8, 600]),
        ([1], [8]),
    ]
    assert ([2304, 1792], [2304, 1792]) in warmup_batches(2304, 2000, 16, max_num_tokens=4096)
    # No wide prefill when max_num_tokens is not given.
    assert len(warmup_batches(4096, 2000, 16)) == 4
    # Short contexts and small pools: lengths are capped, batches that do not fit are left out.
    assert warmup_batches(max_model_len=32, num_blocks=4, block_size=16) == [
        ([32, 32], [32, 32]),
        ([1, 1], [8, 32]),
        ([1], [8]),
    ]
    assert warmup_batches(max_model_len=4096, num_blocks=6, block_size=16) == [
        ([48, 48], [48, 48]),
        ([1], [8]),
    ]


def test_warm_up_runs_on_a_model_and_leaves_requests_unaffected():
    from pagoda import LLM, SamplingParams

    llm = LLM(
        "tiny-llama", load_format="dummy", device="cpu", max_model_len=256, kv_cache_memory=8 << 20
    )
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    before = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    seconds = warm_up_kernels(llm.llm_engine.executor.runner, max_model_len=256)
    assert seconds >= 0
    after = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert before == after


def test_the_wide_prefill_compiles_the_wide_rotary_store_variant():
    from pagoda.kernels.attention.qk_rope_store import default_heads_per_program

    assert default_heads_per_program(WIDE_PREFILL_ROWS) == default_heads_per_program(16384)
    assert default_heads_per_program(WIDE_PREFILL_ROWS) != default_heads_per_program(512)
