"""Graph steps' inputs built on a side stream (pagoda.worker.input_stream), with the
step outputs' copies on their own stream (pagoda.worker.step_output) and the pending
tokens filled by one kernel (kernels.sample.pending_fill).

On the CPU there is no side stream (make_input_stream gives None) and steps are built
as before. On a GPU, whole runs must give the same greedy tokens and logprobs with the
input stream as without it: more requests than max_num_seqs (they queue, so steps mix
prefill chunks, mixed graphs and decode graphs), different prompt and output lengths
(the batch shrinks, pending tokens come from every position of the last step's sampled
ids), async scheduling on. A race between the streams (the next step's inputs written
before a graph read them, or a sampled token filled in before its ids are staged)
would change tokens, as would the sampled ids' memory reused before their copy to the
host ran. The run without them has all three taken out (the test patches them off).
"""

import pytest
import torch

from pagoda.kernels.sample import pending_fill
from pagoda.worker import input_stream, model_runner, step_output

ON_GPU = torch.cuda.is_available()


def test_no_side_stream_without_graphs_or_on_the_cpu():
    assert input_stream.make_input_stream(torch.device("cpu"), True) is None
    if ON_GPU:
        assert input_stream.make_input_stream(torch.device("cuda"), False) is None
        assert input_stream.make_input_stream(torch.device("cuda"), True) is not None


def _take_out_the_side_streams(monkeypatch) -> None:
    """Inputs and output copies on the main stream, the pending fill by torch ops."""
    monkeypatch.setattr(model_runner, "make_input_stream", lambda device, has_graphs: None)
    monkeypatch.setattr(step_output, "_copy_stream", lambda device: None)
    monkeypatch.setattr(pending_fill, "MAX_KERNEL_ROWS", 0)


def _greedy(preset: str, prompts, max_tokens):
    from pagoda import LLM, SamplingParams

    llm = LLM(
        preset,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        skip_tokenizer_init=True,
        kv_cache_memory=1 << 28,
    )
    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1) for n in max_tokens
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stream = llm.llm_engine.executor.runner.input_stream
    llm.llm_engine.shutdown()
    return stream, [
        (
            o.outputs[0].token_ids,
            [max(lp.values(), key=lambda v: v.logprob).logprob for lp in o.outputs[0].logprobs],
        )
        for o in outs
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3-moe"])
def test_runs_unchanged_with_the_input_stream(monkeypatch, preset):
    prompts = [
        [11, 42, 7, 99, 3],
        [5] * 40,
        list(range(60, 90)),
        [8] * 100,
        [3, 1],
        list(range(200, 217)),
    ]
    max_tokens = [30, 12, 25, 7, 40, 18]
    stream, on = _greedy(preset, prompts, max_tokens)
    assert stream is not None
    with monkeypatch.context() as patches:
        _take_out_the_side_streams(patches)
        stream, off = _greedy(preset, prompts, max_tokens)
    assert stream is None
    assert on == off
