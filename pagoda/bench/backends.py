"""The names `pagoda bench serve --backend` accepts, and the wire protocol each means.

Pagoda speaks two protocols: OpenAI completions (`openai`, POST /v1/completions)
and OpenAI chat completions (`openai-chat`, POST /v1/chat/completions). vLLM's
`bench serve` has more backend names, and several of them send exactly the
`openai` requests (its request function for them is the OpenAI completions one);
those are accepted as aliases so existing scripts run unchanged. vLLM's names for
other protocols (TGI's /generate_stream, Triton's TensorRT-LLM ensemble, embeddings,
audio) are refused with what to use instead, as is any other name.
"""

from __future__ import annotations

BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}

# vLLM backend names whose requests are OpenAI completions, -> Pagoda's name.
ALIASES = {
    "vllm": "openai",
    "sglang": "openai",
    "lmdeploy": "openai",
    "scalellm": "openai",
    "llama.cpp": "openai",
}

# vLLM backend names for protocols Pagoda's bench does not speak -> advice.
_OTHER_PROTOCOLS = {
    "tgi": "it speaks TGI's native /generate_stream protocol; TGI also serves the OpenAI "
    "API: use --backend openai-chat",
    "tensorrt-llm": "it speaks Triton's TensorRT-LLM ensemble protocol; for trtllm-serve's "
    "OpenAI API use --backend openai or openai-chat",
    "deepspeed-mii": "it speaks DeepSpeed-MII's native protocol; MII's OpenAI-compatible "
    "server works with --backend openai",
    "openai-audio": "pagoda bench measures text generation, not transcription",
}


def choices_text() -> str:
    return f"{', '.join(BACKENDS)} (vLLM's names {', '.join(ALIASES)} mean openai)"


def resolve_backend(name: str) -> str:
    """Pagoda's protocol name for `name` (itself or a vLLM alias); ValueError otherwise."""
    if name in BACKENDS:
        return name
    if name in ALIASES:
        return ALIASES[name]
    if name in _OTHER_PROTOCOLS:
        raise ValueError(f"backend {name!r} is not supported: {_OTHER_PROTOCOLS[name]}")
    if "embeddings" in name or name in ("vllm-pooling", "vllm-rerank"):
        raise ValueError(
            f"backend {name!r} is not supported: pagoda bench measures text "
            f"generation, not embeddings, pooling or reranking"
        )
    raise ValueError(f"unknown backend {name!r}; choose from {choices_text()}")
