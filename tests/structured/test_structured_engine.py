"""Structured output through the offline engine on the embedded SmolLM2 (CPU): 32 JSON
schemas at temperature 0 and 1 all parse and validate, regex / choice / EBNF /
json_object, a compile failure fails only its request, a request waits (unscheduled)
for its grammar, and thinking budgets hold to the token, with the grammar starting
after </think>, under async scheduling too."""

from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import pytest
from helpers.structured_schemas import SCHEMAS
from helpers.think_tokenizer import END_THINK_ID, THINK_ID, make_think_tokenizer

from pagoda.entrypoints.llm import LLM
from pagoda.sampling_params import SamplingParams
from pagoda.structured.params import StructuredOutputsParams as SOP

ASK_JSON = [{"role": "user", "content": "Answer in JSON."}]
# After "<think>\n" the model's first token for this prompt is not eos (at temperature 0).
ASK_PERSON = [{"role": "user", "content": "Give me a JSON person."}]


@pytest.fixture(scope="module")
def llm():
    with LLM(device="cpu", max_model_len=512) as llm:
        yield llm


@pytest.fixture(scope="module")
def think_llm(tmp_path_factory):
    """The same model with a tokenizer that has <think> tags, qwen3 parsing, async scheduling."""
    tokenizer = make_think_tokenizer(tmp_path_factory.mktemp("think-tokenizer"))
    with LLM(
        device="cpu",
        max_model_len=512,
        tokenizer=str(tokenizer),
        reasoning_parser="qwen3",
        async_scheduling=True,
    ) as llm:
        yield llm


def test_every_schema_validates_at_temperature_0_and_1(llm):
    params = [
        SamplingParams(temperature=t, seed=i, max_tokens=64, structured_outputs=SOP(json=s))
        for t in (0.0, 1.0)
        for i, s in enumerate(SCHEMAS)
    ]
    outputs = llm.chat([ASK_JSON] * len(params), params, use_tqdm=False)
    assert len(outputs) == 64
    for p, out in zip(params, outputs):
        completion = out.outputs[0]
        assert out.error is None and completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), p.structured_outputs.json)
    stats = llm.llm_engine.get_stats().structured
    assert stats.requests_by_kind["json"] >= 64 and stats.compile_seconds.count >= len(SCHEMAS)


def test_regex_choice_grammar_and_json_object(llm):
    cases = [
        (SOP(regex=r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        (SOP(choice=["red", "green", "blue"]), lambda t: t in ("red", "green", "blue")),
        (
            SOP(grammar='root ::= "yes" | "no" | "maybe " [0-9]'),
            lambda t: re.fullmatch(r"yes|no|maybe [0-9]", t),
        ),
        (SOP(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    params = [
        SamplingParams(temperature=t, seed=3, max_tokens=48, structured_outputs=s)
        for t in (0.0, 1.0)
        for s, _ in cases
    ]
    outputs = llm.generate(["Answer: "] * len(params), params, use_tqdm=False)
    for (_, check), out in zip(cases * 2, outputs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop" and check(completion.text), completion.text


def test_each_of_n_samples_has_its_own_grammar_state(llm):
    (out,) = llm.generate(
        "Pick: ",
        SamplingParams(
            n=3, temperature=1.0, seed=11, max_tokens=16, structured_outputs=SOP(regex="(ab|cd){2}")
        ),
        use_tqdm=False,
    )
    assert len(out.outputs) == 3
    assert all(
        re.fullmatch("(ab|cd){2}", c.text) and c.finish_reason == "stop" for c in out.outputs
    )


def test_a_compile_failure_fails_only_its_request(llm):
    params = [
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=SOP(json={"type": "nope"})),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=SOP(choice=["ok"])),
    ]
    bad, good = llm.generate(["A", "B"], params, use_tqdm=False)
    assert bad.error == 'the json constraint cannot be compiled: Unsupported type "nope"'
    assert bad.outputs[0].finish_reason == "error"
    assert good.error is None and good.outputs[0].text == "ok"


def test_a_request_waits_for_its_grammar_unscheduled(llm, monkeypatch):
    engine = llm.llm_engine
    compiler = engine.structured.compiler()
    compiled = compiler.compile(SOP(choice=["yes"]))
    future: concurrent.futures.Future = concurrent.futures.Future()
    monkeypatch.setattr(compiler, "submit", lambda params: future)
    request_id = engine.add_request(
        None,
        "Q",
        SamplingParams(temperature=0, max_tokens=4, structured_outputs=SOP(choice=["yes"])),
    )
    assert engine.has_unfinished_requests() and not engine.has_work()
    assert engine.scheduler.get_request(request_id) is None  # held, not scheduled
    future.set_result(compiled)
    assert engine.has_work()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.outputs[0].text for o in outputs if o.finished] == ["yes"]


def test_thinking_budget_without_a_reasoning_parser_is_refused(llm):
    with pytest.raises(ValueError, match="needs a reasoning parser"):
        llm.generate("x", SamplingParams(thinking_token_budget=4), use_tqdm=False)


SCHEMA = SCHEMAS[0]


def test_thinking_budget_holds_to_the_token_then_the_grammar_answers(think_llm):
    budgets = [0, 3, 6, 6, 6]
    params = [
        SamplingParams(
            temperature=0.0 if i < 3 else 1.0,
            seed=i,
            max_tokens=48,
            thinking_token_budget=b,
            structured_outputs=SOP(json=SCHEMA),
        )
        for i, b in enumerate(budgets)
    ]
    outputs = think_llm.chat(
        [ASK_PERSON] * len(params),
        params,
        use_tqdm=False,
        chat_template_kwargs={"enable_thinking": True},
    )
    for budget, out in zip(budgets, outputs):
        ids = out.outputs[0].token_ids
        if ids == [think_llm.llm_engine.eos_token_id]:
            continue  # the model may end while thinking (eos is not masked there)
        assert END_THINK_ID not in ids[:budget] and ids[budget] == END_THINK_ID, ids
        answer = think_llm.get_tokenizer().decode(ids[budget + 1 :], skip_special_tokens=True)
        jsonschema.validate(json.loads(answer), SCHEMA)
    assert all(len(o.outputs[0].token_ids) > budget + 2 for budget, o in zip(budgets[:3], outputs))


def test_budget_without_a_grammar_and_unconstrained_thinking(think_llm):
    free, budgeted = think_llm.chat(
        [ASK_PERSON] * 2,
        [
            SamplingParams(temperature=0, max_tokens=12),
            SamplingParams(temperature=0, max_tokens=12, thinking_token_budget=4),
        ],
        use_tqdm=False,
        chat_template_kwargs={"enable_thinking": True},
    )
    assert END_THINK_ID not in free.outputs[0].token_ids  # nothing forces it
    ids = budgeted.outputs[0].token_ids
    assert ids[:4] == free.outputs[0].token_ids[:4] and ids[4] == END_THINK_ID


def test_async_masks_match_sync_masks(llm, think_llm):
    """The async engine fills step N's masks after accepting step N-1's token: greedy
    constrained outputs equal the sync engine's. (The prompt ends with </think>, so the
    qwen3 parser starts in the answer and both engines use the same grammar.)"""
    tokenizer = llm.get_tokenizer()
    prompt = {
        "prompt_token_ids": tokenizer.encode("Answer in JSON:", add_special_tokens=False)
        + [THINK_ID, END_THINK_ID]
    }
    params = [
        SamplingParams(temperature=0, max_tokens=48, structured_outputs=SOP(json=s))
        for s in SCHEMAS[:8]
    ]
    sync = llm.generate([prompt] * 8, params, use_tqdm=False)
    async_ = think_llm.generate([prompt] * 8, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in async_] == [o.outputs[0].token_ids for o in sync]
    assert all(o.outputs[0].finish_reason == "stop" for o in async_)


def test_the_async_loop_sleeps_until_a_grammar_is_ready(llm, monkeypatch):
    """A held request gives the AsyncEngine's loop nothing to do: it takes no step (no
    spinning) until the compile ends and wakes it."""
    import asyncio

    from pagoda.engine.async_engine import AsyncEngine

    engine = llm.llm_engine
    monkeypatch.setattr(engine, "shutdown", lambda: None)  # the module's engine lives on
    compiler = engine.structured.compiler()
    compiled = compiler.compile(SOP(choice=["late"]))
    future: concurrent.futures.Future = concurrent.futures.Future()
    monkeypatch.setattr(compiler, "submit", lambda params: future)
    steps = []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: steps.append(1) or step())

    async def scenario():
        client = AsyncEngine(lambda: engine)
        client.start()
        await client.wait_ready()
        params = SamplingParams(
            temperature=0, max_tokens=4, structured_outputs=SOP(choice=["late"])
        )

        async def consume():
            return [o async for o in client.generate("Q", params, "held-1")]

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0)  # yield once: the task runs up to posting its request
        # Two round trips through the loop: a loop with work would step between them.
        assert await client.call_in_loop(lambda e: e.has_unfinished_requests() and not e.has_work())
        assert await client.call_in_loop(lambda e: len(steps)) == 0
        future.set_result(compiled)
        outputs = await task
        await client.shutdown()
        return outputs

    outputs = asyncio.run(scenario())
    assert "".join(o.outputs[0].text for o in outputs) == "late" and steps
