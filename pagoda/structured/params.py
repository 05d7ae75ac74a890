"""StructuredOutputsParams: the constraint a request puts on its output (vLLM's names).

Exactly one of json (a JSON schema), regex, choice, grammar (EBNF/GBNF as xgrammar
takes it) or json_object (any JSON object) is set. `cache_key()` is the (kind, spec)
pair grammars are compiled and cached by. Stdlib only: SamplingParams carries it.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, fields
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # Pagoda's default is compact JSON (no free whitespace between tokens): a model left
    # free to emit whitespace can loop in it until max_tokens (vLLM's default is False).
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, "
                f"grammar, json_object; got {set_kinds or 'none'}"
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = _json.loads(self.json)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            else:
                parsed = self.json
            if not isinstance(parsed, (dict, bool)):
                raise ValueError(
                    "structured_outputs.json must be a JSON schema (an object), "
                    f"got {type(parsed).__name__}"
                )
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(
                f"structured_outputs.json_object must be true, got {self.json_object!r}"
            )
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError(
                    "structured_outputs.choice must be a non-empty list of "
                    f"non-empty strings, got {self.choice!r}"
                )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(
                    f"structured_outputs.{name} must be a non-empty string, got {value!r}"
                )
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a boolean")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> StructuredOutputsParams:
        """From a request body's dict; an unknown key is a ValueError naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"structured_outputs: unknown field(s) {', '.join(unknown)}; "
                f"supported: {', '.join(sorted(known))}"
            )
        return cls(**values)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple[str, str]:
        """(kind, spec text): equal keys compile to the same grammar."""
        kind = self.kind
        if kind == "json":
            schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
            spec = _json.dumps(schema, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            spec = _json.dumps(list(self.choice))
        elif kind == "json_object":
            spec = ""
        else:
            spec = getattr(self, kind)
        if kind in ("json", "json_object"):
            spec = f"{spec}|compact={self.disable_any_whitespace}"
        return kind, spec
