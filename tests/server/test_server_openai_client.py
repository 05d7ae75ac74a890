"""The official `openai` client against a real `pagoda serve`: completions and chat,
streaming and not, n=2, logprobs, stop, seed, and exact usage counts."""

from __future__ import annotations

import openai
import pytest

from pagoda.model.tokenizer import apply_chat_template

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(main_server):
    with openai.OpenAI(
        base_url=f"{main_server.url}/v1", api_key=main_server.api_key, timeout=120.0, max_retries=0
    ) as c:
        yield c


@pytest.fixture(scope="module")
def model(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    return models[0].id


def test_completion_usage_matches_tokenizer(client, model, tokenizer):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert out.object == "text_completion"
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(tokenizer(PROMPT).input_ids)
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    # The text is what the tokenizer makes of the 12 tokens: re-encoding gives 12 back.
    assert len(tokenizer.encode(choice.text, add_special_tokens=False)) == 12


def test_completion_stream_equals_non_stream_greedy(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    chunks = list(
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_usage_matches_template(client, model, tokenizer):
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, max_completion_tokens=10, temperature=0
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(apply_chat_template(tokenizer, MESSAGES))
    assert out.usage.completion_tokens == 10
    assert out.choices[0].finish_reason == "length"


def test_chat_stream_equals_non_stream_greedy(client, model):
    full = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=16, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=16, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_n2_gives_two_choices(client, model):
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, n=2, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 12
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, n=2, seed=3)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.usage.completion_tokens == 10


def test_completion_logprobs(client, model):
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    for _token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0.0
        assert 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob)  # greedy picks the likeliest
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


def test_chat_logprobs(client, model):
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token


def test_stop_string(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    text = full.choices[0].text
    stop = text[3:6]  # a piece the greedy text is known to contain
    cut = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_seed_reproducible(client, model):
    def sample(seed):
        return (
            client.completions.create(
                model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1  # the seed does steer sampling


def test_extra_sampling_fields_and_unknown_model(client, model):
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0.8,
        top_p=0.9,
        seed=5,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"13": -100},
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "ignore_eos": True,
            "min_tokens": 8,
        },
    )
    assert out.usage.completion_tokens == 8
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=2, response_format={"type": "json_schema"}
        )  # no schema
    assert info.value.body["param"] == "response_format"
