"""pagoda.kernels.pdl: programmatic dependent launch of the decode kernels.

On the CPU (and wherever it is off) a launch gets USE_PDL=False and no launch_pdl, so
the kernels compile and run exactly as before. On a Hopper GPU, whole models (the
tiny Qwen3-MoE and Llama presets, CUDA graphs and eager steps) must give the same
greedy tokens and logprobs with PDL on as with it off: every participating kernel waits
for its predecessor before touching memory, so nothing may change but the timing.
"""

import pytest
import torch

from pagoda.kernels import pdl

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_off_by_default_and_never_on_the_cpu(monkeypatch):
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", True)
    # The interpreter cannot run griddepcontrol: the CPU never gets the flag.
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", False)
    if torch.cuda.is_available():
        assert pdl.launch_options(torch.device("cuda")) == {"USE_PDL": False}


@pytest.mark.skipif(not SM90, reason="PDL needs a CUDA GPU of compute capability 9.0+")
def test_on_sm90_the_wait_comes_with_the_launch_flag(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.launch_options(torch.device("cuda")) == {"USE_PDL": True, "launch_pdl": True}


def _greedy(preset: str, prompts, enforce_eager: bool):
    from pagoda import LLM, SamplingParams
    llm = LLM(preset, load_format="dummy", dtype="bfloat16", max_model_len=256,
              max_num_seqs=8, skip_tokenizer_init=True, enforce_eager=enforce_eager,
              kv_cache_memory=1 << 28)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                       logprobs=1), use_tqdm=False)
    llm.llm_engine.shutdown()
    return [(o.outputs[0].token_ids, [max(lp.values(), key=lambda v: v.logprob).logprob
                                      for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.skipif(not SM90, reason="PDL needs a CUDA GPU of compute capability 9.0+")
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-llama"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_models_unchanged_with_pdl(monkeypatch, preset, enforce_eager):
    prompts = [[11, 42, 7, 99, 3], [5] * 40, list(range(60, 90))]
    monkeypatch.setattr(pdl, "ENABLED", False)
    off = _greedy(preset, prompts, enforce_eager)
    monkeypatch.setattr(pdl, "ENABLED", True)
    on = _greedy(preset, prompts, enforce_eager)
    assert on == off
    monkeypatch.setattr(pdl, "PREFETCH_WEIGHTS", True)  # the GEMVs' L2 prefetch too
    assert _greedy(preset, prompts, enforce_eager) == off


def test_weight_prefetch_needs_pdl_and_16_byte_slabs(monkeypatch):
    """prefetch_bytes: 0 unless PREFETCH_WEIGHTS and PDL are active and every slab of a
    GEMV's weight (its start, row stride, row length and K slice) is on 16-byte
    boundaries."""
    w = torch.empty(64, 256, dtype=torch.bfloat16)
    monkeypatch.setattr(pdl, "active", lambda device: True)
    monkeypatch.setattr(pdl, "PREFETCH_WEIGHTS", False)
    assert pdl.prefetch_bytes(w, 128, 4, 16) == 0
    monkeypatch.setattr(pdl, "PREFETCH_WEIGHTS", True)
    assert pdl.prefetch_bytes(w, 128, 4, 16) == 256  # the whole 128-column slice
    assert pdl.prefetch_bytes(w, 4, 4, 16) == 0  # 8-byte K slices
    assert pdl.prefetch_bytes(w[:, 4:], 128, 4, 16) == 0  # rows start 8 bytes in
    assert pdl.prefetch_bytes(torch.empty(64, 260, dtype=torch.bfloat16)[:, :256], 128, 4,
                              16) == 0
    assert pdl.prefetch_bytes(torch.empty(64, 36, dtype=torch.float8_e4m3fn), 32, 4, 16) == 0
    monkeypatch.setattr(pdl, "active", lambda device: False)
    assert pdl.prefetch_bytes(w, 128, 4, 16) == 0


def test_weight_prefetch_stays_within_the_budget(monkeypatch):
    """The programs resident at once (8 an SM; the CPU counts 4 SMs) ask for at most
    PREFETCH_BUDGET_BYTES together, in 16-byte multiples per row."""
    w = torch.empty(4096, 8192, dtype=torch.float8_e4m3fn)
    monkeypatch.setattr(pdl, "active", lambda device: True)
    monkeypatch.setattr(pdl, "PREFETCH_WEIGHTS", True)
    monkeypatch.setattr(pdl, "PREFETCH_BUDGET_BYTES", 1 << 20)
    # 256 programs, 32 resident on 4 SMs, 16 rows each: 2048 bytes a row of 8192
    assert pdl.prefetch_bytes(w, 8192, 256, 16) == 2048
    # 10 programs, all resident: 1 MiB / 160 rows = 6553.6 -> 6544
    assert pdl.prefetch_bytes(w, 8192, 10, 16) == 6544
    assert pdl.prefetch_bytes(w, 4096, 10, 16) == 4096  # capped by the slice itself
    monkeypatch.setattr(pdl, "PREFETCH_BUDGET_BYTES", 100)
    assert pdl.prefetch_bytes(w, 8192, 10, 16) == 0  # under 16 bytes a row: none


@pytest.mark.skipif(not SM90, reason="PDL needs a CUDA GPU of compute capability 9.0+")
def test_gemvs_give_the_same_bits_with_the_weight_prefetch(monkeypatch):
    from pagoda.kernels import fp8_linear, gemv
    from pagoda.kernels.fp8_quant import quantize_weight_per_channel
    monkeypatch.setattr(pdl, "ENABLED", True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 2048, device="cuda", generator=gen).bfloat16()
    w = torch.randn(5120, 2048, device="cuda", generator=gen).bfloat16() * 0.02
    w8, s8 = quantize_weight_per_channel(w[:3072])
    outs = {}
    for prefetch in (False, True):
        monkeypatch.setattr(pdl, "PREFETCH_WEIGHTS", prefetch)
        outs[prefetch] = (gemv.gemv(x, w), fp8_linear.fp8_linear(x, w8, s8),
                          fp8_linear.fp8_linear_silu_and_mul(x, w8, s8))
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a, b)
