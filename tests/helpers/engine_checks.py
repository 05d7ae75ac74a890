"""Engine checks shared by the engine, model and speculative decoding tests: greedy
parameters, deterministic word prompts and the KV audit after every request ends."""

from __future__ import annotations

from pagoda import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def make_prompts(tokenizer, count: int) -> list[list[int]]:
    words = (
        "river mountain garden kernel tensor violin harbor lantern meadow comet "
        "orchard pepper silver thunder window yellow"
    ).split()
    prompts = []
    for i in range(count):
        length = 3 + (i * 7) % 45  # 3 .. 47 tokens
        text = " ".join(words[(i + j) % len(words)] for j in range(length))
        prompts.append(tokenizer(f"{i}: {text}").input_ids[:length])
    return prompts


def assert_all_blocks_free(llm: LLM) -> None:
    audit = llm.llm_engine.audit_kv_cache()
    assert audit.in_use == 0
    assert audit.free + audit.cached == audit.total
