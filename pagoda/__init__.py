"""Pagoda: an LLM inference and serving engine.

from pagoda import LLM, SamplingParams, StructuredOutputsParams
llm = LLM()  # the embedded SmolLM2-135M-Instruct
llm.generate(["The capital of France is"], SamplingParams(max_tokens=32, temperature=0))
json_only = StructuredOutputsParams(json={"type": "object"})
llm.generate(["A JSON object:"], SamplingParams(max_tokens=32, structured_outputs=json_only))
"""

from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.structured.params import StructuredOutputsParams  # stdlib only, as SamplingParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "__version__",
]


def __getattr__(name: str):
    # LLM pulls in torch; import it on first use so `pagoda.sampling_params` stays light.
    if name == "LLM":
        from pagoda.entrypoints.llm import LLM  # per command: start-up time

        return LLM
    raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
