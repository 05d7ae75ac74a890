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


