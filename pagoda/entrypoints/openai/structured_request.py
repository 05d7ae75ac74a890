"""A request's output constraints, from the API's fields, checked before generation.

Owns the mapping of `response_format` (json_object, json_schema), vLLM's
`structured_outputs` extra field, tool grammars, `thinking_token_budget` and
`reasoning_effort` onto SamplingParams, and `check_constraints`: the grammar is
compiled (on the engine's compile pool, awaited without blocking the event loop)
before the request is admitted, so a schema the compiler refuses is a 400 with its
reason, never a failure after the stream started. The engine then finds the
compiled grammar in its cache.
"""

from __future__ import annotations

import asyncio

from pagoda.entrypoints.openai.errors import bad_request
from pagoda.sampling_params import SamplingParams
from pagoda.structured.params import StructuredOutputsParams
from pagoda.structured.reasoning import REASONING_EFFORT_BUDGETS


def _from_response_format(response_format) -> StructuredOutputsParams | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = response_format.json_schema
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise bad_request(
            "response_format of type json_schema needs json_schema.schema (a JSON schema object)",
            param="response_format",
        )
    return StructuredOutputsParams(json=schema)


def structured_outputs_of(
    req, tool_grammar: StructuredOutputsParams | None = None
) -> StructuredOutputsParams | None:
    """The one constraint the request sets (400 if it sets several)."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if tool_grammar is not None:
        found.append(("tool_choice", tool_grammar))
    response_format = getattr(req, "response_format", None)
    try:
        from_format = _from_response_format(response_format)
        if from_format is not None:
            found.append(("response_format", from_format))
        if req.structured_outputs is not None:
            found.append(
                ("structured_outputs", StructuredOutputsParams.from_dict(req.structured_outputs))
            )
    except ValueError as exc:
        param = "structured_outputs" if req.structured_outputs is not None else "response_format"
        raise bad_request(str(exc), param=param) from None
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise bad_request(f"{names} each constrain the output; set only one", param=found[-1][0])
    return found[0][1] if found else None


def thinking_budget_of(req) -> int | None:
    """thinking_token_budget, else reasoning_effort's budget (REASONING_EFFORT_BUDGETS)."""
    if req.thinking_token_budget is not None:
        return req.thinking_token_budget
    effort = getattr(req, "reasoning_effort", None)
    return None if effort is None else REASONING_EFFORT_BUDGETS[effort]


def structured_param_name(req) -> str:
    if getattr(req, "tool_choice", None) not in (None, "none", "auto"):
        return "tool_choice"
    if getattr(req, "response_format", None) is not None and req.structured_outputs is None:
        return "response_format"
    return "structured_outputs"


async def check_constraints(engine, req, params: SamplingParams) -> None:
    """400 when the engine cannot honour params' constraint (no reasoning parser for a
    budget, a grammar that does not compile)."""
    structured = engine.structured
    if params.thinking_token_budget is not None and structured.reasoning is None:
        param = (
            "reasoning_effort"
            if getattr(req, "reasoning_effort", None) is not None
            and req.thinking_token_budget is None
            else "thinking_token_budget"
        )
        raise bad_request(f"{param} needs the server started with --reasoning-parser", param=param)
    if params.structured_outputs is None:
        return
    if engine.tokenizer is None:
        raise bad_request(
            "structured outputs need a tokenizer; this model has none",
            param=structured_param_name(req),
        )
    future = structured.compiler().submit(params.structured_outputs)
    try:
        # Shielded: the Future is shared through the cache, and a client that goes away
        # must not cancel other requests' compile.
        await asyncio.shield(asyncio.wrap_future(future))
    except ValueError as exc:  # GrammarCompileError: the compiler's reason
        raise bad_request(str(exc), param=structured_param_name(req)) from None
