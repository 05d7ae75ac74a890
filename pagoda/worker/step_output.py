"""AsyncRunnerOutput: one step's results on their way from the device to the host.

The model runner launches a step (forward, then sampling) and returns at once; the
device-to-host copies of the sampled ids and logprobs are queued right behind the
step's kernels into pinned buffers, with an event after them. `result()` waits for
that event only, so the host can schedule and launch the next step first: the
copies were queued before the next step's kernels, so they never wait for them.
On CPU the work is already done and `result()` only converts.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagoda.core.kv_tiers import KVTransferReport
from pagoda.core.outputs import ModelRunnerOutput
from pagoda.sample.logprobs import unpack_token_logprobs
from pagoda.sample.verify import accept_draft_tokens


def _start_copy(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


class AsyncRunnerOutput:
    """Sampled ids (+ logprobs) of one step; `result()` builds the ModelRunnerOutput."""

    def __init__(self, req_ids: list[str], sample_req_ids: list[str],
                 sampled: Optional[torch.Tensor], packed_logprobs: Optional[torch.Tensor],
                 wanted_logprobs: list[Optional[int]],
                 packed_prompt_logprobs: dict[str, torch.Tensor],
                 drafts: Optional[dict[str, list[int]]] = None,
                 spec_token_ids: Optional[dict[str, list[int]]] = None,
                 kv_transfers: Optional[KVTransferReport] = None) -> None:
        """sample_req_ids: the request of each sampled row (a verifying request's rows
        in a row); drafts: req_id -> the drafts those rows verify; spec_token_ids:
        req_id -> drafts proposed for the next step (already on the host); kv_transfers:
        the KV offload transfers finished by this step's launch (already on the host)."""
        self.kv_transfers = kv_transfers
        self.req_ids = req_ids
        self.spec_token_ids = spec_token_ids or {}
        self.sample_req_ids = sample_req_ids
        self.drafts = drafts or {}
        self.wanted_logprobs = wanted_logprobs
        self._sampled = None if sampled is None else _start_copy(sampled)
        self._logprobs = None if packed_logprobs is None else _start_copy(packed_logprobs)
        self._prompt_logprobs = {rid: _start_copy(t) for rid, t in packed_prompt_logprobs.items()}
        self._event: Optional[torch.cuda.Event] = None
        on_cuda = any(t is not None and t.device.type == "cuda"
                      for t in (sampled, packed_logprobs, *packed_prompt_logprobs.values()))
        if on_cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        self._result: Optional[ModelRunnerOutput] = None

    @classmethod
    def empty(cls, kv_transfers: Optional[KVTransferReport] = None) -> "AsyncRunnerOutput":
        return cls([], [], None, None, [], {}, kv_transfers=kv_transfers)

    def result(self) -> ModelRunnerOutput:
        """Waits for this step's copies (not for any later step) and converts them."""
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            self._result = self._convert()
        return self._result

    def _convert(self) -> ModelRunnerOutput:
        sampled = [] if self._sampled is None else self._sampled.tolist()
        logprobs: list = [None] * len(sampled)
        if self._logprobs is not None:
            converted = unpack_token_logprobs(self._logprobs, [w or 0 for w in self.wanted_logprobs])
            logprobs = [lp if w is not None else None
                        for lp, w in zip(converted, self.wanted_logprobs)]
        tokens_of: dict[str, list[int]] = {}
        logprobs_of: dict[str, list] = {}
        for req_id, token, lp in zip(self.sample_req_ids, sampled, logprobs):
            tokens_of.setdefault(req_id, []).append(token)
            logprobs_of.setdefault(req_id, []).append(lp)
        result = ModelRunnerOutput(
            req_ids=self.req_ids, sampled_token_ids=[],
            prompt_logprobs={rid: unpack_token_logprobs(t) for rid, t in self._prompt_logprobs.items()},
            spec_token_ids=dict(self.spec_token_ids), kv_transfers=self.kv_transfers)
        for req_id in self.req_ids:
            tokens = tokens_of.get(req_id, [])
            drafts = self.drafts.get(req_id)
            if drafts is not None:
                tokens = accept_draft_tokens(tokens, drafts)
            result.sampled_token_ids.append(tokens)
            lps = logprobs_of.get(req_id)
            result.logprobs.append(None if lps is None or lps[0] is None else lps[:len(tokens)])
        return result
