"""Grammar compilation off the step loop: xgrammar on a thread pool, cached by (kind, spec).

Owns `GrammarCompiler`: `submit(params)` returns at once with a Future of the compiled
grammar; equal (kind, spec) keys share one Future (an LRU of `cache_size` entries,
failures included: the same spec fails the same way). The xgrammar tokenizer info is
built on the pool too, on first use, so neither the engine loop nor the event loop
ever waits for a compile. A spec xgrammar refuses fails its Future with
GrammarCompileError carrying xgrammar's reason (the server's 400 message).

Thread safety: submit() may be called from any thread (the engine loop, the server's
event loop); the cache is guarded by a lock, and xgrammar's compiler is thread-safe.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from pagoda.structured.params import StructuredOutputsParams


class GrammarCompileError(ValueError):
    """The grammar of a request cannot be compiled; the message says why."""


_SOURCE_LOCATION = re.compile(r"^\[[0-9:]+\] \S+\.cc:\d+: (Check failed: \(.*?\) is false: )?")


def _reason(exc: BaseException) -> str:
    """xgrammar's message without its C++ time stamp and source location."""
    return _SOURCE_LOCATION.sub("", str(exc).strip()) or type(exc).__name__


class GrammarCompiler:
    """Compiles grammars for one tokenizer and vocabulary (the model's logits width)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        max_threads: int = 2,
        cache_size: int = 1024,
        on_compiled: Callable[[str, float], None] | None = None,
    ) -> None:
        """on_compiled(kind, seconds) is called (on a pool thread) after each compile."""
        if tokenizer is None:
            raise ValueError(
                "structured outputs need a tokenizer; this model has none (pass --tokenizer)"
            )
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._max_threads = max_threads
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_threads, thread_name_prefix="pagoda-grammar"
        )
        self._lock = threading.Lock()
        self._xgr_compiler = None  # built on the pool by the first compile
        self._init_lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[str, str], concurrent.futures.Future] = (
            collections.OrderedDict()
        )
        self._cache_size = cache_size
        self._on_compiled = on_compiled

    def submit(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """A Future of params' compiled grammar (shared with equal earlier requests)."""
        key = params.cache_key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, params: StructuredOutputsParams):
        """Blocking form of submit() (for the offline API and tests)."""
        return self.submit(params).result()

    def shutdown(self) -> None:
        """Cancels the compiles not started, waits for those running (a compile is not
        interruptible) so that no pool thread outlives the compiler, and drops the
        cache and xgrammar's tokenizer info. Idempotent."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._cache.clear()
        with self._init_lock:
            self._xgr_compiler = None

    # ---- on the pool --------------------------------------------------------------------
    def _compiler(self):
        with self._init_lock:
            if self._xgr_compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise GrammarCompileError(
                        "structured outputs need the xgrammar package, which is not "
                        "installed: pip install 'pagoda[structured]'"
                    ) from None
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer,
                    vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_token_ids or None,
                )
                # Our own cache holds the results: xgrammar's would keep a second copy.
                self._xgr_compiler = xgr.GrammarCompiler(
                    info, max_threads=self._max_threads, cache_enabled=False
                )
            return self._xgr_compiler

    def _compile(self, params: StructuredOutputsParams):
        compiler = self._compiler()  # GrammarCompileError without xgrammar
        start = time.perf_counter()
        kind = params.kind
        try:
            compiled = _compile_kind(compiler, params)
        except Exception as exc:  # xgrammar raises RuntimeError (and a few others)
            raise GrammarCompileError(
                f"the {kind} constraint cannot be compiled: {_reason(exc)}"
            ) from None
        if self._on_compiled is not None:
            self._on_compiled(kind, time.perf_counter() - start)
        return compiled


def _compile_kind(compiler, params: StructuredOutputsParams):
    kind = params.kind
    compact = params.disable_any_whitespace
    json_options = dict(any_whitespace=not compact)
    if compact:
        json_options["separators"] = (",", ":")
    if kind == "json":
        schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
        return compiler.compile_json_schema(schema, **json_options)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', **json_options)
    if kind == "regex":
        return compiler.compile_regex(params.regex)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(params.choice))
    return compiler.compile_grammar(params.grammar)


def choice_grammar(choices: list[str]) -> str:
    """EBNF matching exactly one of the strings (EBNF literals take JSON's escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
