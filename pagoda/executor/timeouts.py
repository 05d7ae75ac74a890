"""How long an executor waits for its workers before it declares them hung.

A rank that never answers (a collective whose peer is stuck, a device that hangs, a
process that cannot reach the rendezvous) would otherwise hang the engine forever,
with /health still answering 200. Past these limits the executor is dead instead
(ExecutorDeadError naming the ranks that did not answer), so requests fail and
/health answers 503.

Two limits, from the environment (seconds, a positive number; `inf` waits forever):
- PAGODA_EXECUTOR_STARTUP_TIMEOUT_S (default 1800): until the first step's output
  arrived: worker start-up (loading the weights, joining the group), KV cache sizing
  and allocation (warm-up, CUDA graph capture) and the first step (kernel compiles).
- PAGODA_EXECUTOR_TIMEOUT_S (default 300, as vLLM's execute-model timeout): every
  reply after that, counted from the moment its request was sent.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

TIMEOUT_ENV = "PAGODA_EXECUTOR_TIMEOUT_S"
STARTUP_TIMEOUT_ENV = "PAGODA_EXECUTOR_STARTUP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_STARTUP_TIMEOUT_S = 1800.0


def _read(environ: Mapping[str, str], name: str, default: float) -> float:
    text = environ.get(name)
    if text is None or text.strip() == "":
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:  # also refuses nan
        raise ValueError(f"{name} must be a positive number of seconds (or inf), got {text!r}")
    return value


@dataclass(frozen=True)
class ExecutorTimeouts:
    step_s: float = DEFAULT_TIMEOUT_S
    startup_s: float = DEFAULT_STARTUP_TIMEOUT_S

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ExecutorTimeouts:
        env = os.environ if environ is None else environ
        return cls(
            _read(env, TIMEOUT_ENV, DEFAULT_TIMEOUT_S),
            _read(env, STARTUP_TIMEOUT_ENV, DEFAULT_STARTUP_TIMEOUT_S),
        )

    def limit(self, warm: bool) -> float:
        """The limit for a request sent now: warm once a step's output has arrived."""
        return self.step_s if warm else self.startup_s

    def describe(self, warm: bool) -> str:
        """'300 s (PAGODA_EXECUTOR_TIMEOUT_S)': for error messages."""
        name = TIMEOUT_ENV if warm else STARTUP_TIMEOUT_ENV
        return f"{self.limit(warm):g} s ({name})"


def remaining(deadline: float, now: float) -> float | None:
    """Seconds left until deadline (>= 0), None for no deadline (inf): a wait()'s timeout."""
    if math.isinf(deadline):
        return None
    return max(0.0, deadline - now)
