"""Request fields that only mean something on OpenAI's platform: accepted, ignored, reported.

Agent frameworks and SDK wrappers send fields such as `store`, `metadata` or `user`
on every call. None of them changes what the model generates, so answering 400
would break those clients for nothing; silently dropping them would hide that they
had no effect. So each is accepted, logged as a warning once per process per field
name, and listed in the `x-pagoda-ignored-fields` response header of every request
that carried it.

Only fields with no effect on generation belong in PLATFORM_FIELDS: a field that
changes the output (reasoning_effort, tools, audio, ...) and is not implemented
stays a 400 (protocol.py).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

HEADER = "x-pagoda-ignored-fields"

# name -> what it does on OpenAI's platform (said once in the log).
PLATFORM_FIELDS = {
    "store": "keeps the completion for OpenAI's dashboard, evals and distillation",
    "metadata": "tags for completions stored on OpenAI's platform",
    "service_tier": "OpenAI's processing tier, a billing and latency class",
    "user": "an end-user id for OpenAI's abuse monitoring",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
    "prompt_cache_key": "a routing hint for OpenAI's prompt cache (Pagoda's prefix cache "
    "matches prompts by content)",
    "prompt_cache_retention": "how long OpenAI keeps a cached prompt",
}

# Ignored only in some cases; protocol.py decides when (and rejects the others).
CONDITIONAL_FIELDS = {
    "parallel_tool_calls": "only meaningful together with tools, and none were given",
    "stream_options.include_obfuscation": "pads streamed chunks against a network side "
    "channel on OpenAI's platform",
}

_warned: set[str] = set()


def note_ignored(names: list[str]) -> dict[str, str]:
    """Logs each name the first time this process sees it; the response headers to add."""
    for name in names:
        if name not in _warned:
            _warned.add(name)  # the event loop is one thread: no lock needed
            reason = PLATFORM_FIELDS.get(name) or CONDITIONAL_FIELDS.get(name, "")
            logger.warning(
                "ignoring the request field %r: %s; it has no effect here (logged "
                "once; each response lists ignored fields in %s)",
                name,
                reason,
                HEADER,
            )
    return {HEADER: ", ".join(names)} if names else {}
