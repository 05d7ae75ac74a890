"""LLM: the offline API (`LLM().generate(...)`, `LLM().chat(...)`), shaped like vLLM's.

An LLM's engine owns threads, worker processes, KV offload tiers (the disk tier's
directory lock, pinned host memory) and device memory. `shutdown()` releases all of
it, and so do leaving a `with LLM(...) as llm:` block and dropping the last reference
to the engine (`del llm`: the engine's finalizer), so that one process can make LLM
after LLM, on the same disk-tier directory too.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from pagoda.config import EngineArgs
from pagoda.engine.llm_engine import EngineShutDownError, LLMEngine, PromptInput
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

Messages = list[dict]


class LLM:
    """Offline generation. `LLM()` serves the embedded SmolLM2-135M-Instruct on CPU
    (or the GPU when present); keyword arguments take vLLM's engine argument names."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(args)

    def shutdown(self) -> None:
        """Releases everything the engine holds: its threads (grammar compiles, KV
        offload I/O), worker processes, the disk tier's lock, pinned host memory and
        the device memory of weights, KV pool, graphs and buffers. Idempotent;
        generate(), chat() and stream() raise EngineShutDownError afterwards."""
        self.llm_engine.shutdown()

    @property
    def is_shut_down(self) -> bool:
        return self.llm_engine.is_shut_down

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def _check_open(self) -> None:
        if self.llm_engine.is_shut_down:
            raise EngineShutDownError("this LLM was shut down; make a new LLM to generate again")

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in the prompts' order.

        A prompt is a string, a list of token ids, or {"prompt_token_ids": [...]}.
        """
        self._check_open()
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        engine = self.llm_engine
        ids = []
        try:
            for prompt, params in zip(prompt_list, params_list):
                # final_only: no per-step RequestOutput copies for offline batches.
                ids.append(engine.add_request(None, prompt, params, output_kind="final_only"))
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run_to_completion(ids, use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates;
        `chat_template_kwargs` are extra template variables (e.g. enable_thinking)."""
        from pagoda.model.tokenizer import apply_chat_template

        self._check_open()
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer; this model has none")
        prompts = [
            {
                "prompt_token_ids": apply_chat_template(
                    tokenizer, conv, add_generation_prompt, chat_template, chat_template_kwargs
                )
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(
        self, prompt: PromptInput, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yields delta outputs of one request as its tokens are produced."""
        self._check_open()
        engine = self.llm_engine
        request_id = engine.add_request(None, prompt, sampling_params, output_kind="delta")
        try:
            while True:
                for out in engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            engine.abort_request(request_id)

    def _run_to_completion(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while len(finished) < len(ids):
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if not engine.has_unfinished_requests() and len(finished) < len(ids):
                    missing = [i for i in ids if i not in finished]
                    raise RuntimeError(f"engine stopped with requests unfinished: {missing}")
            # KV offload stores and disk writes still in flight finish before this returns,
            # so the next call finds those blocks in the tiers.
            while (
                engine.kv_transfers_in_flight() and not engine.scheduler.has_unfinished_requests()
            ):
                engine.step()
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str) or isinstance(prompts, dict):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    return list(prompts)


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling_params for {count} prompts")
    return params
