"""Dataset generation: token-exact random prompts, shared prefixes, ShareGPT and custom files."""

import json
import math

import numpy as np
import pytest

from pagoda.bench.datasets import (
    custom_requests,
    multi_turn_requests,
    prefix_repetition_requests,
    random_requests,
    sharegpt_requests,
)
from pagoda.bench.tokenizers import build_exact_prompt, corpus_token_pool


class MergingTokenizer:
    """Greedy longest-match over single characters plus a few merges, so that decoding
    random tokens and encoding the text again often gives fewer tokens (as real BPE does)."""

    name = "toy"
    MERGES = ["the", " the", "th", "he", "an", "in", "er", "on", " a", "ing", "ar", "es", "  "]

    def __init__(self):
        self.vocab = {s: i for i, s in enumerate(self.MERGES)}
        self.inverse = dict(enumerate(self.MERGES))

    def _id(self, piece):
        if piece not in self.vocab:
            self.vocab[piece] = 1000 + ord(piece)
            self.inverse[1000 + ord(piece)] = piece
        return self.vocab[piece]

    def encode(self, text):
        ids, i = [], 0
        while i < len(text):
            match = max((m for m in self.MERGES if text.startswith(m, i)), key=len, default=text[i])
            ids.append(self._id(match))
            i += len(match)
        return ids

    def decode(self, ids):
        return "".join(self.inverse[i] for i in ids)


@pytest.fixture
def tok():
    return MergingTokenizer()


def test_exact_prompt_converges_despite_merges(tok):
    pool = corpus_token_pool(tok)
    rng = np.random.default_rng(0)
    # Merges shrink the first draw, so the builder has to extend it.
    raw = tok.decode([tok.vocab["t"], tok.vocab["h"], tok.vocab["e"]])
    assert len(tok.encode(raw)) == 1
    for n in (1, 2, 7, 64, 333):
        text, count = build_exact_prompt(tok, pool, n, rng)
        assert count == n
        assert len(tok.encode(text)) == n


def test_random_lengths_within_range_and_exact(tok):
    samples = random_requests(
        tok, num_prompts=200, input_len=40, output_len=20, range_ratio=0.25, prefix_len=0, seed=3
    )
    assert len(samples) == 200
    for s in samples:
        assert math.floor(40 * 0.75) <= s.prompt_len <= math.ceil(40 * 1.25)
        assert len(tok.encode(s.prompt)) == s.prompt_len
        assert 15 <= s.expected_output_len <= 25
    assert len({s.prompt_len for s in samples}) > 10  # lengths really vary
    again = random_requests(tok, 200, 40, 20, 0.25, 0, seed=3)
    assert [s.prompt for s in again] == [s.prompt for s in samples]  # same seed, same prompts
    other = random_requests(tok, 200, 40, 20, 0.25, 0, seed=4)
    assert [s.prompt for s in other] != [s.prompt for s in samples]


def test_random_ratio_zero_gives_fixed_lengths_and_prefix_is_shared(tok):
    samples = random_requests(
        tok, 20, input_len=30, output_len=9, range_ratio=0.0, prefix_len=12, seed=1
    )
    assert {s.prompt_len for s in samples} == {42}
    assert {s.expected_output_len for s in samples} == {9}
    prefix = samples[0].prompt[:5]
    assert all(s.prompt.startswith(prefix) for s in samples)
    common = min(len(_common_prefix(samples[0].prompt, s.prompt)) for s in samples[1:])
    assert len(tok.encode(samples[0].prompt[:common])) >= 11  # the 12-token prefix, up to a merge


def _common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def test_random_rejects_bad_values(tok):
    with pytest.raises(ValueError, match="random_range_ratio"):
        random_requests(tok, 2, 10, 10, range_ratio=1.0)
    with pytest.raises(ValueError, match="random_input_len"):
        random_requests(tok, 2, 0, 10)
    with pytest.raises(ValueError, match="num_prompts"):
        random_requests(tok, 0, 10, 10)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        random_requests(None, 2, 10, 10)


def test_prefix_repetition_shares_few_prefixes(tok):
    samples = prefix_repetition_requests(
        tok, num_prompts=30, prefix_len=50, suffix_len=10, num_prefixes=3, output_len=7, seed=0
    )
    assert len(samples) == 30
    assert all(s.prompt_len == 60 and len(tok.encode(s.prompt)) == 60 for s in samples)
    assert all(s.expected_output_len == 7 for s in samples)
    heads = {}
    for s in samples:
        heads.setdefault(s.prompt[:40], []).append(s)
    assert len(heads) == 3
    assert sorted(len(v) for v in heads.values()) == [10, 10, 10]  # round-robin assignment
    assert len({s.prompt for s in samples}) == 30  # every suffix differs
    order = [s.prompt[:40] for s in samples]
    assert order != sorted(order, key=list(heads).index)  # shuffled, not grouped


def write_sharegpt(path, conversations):
    path.write_text(
        json.dumps([{"id": str(i), "conversations": c} for i, c in enumerate(conversations)])
    )


def turn(who, text):
    return {"from": who, "value": text}


def test_sharegpt_parsing_and_filters(tok, tmp_path):
    path = tmp_path / "sg.json"
    write_sharegpt(
        path,
        [
            [
                turn("human", "tell me about the river"),
                turn("gpt", "the river rises in spring and falls"),
            ],
            [turn("human", "hi"), turn("gpt", "a reply that is long enough")],  # prompt < 4 tokens
            [turn("human", "only one turn here")],  # one turn
            [turn("human", "why is the sky blue today"), turn("gpt", "ok")],  # reply < 4 tokens
            [
                turn("human", "x" * 1100),
                turn("gpt", "a reply that is long enough"),
            ],  # prompt > 1024
            [
                turn("human", "what is in the market town"),
                turn("gpt", "maps and letters and a ledger"),
            ],
        ],
    )
    samples = sharegpt_requests(str(path), tok, num_prompts=2, seed=0)
    prompts = sorted(s.prompt for s in samples)
    assert prompts == ["tell me about the river", "what is in the market town"]
    for s in samples:
        assert s.prompt_len == len(tok.encode(s.prompt))
    by_prompt = {s.prompt: s for s in samples}
    assert by_prompt["tell me about the river"].expected_output_len == len(
        tok.encode("the river rises in spring and falls")
    )
    with pytest.raises(ValueError, match="only 2 usable"):
        sharegpt_requests(str(path), tok, num_prompts=3)
    fixed = sharegpt_requests(str(path), None, num_prompts=5, output_len=11)
    assert [s.expected_output_len for s in fixed] == [11] * 5  # fixed length: no filtering
    assert all(s.prompt_len is None for s in fixed)


def test_sharegpt_rejects_other_shapes(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"conversations": []}')
    with pytest.raises(ValueError, match="list of conversations"):
        sharegpt_requests(str(path), None, 1, output_len=4)
    path.write_text("not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        sharegpt_requests(str(path), None, 1, output_len=4)


def test_custom_jsonl(tok, tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"prompt": "the first one", "output_tokens": 5}\n\n{"prompt": "another"}\n')
    samples = custom_requests(str(path), tok, num_prompts=2, output_len=33)
    assert [(s.prompt, s.expected_output_len) for s in samples] == [
        ("the first one", 5),
        ("another", 33),
    ]
    assert samples[0].prompt_len == len(tok.encode("the first one"))
    assert custom_requests(str(path), None, 1)[0].prompt_len is None
    with pytest.raises(ValueError, match="fewer than --num-prompts 3"):
        custom_requests(str(path), tok, num_prompts=3)


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"text": "x"}', "c.jsonl:2: each line needs a non-empty string field 'prompt'"),
        (
            '{"prompt": "x", "output_tokens": 0}',
            "c.jsonl:2: 'output_tokens' must be an integer >= 1",
        ),
        ('{"prompt": "x", "temperature": 1}', "c.jsonl:2: unknown field"),
        ('{"prompt": ', "c.jsonl:2: not valid JSON"),
    ],
)
def test_custom_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "c.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        custom_requests(str(path), None, 1)


def test_multi_turn_conversations_grow_turn_by_turn_and_come_back_in_rounds(tok):
    samples = multi_turn_requests(
        tok, num_conversations=3, num_turns=3, first_len=40, turn_len=10, output_len=5, seed=1
    )
    assert len(samples) == 9 and all(s.expected_output_len == 5 for s in samples)
    for i, sample in enumerate(samples):
        turn, conv = divmod(i, 3)
        assert sample.prompt_len == 40 + turn * 15 == len(tok.encode(sample.prompt))
        if turn:  # the previous turn of the same conversation is a prefix of this one
            assert sample.prompt.startswith(samples[i - 3].prompt)
    assert len({s.prompt[:20] for s in samples}) == 3  # three distinct conversations
    again = multi_turn_requests(tok, 3, 3, 40, 10, 5, seed=1)
    assert [s.prompt for s in again] == [s.prompt for s in samples]
    with pytest.raises(ValueError, match="multi_turn_turns"):
        multi_turn_requests(tok, 3, 0, 40, 10, 5)
