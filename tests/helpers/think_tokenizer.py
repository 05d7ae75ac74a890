"""A copy of the embedded SmolLM2 tokenizer that has Qwen3-style thinking tags, for tests.

`make_think_tokenizer(directory)` saves the tokenizer there with two of its unused
special tokens renamed: id 8 becomes `<think>` and id 9 `</think>` (ids inside the
model's vocabulary, so the embedded model can be steered to them by a mask; still
special tokens, so decoding with skip_special_tokens drops them). Its chat template
is Qwen3's rule on SmolLM2's format: with `enable_thinking` the assistant turn opens
`<think>\\n`; without, it carries an empty `<think>\\n\\n</think>\\n\\n` (no thinking).
(A module with a unique name, so test files can import it.)
"""

from __future__ import annotations

import json
import pathlib

THINK_ID, END_THINK_ID = 8, 9
RENAMED = {"<issue_start>": "<think>", "<issue_comment>": "</think>"}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if tools %}{{ '<|im_start|>tools\\n' }}{% for tool in tools %}"
    "{{ tool['function']['name'] + '\\n' }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking %}{{ '<think>\\n' }}"
    "{% else %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
)


def make_think_tokenizer(directory: pathlib.Path) -> pathlib.Path:
    from pagoda.model.tokenizer import embedded_model_path, load_tokenizer

    tokenizer = load_tokenizer(embedded_model_path())
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    path = directory / "tokenizer.json"
    data = json.loads(path.read_text())
    for token in data["added_tokens"]:
        token["content"] = RENAMED.get(token["content"], token["content"])
    vocab = data["model"]["vocab"]
    for old, new in RENAMED.items():
        vocab[new] = vocab.pop(old)
    path.write_text(json.dumps(data))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for entry in (config.get("added_tokens_decoder") or {}).values():
        entry["content"] = RENAMED.get(entry["content"], entry["content"])
    config_path.write_text(json.dumps(config))
    return directory
