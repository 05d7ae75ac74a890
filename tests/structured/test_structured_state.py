"""Structured output without a model: params, the compile cache, per-request constraint
state (accept / rollback / one mask per sampled row), thinking budgets, and the
bitmask rows the engine hands the sampler (spec-decode drafts included)."""

from __future__ import annotations

import concurrent.futures
import json

import numpy as np
import pytest

from pagoda.core.outputs import SchedulerOutput
from pagoda.sampling_params import SamplingParams
from pagoda.structured.compiler import GrammarCompileError, GrammarCompiler
from pagoda.structured.grammar_state import RequestConstraint, allow, set_only
from pagoda.structured.manager import StructuredOutputManager
from pagoda.structured.params import StructuredOutputsParams as SOP
from pagoda.structured.reasoning import (
    REASONING_PARSERS,
    Phase,
    ReasoningTokens,
    ThinkingState,
    get_reasoning_parser,
)
from pagoda.structured.stats import HistogramData

VOCAB = 49152
WORDS = VOCAB // 32


def allowed(row: np.ndarray) -> set[int]:
    bits = (row.astype(np.int64)[:, None] >> np.arange(32)) & 1
    return set(np.flatnonzero(bits.reshape(-1)).tolist())


@pytest.fixture(scope="module")
def tokenizer():
    from pagoda.model.tokenizer import embedded_model_path, load_tokenizer

    return load_tokenizer(embedded_model_path())


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id])
    yield compiler
    compiler.shutdown()


def matcher_for(compiler, params: SOP, eos: int):
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiler.compile(params), override_stop_tokens=[eos])


def mask_after(compiler, params, eos, tokens) -> np.ndarray:
    matcher = matcher_for(compiler, params, eos)
    for t in tokens:
        assert matcher.accept_token(t)
    row = np.full((1, WORDS), -1, dtype=np.int32)
    matcher.fill_next_token_bitmask(row, 0)
    return row[0]


# ---- params ------------------------------------------------------------------------------


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        SOP()
    with pytest.raises(ValueError, match="exactly one"):
        SOP(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="not valid JSON"):
        SOP(json="{nope")
    with pytest.raises(ValueError, match="non-empty list"):
        SOP(choice=[])
    with pytest.raises(ValueError, match="json_object must be true"):
        SOP(json_object="yes")
    with pytest.raises(ValueError, match="unknown field.*guided_json"):
        SOP.from_dict({"guided_json": {}})
    assert SOP(json={"b": 1, "a": 2}).cache_key() == SOP(json='{"a": 2, "b": 1}').cache_key()
    assert (
        SOP(json={"a": 1}).cache_key()
        != SOP(json={"a": 1}, disable_any_whitespace=False).cache_key()
    )
    assert SOP(choice=["x"]).kind == "choice"


def test_sampling_params_refuse_what_fights_the_grammar():
    assert SamplingParams(structured_outputs={"regex": "a"}).structured_outputs == SOP(regex="a")
    with pytest.raises(ValueError, match="ignore_eos cannot be combined"):
        SamplingParams(structured_outputs=SOP(regex="a"), ignore_eos=True)
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(structured_outputs=SOP(regex="a"), min_tokens=1)
    with pytest.raises(ValueError, match="thinking_token_budget must be an integer >= 0"):
        SamplingParams(thinking_token_budget=-1)


def test_reasoning_parser_names_match_the_config():
    from pagoda.config import REASONING_PARSERS as CONFIG_NAMES

    assert set(REASONING_PARSERS) == set(CONFIG_NAMES)
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        get_reasoning_parser("r2")


# ---- compiler ----------------------------------------------------------------------------


def test_compiles_are_cached_by_kind_and_spec(compiler):
    first = compiler.submit(SOP(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    again = compiler.submit(
        SOP(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}')
    )
    assert first is again
    assert compiler.submit(SOP(regex="a+")) is not first
    first.result()


@pytest.mark.parametrize(
    "params,reason",
    [
        (SOP(json={"type": "nope"}), 'Unsupported type "nope"'),
        (SOP(json={"$ref": "#/$defs/missing"}), "missing"),
        (SOP(regex="a(b"), "parenthesis is not closed"),
        (SOP(grammar="root ::= undefined_rule"), 'Rule "undefined_rule" is not defined'),
    ],
)
def test_compile_errors_carry_the_compilers_reason(compiler, params, reason):
    with pytest.raises(GrammarCompileError) as info:
        compiler.compile(params)
    message = str(info.value)
    assert message.startswith(f"the {params.kind} constraint cannot be compiled: ")
    assert reason in message and ".cc:" not in message


def test_choice_grammar_takes_any_string(compiler, tokenizer):
    choices = ["yes", 'a "quoted" \\ word', "ünïcode\nline"]
    params = SOP(choice=choices)
    for choice in choices:
        matcher = matcher_for(compiler, params, tokenizer.eos_token_id)
        assert matcher.accept_string(choice)
        assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()
    assert not matcher_for(compiler, params, tokenizer.eos_token_id).accept_string("no")


# ---- bit helpers -------------------------------------------------------------------------


@pytest.mark.parametrize("token", [0, 31, 32, 63, VOCAB - 1])
def test_single_token_rows(token):
    rows = np.full((2, WORDS), -1, dtype=np.int32)
    set_only(rows, 1, token)
    assert allowed(rows[1]) == {token}
    allow(rows, 1, 5)
    assert allowed(rows[1]) == {token, 5}
    assert allowed(rows[0]) == set(range(VOCAB))


# ---- one request's grammar ----------------------------------------------------------------

SCHEMA = SOP(json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})


def test_accept_rollback_and_a_refused_token(compiler, tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode('{"n":12}', add_special_tokens=False)
    constraint = RequestConstraint(matcher_for(compiler, SCHEMA, eos))
    assert constraint.accept_tokens(ids[:2])
    np.testing.assert_array_equal(_row(constraint), mask_after(compiler, SCHEMA, eos, ids[:2]))
    constraint.rollback(1)
    np.testing.assert_array_equal(_row(constraint), mask_after(compiler, SCHEMA, eos, ids[:1]))
    bad = tokenizer.encode("x", add_special_tokens=False)
    assert not constraint.accept_tokens(ids[1:2] + bad)  # the good one stays accepted
    np.testing.assert_array_equal(_row(constraint), mask_after(compiler, SCHEMA, eos, ids[:2]))
    assert constraint.accept_tokens(ids[2:] + [eos]) and constraint.is_terminated
    assert not constraint.needs_row_mask()  # the request ends with this token


def _row(constraint) -> np.ndarray:
    row = np.full((1, WORDS), -1, dtype=np.int32)
    constraint.fill_row(row, 0)
    return row[0]


def test_fill_rows_gives_row_k_the_mask_after_k_drafts(compiler, tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode('{"n":345}', add_special_tokens=False)
    constraint = RequestConstraint(matcher_for(compiler, SCHEMA, eos))
    constraint.accept_tokens(ids[:1])
    drafts = ids[1:4]
    rows = np.zeros((5, WORDS), dtype=np.int32)
    constraint.fill_rows(rows, 1, drafts)
    for k in range(len(drafts) + 1):
        np.testing.assert_array_equal(rows[1 + k], mask_after(compiler, SCHEMA, eos, ids[: 1 + k]))
    assert not rows[0].any()  # untouched
    # The state is as before: the drafts were rolled back.
    np.testing.assert_array_equal(_row(constraint), mask_after(compiler, SCHEMA, eos, ids[:1]))


def test_a_refused_draft_ends_the_walk(compiler, tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode('{"n":7}', add_special_tokens=False)
    constraint = RequestConstraint(matcher_for(compiler, SCHEMA, eos))
    bad = tokenizer.encode("zz", add_special_tokens=False)[0]
    rows = np.zeros((4, WORDS), dtype=np.int32)
    constraint.fill_rows(rows, 0, [ids[0], bad, ids[1]])
    first = mask_after(compiler, SCHEMA, eos, [])
    second = mask_after(compiler, SCHEMA, eos, ids[:1])
    np.testing.assert_array_equal(rows[0], first)
    assert bad not in allowed(rows[1])
    for k in (1, 2, 3):
        np.testing.assert_array_equal(rows[k], second)
    np.testing.assert_array_equal(_row(constraint), first)


# ---- thinking ----------------------------------------------------------------------------


def _tokens(name="qwen3", end_sequence=None) -> ReasoningTokens:
    spec = get_reasoning_parser(name)
    return ReasoningTokens(spec, 8, 9, tuple(end_sequence or (9,)))


@pytest.mark.parametrize(
    "name,prompt,phase",
    [
        ("deepseek_r1", [5, 6], Phase.THINKING),
        ("deepseek_r1", [8, 7, 9, 6], Phase.ANSWER),  # the prompt closed it (thinking off)
        ("qwen3", [5, 6], Phase.PENDING),
        ("qwen3", [9, 5, 8, 6], Phase.THINKING),  # the prompt opened it
        ("qwen3", [8, 5, 9], Phase.ANSWER),
    ],
)
def test_where_the_output_starts(name, prompt, phase):
    assert ThinkingState(_tokens(name), prompt, None).phase == phase


def test_budget_forces_the_end_sequence_then_the_answer():
    state = ThinkingState(_tokens(end_sequence=(30, 9)), [8], budget=2)
    assert state.forced_token() is None
    assert state.accept(100) is False and state.accept(101) is False
    assert state.forced_token() == 30
    assert state.accept(30) is False and state.forced_token() == 9
    assert state.accept(9) is False and state.phase == Phase.ANSWER
    assert state.accept(102) is True and state.forced_token() is None
    state.rollback(2)  # back before the forced 9
    assert state.phase == Phase.THINKING and state.forced_token() == 9
    assert state.num_reasoning_tokens == 2


def test_the_models_own_end_tag_ends_thinking_before_the_budget():
    state = ThinkingState(_tokens(), [], budget=10)
    assert state.accept(8) is False and state.phase == Phase.THINKING
    assert state.accept(50) is False and state.accept(9) is False
    assert state.phase == Phase.ANSWER and state.num_reasoning_tokens == 1


def test_grammar_starts_after_thinking(compiler, tokenizer):
    eos = tokenizer.eos_token_id
    tokens = ReasoningTokens(get_reasoning_parser("qwen3"), 8, 9, (9,))
    constraint = RequestConstraint(
        matcher_for(compiler, SCHEMA, eos), ThinkingState(tokens, [], budget=1)
    )
    grammar_first = mask_after(compiler, SCHEMA, eos, [])
    # Pending: the grammar's first tokens, or the start tag.
    assert allowed(_row(constraint)) == allowed(grammar_first) | {8}
    assert constraint.accept_tokens([8])
    assert not constraint.needs_row_mask()  # thinking freely
    assert constraint.accept_tokens([4000])  # not JSON: the grammar does not see it
    assert allowed(_row(constraint)) == {9}  # the budget is spent
    assert constraint.accept_tokens([9])
    np.testing.assert_array_equal(_row(constraint), grammar_first)
    ids = tokenizer.encode('{"n":1}', add_special_tokens=False)
    assert constraint.accept_tokens(ids)
    constraint.rollback(len(ids) + 1)  # back across the end tag
    assert allowed(_row(constraint)) == {9}


# ---- the manager's step bitmasks ---------------------------------------------------------


def _params(**kwargs) -> SamplingParams:
    params = SamplingParams(**kwargs)
    params.all_stop_token_ids = {2}
    return params


def _step(sampling: set[str], drafts: dict[str, list[int]]) -> SchedulerOutput:
    return SchedulerOutput(
        [],
        [],
        {r: 1 + len(drafts.get(r, [])) for r in sampling},
        sum(1 + len(drafts.get(r, [])) for r in sampling),
        scheduled_spec_decode_tokens=drafts,
        sampling_req_ids=set(sampling),
    )


def test_step_bitmasks_give_every_sampled_row_a_mask(tokenizer):
    manager = StructuredOutputManager(tokenizer, VOCAB)
    ids = tokenizer.encode('{"n":42}', add_special_tokens=False)
    manager.compiler().compile(SCHEMA)  # compiled: the requests are ready at once
    for req_id in ("a", "b", "c"):
        assert manager.add_request(req_id, _params(structured_outputs=SCHEMA), [1]) is True
    assert all(manager.accept(r, ids[:1]) is None for r in ("a", "b"))
    masks = manager.step_bitmasks(_step({"a", "b"}, {"b": ids[1:3]}))
    assert set(masks) == {"a", "b"}  # c does not sample this step
    assert masks["a"].shape == (1, WORDS) and masks["b"].shape == (3, WORDS)
    compiler = manager.compiler()
    for k in range(3):
        np.testing.assert_array_equal(masks["b"][k], mask_after(compiler, SCHEMA, 2, ids[: 1 + k]))
    np.testing.assert_array_equal(masks["a"][0], mask_after(compiler, SCHEMA, 2, ids[:1]))
    assert "refused" in manager.accept("c", tokenizer.encode("no", add_special_tokens=False))
    snapshot = manager.stats.snapshot()
    assert snapshot.requests_by_kind == {"json": 3} and snapshot.bitmask_seconds.count == 1
    assert snapshot.compile_seconds.count == 1
    manager.shutdown()


def test_a_request_waits_for_its_compile(tokenizer, monkeypatch):
    manager = StructuredOutputManager(tokenizer, VOCAB)
    woken = []
    manager.on_ready = lambda: woken.append(True)
    future: concurrent.futures.Future = concurrent.futures.Future()
    monkeypatch.setattr(manager.compiler(), "submit", lambda params: future)
    assert manager.add_request("r", _params(structured_outputs=SOP(regex="a")), [1]) is False
    assert manager.num_pending == 1 and not manager.has_ready_pending()
    assert manager.pop_ready() == [] and not woken
    future.set_exception(GrammarCompileError("the regex constraint cannot be compiled: no"))
    assert woken == [True] and manager.has_ready_pending()
    assert manager.pop_ready() == [("r", "the regex constraint cannot be compiled: no")]
    assert manager.num_pending == 0 and "r" not in manager


def test_budget_without_a_reasoning_parser_is_refused(tokenizer):
    manager = StructuredOutputManager(tokenizer, VOCAB)
    with pytest.raises(ValueError, match="needs a reasoning parser"):
        manager.check_params(_params(thinking_token_budget=3))
    with pytest.raises(ValueError, match="needs 'Hmm' to be one token"):
        ReasoningTokens.from_tokenizer(
            type(get_reasoning_parser("qwen3"))("x", "Hmm", "</think>", False), tokenizer
        )


def test_histogram_is_cumulative():
    data = HistogramData((0.1, 1.0))
    for value in (0.05, 0.5, 0.5, 3.0):
        data.observe(value)
    assert data.cumulative() == [("0.1", 1), ("1.0", 3), ("+Inf", 4)]
    assert data.count == 4 and data.total == pytest.approx(4.05)
    assert json.loads(json.dumps(data.counts)) == [1, 2, 1]


def test_the_engine_default_budget_applies_to_requests_without_one(tmp_path):
    from helpers.think_tokenizer import make_think_tokenizer

    from pagoda.config import EngineArgs, StructuredOutputsConfig
    from pagoda.model.tokenizer import load_tokenizer

    with pytest.raises(ValueError, match="thinking_token_budget needs a reasoning_parser"):
        StructuredOutputsConfig(thinking_token_budget=3)
    config = (
        EngineArgs(reasoning_parser="qwen3", thinking_token_budget=7, device="cpu")
        .create_engine_config()
        .structured_outputs
    )
    assert (config.reasoning_parser, config.thinking_token_budget) == ("qwen3", 7)
    tokenizer = load_tokenizer(make_think_tokenizer(tmp_path))
    manager = StructuredOutputManager(tokenizer, VOCAB, "qwen3", default_thinking_token_budget=7)
    assert (manager.reasoning.start_id, manager.reasoning.end_id) == (8, 9)
    assert manager.wants(_params()) and manager.thinking_budget(_params()) == 7
    assert manager.thinking_budget(_params(thinking_token_budget=2)) == 2
    assert manager.add_request("r", _params(), [8]) is True  # no grammar: ready at once
    masks = manager.step_bitmasks(_step({"r"}, {}))
    assert masks == {}  # thinking freely: no row to mask
    for token in range(7):
        assert manager.accept("r", [100 + token]) is None
    assert allowed(manager.step_bitmasks(_step({"r"}, {}))["r"][0]) == {9}
