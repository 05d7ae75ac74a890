"""Tests for pagoda.engine.detokenizer: incremental decoding and stop strings, on the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.model.tokenizer import embedded_model_path, load_tokenizer
from pagoda.sampling_params import SamplingParams

TRICKY_TEXTS = [
    "Party 🎉 time 👨‍👩‍👧 family 🇫🇷 flag",
    "你好，世界！这是一个测试。",
    "  leading spaces and   inner   runs ",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f(3))\n",
    "mixed: café naïve 日本語 ∑∫ ½ — \"quotes\" 'single' 2024-01-31",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(embedded_model_path())


@pytest.fixture(scope="module")
def prompt(tok):
    return tok.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")


def stream(tok, prompt, text_or_ids, params=None, chunk=1):
    """Feeds tokens `chunk` at a time; returns (detokenizer, deltas, stop string)."""
    ids = tok.encode(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
    detok = IncrementalDetokenizer(tok, prompt, params or SamplingParams())
    deltas, stop = [], None
    for start in range(0, len(ids), chunk):
        stop = detok.update(ids[start : start + chunk])
        deltas.append(detok.get_delta_text())
        if stop is not None:
            break
    if stop is None:
        stop = detok.finish()
        deltas.append(detok.get_delta_text())
    return detok, deltas, stop


def assert_tokens_split_text(tok, text, stop):
    """The test is only meaningful if no single token holds the whole stop string."""
    pieces = [tok.decode([i]) for i in tok.encode(text)]
    assert not any(stop in piece for piece in pieces)


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_streamed_text_equals_one_shot_decode(tok, prompt, text, chunk):
    ids = tok.encode(text)
    detok, deltas, stop = stream(tok, prompt, ids, chunk=chunk)
    assert stop is None
    assert "".join(deltas) == detok.output_text == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_emoji_bytes_are_held_back_until_complete(tok, prompt):
    ids = tok.encode("🎉")
    assert len(ids) > 1  # one character over several byte-level tokens
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    for token_id in ids[:-1]:
        detok.update([token_id])
        assert detok.output_text == ""
    detok.update(ids[-1:])
    assert detok.output_text == "🎉"


def test_incomplete_character_is_flushed_on_finish(tok, prompt):
    ids = tok.encode("ok 🎉")[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    detok.update(ids)
    assert detok.output_text == "ok"
    detok.finish()
    assert detok.output_text == tok.decode(ids)
    assert detok.output_text.startswith("ok \ufffd")


def test_leading_space_of_first_token_is_kept(tok, prompt):
    ids = tok.encode(" Hello world")
    detok, deltas, _ = stream(tok, prompt, ids)
    assert deltas[0] == " Hello"
    assert detok.output_text == " Hello world"


def test_skip_special_tokens(tok, prompt):
    ids = tok.encode("Hi<|im_end|>\n<|im_start|>there")
    kept, _, _ = stream(tok, prompt, ids, SamplingParams(skip_special_tokens=False))
    skipped, _, _ = stream(tok, prompt, ids, SamplingParams(skip_special_tokens=True))
    assert kept.output_text == "Hi<|im_end|>\n<|im_start|>there"
    assert skipped.output_text == "Hi\nthere"


def test_stop_terminating_token_text_is_not_output(tok, prompt):
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(skip_special_tokens=False))
    detok.update(tok.encode("Done"))
    detok.update([tok.eos_token_id], stop_terminated=True)
    assert detok.output_text == "Done"
    assert detok.output_token_ids == tok.encode("Done") + [tok.eos_token_id]


def test_detokenize_false_keeps_text_empty(tok, prompt):
    ids = tok.encode("Hello there")
    detok, deltas, _ = stream(tok, prompt, ids, SamplingParams(detokenize=False))
    assert detok.output_text == "" and deltas == ["", "", ""]
    assert detok.output_token_ids == ids


def test_stop_strings_need_detokenize(tok, prompt):
    with pytest.raises(ValueError, match="detokenize"):
        IncrementalDetokenizer(tok, prompt, SamplingParams(stop=["x"], detokenize=False))


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_is_trimmed_exactly(tok, prompt, include):
    text = "Hello world, this is the END of the story."
    stop = "is the EN"
    assert_tokens_split_text(tok, text, stop)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    detok, deltas, matched = stream(tok, prompt, text, params)
    expected = "Hello world, this is the EN" if include else "Hello world, this "
    assert matched == stop
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    assert detok.finished


def test_stop_string_inside_a_multi_token_update(tok, prompt):
    text = "alpha beta STOP gamma delta"
    detok, deltas, matched = stream(tok, prompt, text, SamplingParams(stop=["STOP"]), chunk=100)
    assert matched == "STOP"
    assert detok.output_text == "alpha beta "
    assert deltas == ["alpha beta "]


def test_earliest_stop_string_wins(tok, prompt):
    text = "one two three four five"
    params = SamplingParams(stop=["four", "two th", "five"])
    detok, _, matched = stream(tok, prompt, text, params)
    assert matched == "two th"
    assert detok.output_text == "one "


def test_earliest_wins_within_one_update_regardless_of_list_order(tok, prompt):
    params = SamplingParams(stop=["three", "one"])
    detok, _, matched = stream(tok, prompt, "zero one two three", params, chunk=100)
    assert matched == "one"
    assert detok.output_text == "zero "


def test_delta_text_never_contains_a_partial_stop_string(tok, prompt):
    # "END" and "EN" appear before the real stop "ENDX": they must be held back, then released.
    text = "The END is near, EN route. ENDX and more"
    stop = "ENDX"
    params = SamplingParams(stop=[stop])
    detok, deltas, matched = stream(tok, prompt, text, params)
    assert matched == stop
    final = "The END is near, EN route. "
    assert detok.output_text == final
    streamed = ""
    for delta in deltas:
        streamed += delta
        assert final.startswith(streamed)  # nothing streamed is ever trimmed later
    assert streamed == final


def test_holdback_is_released_on_finish_without_match(tok, prompt):
    text = "almost a stop: ST"
    detok, deltas, matched = stream(tok, prompt, text, SamplingParams(stop=["STOP"]))
    assert matched is None
    assert deltas[-1].endswith("ST")  # the held-back tail comes out at finish
    assert "".join(deltas) == text


def test_visible_text_excludes_holdback(tok, prompt):
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=["xyz!"]))
    detok.update(tok.encode("abcdef"))
    assert detok.output_text == "abcdef"
    assert detok.visible_text() == "abc"
    detok.finish()
    assert detok.visible_text() == "abcdef"


def test_stop_strings_ignored_within_min_tokens(tok, prompt):
    text = "stop early, then stop late"
    ids = tok.encode(text)
    early_tokens = len(tok.encode("stop early"))
    params = SamplingParams(stop=["stop"], min_tokens=early_tokens, max_tokens=len(ids))
    detok, _, matched = stream(tok, prompt, ids, params)
    assert matched == "stop"
    assert detok.output_text == "stop early, then "


def test_updates_after_stop_are_ignored(tok, prompt):
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=["b"]))
    assert detok.update(tok.encode("a b")) == "b"
    assert detok.update(tok.encode(" c")) is None
    assert detok.output_text == "a "
