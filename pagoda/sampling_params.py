"""SamplingParams: per-request generation settings, with vLLM's field names.

Owns validation of every sampling field; a bad value raises ValueError naming the
field and the allowed range. Pure Python (no torch) so core/, engine/ and the server
can all use it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pagoda.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    # A grammar the output must follow (json schema, regex, choice, grammar, json_object).
    structured_outputs: StructuredOutputsParams | None = None
    # With a reasoning parser: thinking tokens after which the end of thinking is forced.
    thinking_token_budget: int | None = None
    # Filled by the engine: ids that end generation for this request (eos + stop_token_ids).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self._validate()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _validate(self) -> None:
        def bad(name: str, rule: str, value) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1", self.n)
        if not (self.temperature >= 0.0):
            raise bad("temperature", ">= 0", self.temperature)
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int):
            raise bad("top_k", "an integer (0 or -1 disables it)", self.top_k)
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "in [0, 1]", self.min_p)
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise bad("presence_penalty", "in [-2, 2]", self.presence_penalty)
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise bad("frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        if not self.repetition_penalty > 0:
            raise bad("repetition_penalty", "> 0", self.repetition_penalty)
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "an integer >= 1", self.max_tokens)
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"an integer in [0, {MAX_LOGPROBS}]", value)
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer", self.seed)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", "a list of non-empty strings", self.stop)
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise bad("stop_token_ids", "a list of non-negative integers", self.stop_token_ids)
        if self.logit_bias:
            for _k, v in self.logit_bias.items():
                if not -100.0 <= v <= 100.0:
                    raise bad("logit_bias", "values in [-100, 100]", v)
        self._validate_structured(bad)

    def _validate_structured(self, bad) -> None:
        budget = self.thinking_token_budget
        if budget is not None and (
            not isinstance(budget, int) or isinstance(budget, bool) or budget < 0
        ):
            raise bad("thinking_token_budget", "an integer >= 0", budget)
        if self.structured_outputs is None:
            return
        if not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "a StructuredOutputsParams", self.structured_outputs)
        # The grammar decides where the output ends (it allows eos only there).
        if self.ignore_eos:
            raise ValueError(
                "ignore_eos cannot be combined with structured_outputs: the grammar ends the output"
            )
        if self.min_tokens:
            raise ValueError(
                "min_tokens cannot be combined with structured_outputs: the "
                "grammar decides where the output ends"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Checks the token ids in this request against the model's vocabulary."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids must be < vocab size {vocab_size}, got {t}")
        for t in self.logit_bias or {}:
            if not 0 <= t < vocab_size:
                raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}), got {t}")
