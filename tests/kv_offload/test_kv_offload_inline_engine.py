"""Inline KV loads through the whole engine on CPU (tiny random Llama): a revisited turn
whose prefix went down to the CPU tier gets its first token as many engine steps after
its arrival as a request that needs no load, two steps fewer than when it waits for
the load's report (one fewer with synchronous scheduling), and the outputs are the same
with inline loads, with asynchronous loads only, and with offloading off."""

import random

import pytest

from pagoda.entrypoints.llm import LLM
from pagoda.sampling_params import SamplingParams

GIB = 1 << 30
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers x (k, v) x block x kv heads x head_dim x fp32
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from helpers.tiny_models import save_tiny_hf_model

    path = tmp_path_factory.mktemp("kv-inline-llama")
    save_tiny_hf_model(path, "llama")
    return str(path)


def run_revisit(path, mode: str, async_scheduling: bool):
    """mode: "inline", "async" (inline loads off) or "off" (no offloading). A 70-token
    conversation is pushed down to the CPU tier, then its next turn arrives while another
    request decodes. Returns (steps from its arrival to its first token, its tokens, the
    other request's tokens, CPU tier hits)."""
    rng = random.Random(5)
    history = [rng.randrange(3, 384) for _ in range(70)]
    flush = [[rng.randrange(3, 384) for _ in range(150)] for _ in range(2)]
    offload = (
        {}
        if mode == "off"
        else dict(kv_offloading_size=32 * BLOCK_BYTES / GIB, kv_offloading_bandwidth="cpu=inf")
    )
    llm = LLM(
        path,
        skip_tokenizer_init=True,
        device="cpu",
        num_gpu_blocks_override=12,
        max_model_len=256,
        async_scheduling=async_scheduling,
        **offload,
    )
    engine = llm.llm_engine
    try:
        if mode == "async":
            engine.kv_offload.max_inline_blocks_per_step = 0
        reply = llm.generate([{"prompt_token_ids": history}], GREEDY, use_tqdm=False)[0]
        for prompt in flush:  # each takes the whole pool: the history's blocks go down
            llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
        engine.add_request(
            "bg",
            {"prompt_token_ids": [rng.randrange(3, 384) for _ in range(20)]},
            SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        )
        for _ in range(3):
            engine.step()
        turn = (
            history + list(reply.outputs[0].token_ids) + [rng.randrange(3, 384) for _ in range(10)]
        )
        engine.add_request("rev", {"prompt_token_ids": turn}, GREEDY)
        steps, first, final = 0, None, {}
        while engine.has_unfinished_requests():
            steps += 1
            for out in engine.step():
                final[out.request_id] = list(out.outputs[0].token_ids)
                if out.request_id == "rev" and out.outputs[0].token_ids and first is None:
                    first = steps
        engine.audit_kv_cache()
        hits = (
            None
            if mode == "off"
            else next(t for t in engine.get_stats().kv_offload if t["tier"] == "cpu")["hits"]
        )
        return first, final["rev"], final["bg"], hits
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async-scheduling"])
def test_a_revisit_loaded_inline_gets_its_first_token_steps_earlier(tiny_llama, async_scheduling):
    off = run_revisit(tiny_llama, "off", async_scheduling)
    inline = run_revisit(tiny_llama, "inline", async_scheduling)
    waited = run_revisit(tiny_llama, "async", async_scheduling)
    assert inline[1:3] == waited[1:3] == off[1:3]  # the same tokens, both requests
    assert inline[3] == waited[3] == 4  # the history's 4 full blocks came from the CPU tier
    # Steps to the first token: scheduled in its arrival step (plus one with async
    # scheduling, which hands a step's tokens out during the next step), like a
    # recompute; waiting for the report costs a step, and with async scheduling the
    # report itself arrives a step late.
    first = 2 if async_scheduling else 1
    assert (off[0], inline[0], waited[0]) == (first, first, first + (2 if async_scheduling else 1))
