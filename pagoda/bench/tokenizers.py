"""Tokenizers for building token-exact prompts: the server's own, or a local one.

Owns the `BenchTokenizer` interface (content tokens only: no BOS/EOS), its two
implementations, and `build_exact_prompt`, which turns a target token count into
text that the tokenizer encodes to exactly that many tokens.

- `ServerTokenizer` calls the server's `POST /tokenize {"model","prompt"}` and
  `POST /detokenize {"model","tokens"}` (vLLM's and Pagoda's routes), so the prompt
  lengths are those of the engine being measured. Special tokens the server adds
  around every prompt (a BOS, say) are detected once and stripped.
- `LocalTokenizer` loads a tokenizer from local files only (a Hugging Face
  directory, or a `.gguf` file that holds its tokenizer) with Pagoda's own loader,
  imported lazily, so the lengths match what a Pagoda server would count.

Prompt text is drawn from the tokens of a fixed English corpus, so prompts are
readable-ish words, never special tokens, and the same seed gives the same prompts
with the server's tokenizer and with the same tokenizer loaded locally.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from pagoda.model.tokenizer import load_tokenizer

CORPUS = (
    "The river keeps its own calendar, rising with the snow melt in spring and falling "
    "back through the long dry summer. Farmers along its banks plant barley, onions and "
    "apricots, and every village has a story about the year the water reached the church "
    "steps. Engineers measured the flow for decades before they built the first dam; their "
    "notebooks describe wooden gauges, copper floats and the patience of people who waited "
    "for weather. Today sensors report every minute, but the old questions remain: how much "
    "water can the valley store, who decides when to release it, and what happens to the "
    "fish that swim upstream each autumn? A library in the market town keeps maps drawn by "
    "hand, letters from travellers, and a ledger of bridges repaired after each flood. "
    "Students visit to compare the maps with satellite images, counting meanders that "
    "moved, islands that vanished and orchards planted where gravel once lay. Numbers such "
    "as 1887, 42 and 3.5 metres appear in the margins beside sketches of herons, mills, "
    "lanterns and quiet evening light over the water."
)


class BenchTokenizer(Protocol):
    """Content tokens only: `encode` adds no BOS/EOS, `decode` keeps text lossless."""

    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class ServerTokenizer:
    """The measured server's tokenizer, through its /tokenize and /detokenize routes."""

    def __init__(
        self, base_url: str, model: str, api_key: str | None = None, timeout: float = 30.0
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.name = f"server:{self.base_url}/tokenize"
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._timeout = timeout
        self.max_model_len: int | None = None
        # Tokens the server adds around every prompt: the common head and tail of the
        # encodings of two one-letter texts.
        first, second = self._tokenize("a"), self._tokenize("b")
        self._lead = _common_prefix_len(first, second)
        self._trail = _common_prefix_len(first[self._lead :][::-1], second[self._lead :][::-1])

    def _post(self, route: str, body: dict) -> dict:
        request = urllib.request.Request(
            self.base_url + route,
            data=json.dumps(body).encode(),
            headers=self._headers,
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:300]
            raise RuntimeError(
                f"{route} on {self.base_url} answered HTTP {err.code}: {detail}"
            ) from err
        except (urllib.error.URLError, OSError) as err:
            raise RuntimeError(f"{route} on {self.base_url} is unreachable: {err}") from err

    def _tokenize(self, text: str) -> list[int]:
        reply = self._post("/tokenize", {"model": self.model, "prompt": text})
        if "tokens" not in reply:
            raise RuntimeError(f"/tokenize reply has no 'tokens' field: {str(reply)[:200]}")
        self.max_model_len = reply.get("max_model_len", self.max_model_len)
        return [int(t) for t in reply["tokens"]]

    def encode(self, text: str) -> list[int]:
        ids = self._tokenize(text)
        return ids[self._lead : len(ids) - self._trail]

    def decode(self, token_ids: Sequence[int]) -> str:
        reply = self._post(
            "/detokenize", {"model": self.model, "tokens": [int(t) for t in token_ids]}
        )
        if "prompt" not in reply:
            raise RuntimeError(f"/detokenize reply has no 'prompt' field: {str(reply)[:200]}")
        return reply["prompt"]


class LocalTokenizer:
    """A tokenizer from local files (no hub access), loaded the way Pagoda's engine
    loads it, so local and server prompt lengths agree; or wrap one already loaded."""

    def __init__(self, path: str, hf_tokenizer=None) -> None:
        self.name = path
        if hf_tokenizer is not None:
            self._tok = hf_tokenizer
            return
        if not os.path.exists(path):
            raise ValueError(f"--tokenizer {path!r} does not exist (only local files are used)")

        self._tok = load_tokenizer(path)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(
            list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def corpus_token_pool(tokenizer: BenchTokenizer) -> list[int]:
    """The distinct token ids of the corpus, sorted (deterministic for a given tokenizer)."""
    pool = sorted(set(tokenizer.encode(CORPUS)))
    if not pool:
        raise RuntimeError(f"tokenizer {tokenizer.name} encodes the corpus to no tokens")
    return pool


def build_exact_prompt(
    tokenizer: BenchTokenizer,
    pool: Sequence[int],
    num_tokens: int,
    rng: np.random.Generator,
    prefix: str = "",
    max_rounds: int = 10,
) -> tuple[str, int]:
    """Text that starts with `prefix` and encodes to `num_tokens` tokens in all.

    Random pool tokens are decoded and re-encoded; merges at token boundaries change
    the count, so the text is truncated (by tokens) or extended until it matches.
    Returns (text, actual count); the count differs from the target only if
    `max_rounds` did not converge, and callers report the actual count.
    """
    if num_tokens < 1:
        raise ValueError(f"prompt length must be >= 1 token, got {num_tokens}")
    prefix_len = len(tokenizer.encode(prefix)) if prefix else 0
    if prefix_len > num_tokens:
        raise ValueError(f"prefix of {prefix_len} tokens is longer than the prompt ({num_tokens})")
    text = prefix + tokenizer.decode(_draw(pool, num_tokens - prefix_len, rng))
    count = len(tokenizer.encode(text))
    for _ in range(max_rounds):
        if count == num_tokens:
            break
        ids = tokenizer.encode(text)
        if count > num_tokens:
            text = tokenizer.decode(ids[:num_tokens])
            if prefix and not text.startswith(prefix):  # the cut reached into the prefix
                text = prefix
        else:
            text = text + tokenizer.decode(_draw(pool, num_tokens - count, rng))
        count = len(tokenizer.encode(text))
    return text, count


def _draw(pool: Sequence[int], n: int, rng: np.random.Generator) -> list[int]:
    if n <= 0:
        return []
    return [int(pool[i]) for i in rng.integers(0, len(pool), size=n)]
