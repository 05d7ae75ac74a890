"""Tests for pagoda.engine.output_processor: output kinds, n > 1, stop strings, logprobs, timing."""

from __future__ import annotations

import pytest

from pagoda.core.outputs import EngineCoreOutput, TokenLogprobs
from pagoda.engine.output_processor import OutputProcessor
from pagoda.model.tokenizer import embedded_model_path, load_tokenizer
from pagoda.outputs import Logprob
from pagoda.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(embedded_model_path())


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def proc(tok, clock):
    return OutputProcessor(tok, clock=clock)


PROMPT = "Tell me a story"


def add(proc, tok, request_id="r", kind="cumulative", **params):
    sampling = SamplingParams(**params)
    child_ids = [f"{request_id}-{i}" for i in range(sampling.n)]
    proc.add_request(
        request_id, PROMPT, tok.encode(PROMPT), sampling, output_kind=kind, child_ids=child_ids
    )
    return child_ids


def out(child, ids, finish=None, stop_reason=None, **kw):
    return EngineCoreOutput(
        req_id=child, new_token_ids=list(ids), finish_reason=finish, stop_reason=stop_reason, **kw
    )


def chunks(tok, text, sizes):
    ids = tok.encode(text)
    result, start = [], 0
    for size in sizes:
        result.append(ids[start : start + size])
        start += size
    assert start == len(ids), f"{text!r} has {len(ids)} tokens"
    return result


def test_cumulative_outputs_carry_everything(proc, tok):
    (child,) = add(proc, tok, max_tokens=4)
    first, second = chunks(tok, "Once upon a time", [2, 2])
    outputs, aborts = proc.process_outputs([out(child, first)])
    assert aborts == []
    [ro] = outputs
    assert ro.request_id == "r" and ro.prompt == PROMPT and not ro.finished
    assert ro.outputs[0].text == "Once upon" and ro.outputs[0].token_ids == first
    outputs, _ = proc.process_outputs([out(child, second, finish="length")])
    [ro] = outputs
    assert ro.finished
    completion = ro.outputs[0]
    assert completion.index == 0 and completion.text == "Once upon a time"
    assert completion.token_ids == first + second
    assert completion.finish_reason == "length" and completion.stop_reason is None
    assert not proc.has_unfinished()


def test_delta_outputs_carry_only_new_text_and_tokens(proc, tok):
    (child,) = add(proc, tok, kind="delta")
    steps = chunks(tok, "Once upon a time 🎉 there", [1, 2, 2, 1, 1, 1])
    texts, tokens = [], []
    for i, ids in enumerate(steps):
        last = i == len(steps) - 1
        outputs, _ = proc.process_outputs([out(child, ids, finish="length" if last else None)])
        [ro] = outputs
        assert ro.finished == last
        texts.append(ro.outputs[0].text)
        tokens.append(ro.outputs[0].token_ids)
    assert tokens == steps
    assert "".join(texts) == "Once upon a time 🎉 there"
    assert texts[0] == "Once"


def test_final_only_emits_once(proc, tok):
    (child,) = add(proc, tok, kind="final_only")
    first, second = chunks(tok, "Once upon a time", [3, 1])
    assert proc.process_outputs([out(child, first)]) == ([], [])
    outputs, _ = proc.process_outputs([out(child, second, finish="length")])
    [ro] = outputs
    assert ro.finished and ro.outputs[0].text == "Once upon a time"
    assert ro.outputs[0].token_ids == first + second


def test_empty_step_emits_nothing(proc, tok):
    (child,) = add(proc, tok)
    assert proc.process_outputs([out(child, [])]) == ([], [])


def test_n2_aggregation_cumulative(proc, tok):
    children = add(proc, tok, n=2)
    a1, a2 = chunks(tok, "Alpha beta", [1, 1])
    b1, b2 = chunks(tok, "Gamma delta", [1, 2])
    outputs, _ = proc.process_outputs([out(children[1], b1), out(children[0], a1)])
    [ro] = outputs
    assert [c.index for c in ro.outputs] == [0, 1]
    assert [c.text for c in ro.outputs] == ["Alpha", "G"]
    outputs, _ = proc.process_outputs([out(children[0], a2, finish="length")])
    [ro] = outputs
    assert not ro.finished
    assert [c.finish_reason for c in ro.outputs] == ["length", None]
    outputs, _ = proc.process_outputs([out(children[1], b2, finish="length")])
    [ro] = outputs
    assert ro.finished
    assert [c.text for c in ro.outputs] == ["Alpha beta", "Gamma delta"]
    assert ro.metrics["num_generation_tokens"] == 5
    assert not proc.has_unfinished()


def test_n2_delta_sends_only_changed_samples(proc, tok):
    children = add(proc, tok, n=2, kind="delta")
    a1, a2 = chunks(tok, "Alpha beta", [1, 1])
    outputs, _ = proc.process_outputs([out(children[0], a1)])
    assert [(c.index, c.text) for c in outputs[0].outputs] == [(0, "Alpha")]
    outputs, _ = proc.process_outputs([out(children[1], a1), out(children[0], a2, finish="length")])
    assert [(c.index, c.text, c.finish_reason) for c in outputs[0].outputs] == [
        (0, " beta", "length"),
        (1, "Alpha", None),
    ]
    assert not outputs[0].finished


def test_n2_final_only_waits_for_all_samples(proc, tok):
    children = add(proc, tok, n=2, kind="final_only")
    ids = tok.encode("Hi")
    assert proc.process_outputs([out(children[0], ids, finish="length")]) == ([], [])
    outputs, _ = proc.process_outputs([out(children[1], ids, finish="length")])
    assert outputs[0].finished and [c.index for c in outputs[0].outputs] == [0, 1]


def test_stop_string_returns_abort_ids(proc, tok):
    children = add(proc, tok, n=2, stop=["world"])
    ids = tok.encode("Hello world again")
    outputs, aborts = proc.process_outputs([out(children[0], ids), out(children[1], ids[:1])])
    assert aborts == [children[0]]
    [ro] = outputs
    first = ro.outputs[0]
    assert first.text == "Hello " and first.finish_reason == "stop" and first.stop_reason == "world"
    assert ro.outputs[1].finish_reason is None and not ro.finished
    # The scheduler's abort echo for the stopped child is ignored; the request keeps going.
    outputs, aborts = proc.process_outputs([out(children[0], [], finish="abort")])
    assert outputs == [] and aborts == []
    outputs, _ = proc.process_outputs([out(children[1], tok.encode(" there"), finish="length")])
    assert outputs[0].finished
    assert [c.finish_reason for c in outputs[0].outputs] == ["stop", "length"]


def test_stop_string_in_the_step_the_core_finished_is_not_aborted(proc, tok):
    (child,) = add(proc, tok, stop=["world"])
    outputs, aborts = proc.process_outputs([out(child, tok.encode("Hello world"), finish="length")])
    assert aborts == []
    assert outputs[0].outputs[0].finish_reason == "stop"
    assert outputs[0].outputs[0].stop_reason == "world"


def test_delta_stream_holds_back_partial_stop_string(proc, tok):
    (child,) = add(proc, tok, kind="delta", stop=["STOP"])
    ids = tok.encode("Keep ST going STOP now")
    streamed = ""
    for _i, token_id in enumerate(ids):
        outputs, aborts = proc.process_outputs([out(child, [token_id])])
        if not outputs:
            continue
        streamed += outputs[0].outputs[0].text
        assert "Keep ST going ".startswith(streamed)
        if aborts:
            break
    assert streamed == "Keep ST going "
    assert aborts == [child]


def test_eos_finish_excludes_eos_text(proc, tok):
    (child,) = add(proc, tok, skip_special_tokens=False)
    ids = tok.encode("Bye") + [tok.eos_token_id]
    outputs, _ = proc.process_outputs(
        [out(child, ids, finish="stop", stop_reason=tok.eos_token_id)]
    )
    completion = outputs[0].outputs[0]
    assert completion.text == "Bye" and completion.token_ids == ids
    assert completion.finish_reason == "stop" and completion.stop_reason == tok.eos_token_id


def test_logprob_conversion(proc, tok):
    (child,) = add(proc, tok, logprobs=2)
    hello, world = tok.encode("Hello world")
    other = tok.encode(" there")[0]
    step1 = TokenLogprobs(
        token_ids=[hello, hello, other], logprobs=[-0.5, -0.5, -1.5], sampled_rank=1
    )
    step2 = TokenLogprobs(
        token_ids=[world, other, hello], logprobs=[-2.0, -0.25, -1.0], sampled_rank=3
    )
    proc.process_outputs([out(child, [hello], new_logprobs=[step1])])
    outputs, _ = proc.process_outputs([out(child, [world], finish="length", new_logprobs=[step2])])
    completion = outputs[0].outputs[0]
    assert completion.logprobs == [
        {hello: Logprob(-0.5, 1, "Hello"), other: Logprob(-1.5, 2, " there")},
        {
            world: Logprob(-2.0, 3, " world"),
            other: Logprob(-0.25, 1, " there"),
            hello: Logprob(-1.0, 2, "Hello"),
        },
    ]
    assert list(completion.logprobs[1]) == [world, other, hello]  # chosen token first
    assert completion.cumulative_logprob == -2.5


def test_logprobs_absent_when_not_requested(proc, tok):
    (child,) = add(proc, tok)
    outputs, _ = proc.process_outputs([out(child, tok.encode("Hi"), finish="length")])
    assert (
        outputs[0].outputs[0].logprobs is None and outputs[0].outputs[0].cumulative_logprob is None
    )


def test_delta_logprobs_are_sliced(proc, tok):
    (child,) = add(proc, tok, kind="delta", logprobs=0)
    a, b = tok.encode("Hello world")
    proc.process_outputs([out(child, [a], new_logprobs=[TokenLogprobs([a], [-1.0], 4)])])
    outputs, _ = proc.process_outputs(
        [out(child, [b], new_logprobs=[TokenLogprobs([b], [-0.5], 1)])]
    )
    completion = outputs[0].outputs[0]
    assert completion.logprobs == [{b: Logprob(-0.5, 1, " world")}]
    assert completion.cumulative_logprob == -1.5


def test_prompt_logprobs_arrive_in_chunks_and_start_with_none(proc, tok):
    prompt_ids = tok.encode(PROMPT)
    assert len(prompt_ids) == 4
    (child,) = add(proc, tok, kind="delta", prompt_logprobs=0)
    chunk1 = [TokenLogprobs([prompt_ids[1]], [-3.0], 10)]
    chunk2 = [TokenLogprobs([prompt_ids[2]], [-2.0], 5), TokenLogprobs([prompt_ids[3]], [-1.0], 2)]
    outputs, _ = proc.process_outputs([out(child, [], prompt_logprobs=chunk1)])
    assert outputs == []  # prefill chunk: no token yet
    first_token = tok.encode(" about")
    outputs, _ = proc.process_outputs([out(child, first_token, prompt_logprobs=chunk2)])
    assert outputs[0].prompt_logprobs == [
        None,
        {prompt_ids[1]: Logprob(-3.0, 10, " me")},
        {prompt_ids[2]: Logprob(-2.0, 5, " a")},
        {prompt_ids[3]: Logprob(-1.0, 2, " story")},
    ]
    outputs, _ = proc.process_outputs([out(child, first_token, finish="length")])
    assert outputs[0].prompt_logprobs is None  # delta: sent once


def test_metrics_timing(proc, tok, clock):
    (child,) = add(proc, tok)
    clock.now = 101.0
    proc.process_outputs([out(child, [])])  # prefill chunk, no token
    clock.now = 102.5
    proc.process_outputs([out(child, tok.encode("Hi"))])
    clock.now = 104.0
    outputs, _ = proc.process_outputs([out(child, tok.encode(" there"), finish="length")])
    assert outputs[0].metrics == {
        "arrival_time": 100.0,
        "first_scheduled_time": None,
        "first_token_time": 102.5,
        "last_token_time": 104.0,
        "finished_time": 104.0,
        "num_generation_tokens": 2,
    }


def test_first_scheduled_time_is_the_earliest_of_the_samples(proc, tok):
    children = add(proc, tok, n=2, kind="delta")
    outputs, _ = proc.process_outputs(
        [out(children[1], tok.encode("Hi"), first_scheduled_time=100.7)]
    )
    assert outputs[0].metrics["first_scheduled_time"] == 100.7
    outputs, _ = proc.process_outputs(
        [
            out(children[0], tok.encode("Hi"), first_scheduled_time=100.2),
            out(children[1], tok.encode("!"), first_scheduled_time=100.7),
        ]
    )
    assert outputs[0].metrics["first_scheduled_time"] == 100.2
    outputs, _ = proc.process_outputs(
        [out(children[1], [], finish="length", first_scheduled_time=100.7)]
    )
    assert outputs[0].metrics["first_scheduled_time"] == 100.2


def test_error_output_finishes_request(proc, tok):
    (child,) = add(proc, tok)
    outputs, _ = proc.process_outputs([out(child, [], error="nan logits")])
    assert outputs[0].finished and outputs[0].outputs[0].finish_reason == "error"
    assert outputs[0].error == "nan logits" and "error" not in outputs[0].metrics


def test_abort_request_drops_state(proc, tok):
    children = add(proc, tok, n=2)
    proc.process_outputs([out(children[0], tok.encode("Hi"), finish="length")])
    assert proc.has_unfinished() and proc.get_num_unfinished() == 1
    assert proc.abort_request("r") == [children[1]]
    assert not proc.has_unfinished()
    assert proc.process_outputs([out(children[1], tok.encode("Hi"))]) == ([], [])
    assert proc.abort_request("r") == []
    add(proc, tok)  # the ids are free again


def test_add_request_validation(proc, tok):
    prompt_ids = tok.encode(PROMPT)
    with pytest.raises(ValueError, match="output_kind"):
        proc.add_request("x", PROMPT, prompt_ids, SamplingParams(), output_kind="stream")
    with pytest.raises(ValueError, match="child_ids"):
        proc.add_request("x", PROMPT, prompt_ids, SamplingParams(n=2), child_ids=["x-0"])
    proc.add_request("x", PROMPT, prompt_ids, SamplingParams())
    with pytest.raises(ValueError, match="request_id"):
        proc.add_request("x", PROMPT, prompt_ids, SamplingParams())
    with pytest.raises(ValueError, match="child_ids"):
        proc.add_request("y", PROMPT, prompt_ids, SamplingParams(), child_ids=["x"])


def test_without_tokenizer_token_ids_flow_and_text_stays_empty(clock):
    proc = OutputProcessor(None, clock=clock)
    proc.add_request(
        "t", None, [5, 6, 7], SamplingParams(detokenize=False, logprobs=1), child_ids=["t"]
    )
    step = TokenLogprobs(token_ids=[9, 8], logprobs=[-0.5, -0.25], sampled_rank=2)
    outputs, _ = proc.process_outputs([out("t", [9], finish="length", new_logprobs=[step])])
    completion = outputs[0].outputs[0]
    assert completion.text == "" and completion.token_ids == [9]
    assert completion.logprobs == [{9: Logprob(-0.5, 2, None), 8: Logprob(-0.25, 1, None)}]
