"""When a sampled token ends a request: eos, stop_token_ids (after min_tokens), max_tokens
and max_model_len (no torch).

The scheduler appends a step's sampled tokens through ``append_until_stop``; a token
that ends the request sets its finished status and stop_reason, and the tokens after it
are dropped. Stop strings need detokenized text: the engine's output processor checks
them.
"""

from __future__ import annotations

from pagoda.core.request import Request, RequestStatus


def append_until_stop(request: Request, sampled: list[int], max_model_len: int) -> list[int]:
    """Appends sampled tokens one by one; tokens after a stop are dropped. Returns the
    tokens appended."""
    appended: list[int] = []
    for token_id in sampled:
        request.append_output_token_ids([token_id])
        appended.append(token_id)
        if check_stop(request, token_id, max_model_len):
            break
    return appended


def check_stop(request: Request, token_id: int, max_model_len: int) -> bool:
    """Sets a finished status if the request must stop after token_id (just appended)."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        if (
            not params.ignore_eos
            and request.eos_token_id is not None
            and token_id == request.eos_token_id
        ):
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = None  # as vLLM: eos is not a stop_reason
            return True
        if params.stop_token_ids and token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token_id
            return True
    if (
        request.max_tokens is not None and request.num_output_tokens >= request.max_tokens
    ) or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
