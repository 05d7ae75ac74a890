"""AsyncRunnerOutput: one step's results on their way from the device to the host.

The model runner launches a step (forward, then sampling) and returns at once; the
device-to-host copies of the sampled ids and logprobs are queued right behind the
step's kernels into pinned buffers, with an event after them. `result()` waits for
that event only, so the host can schedule and launch the next step first: the
copies were queued before the next step's kernels, so they never wait for them.
The copies run on a stream of their own that waits for the sampling, so the main
stream's next step (the pending-token fill, the next graph) does not queue behind them
either (FP8 batch 1 2.618 -> 2.607 ms with the one-launch pending fill, H200;
docs/performance.md, "Measured reasons: Launch"); the device tensors are marked as used
by that stream (record_stream) so their memory is not reused before the copies end.
On CPU the work is already done and `result()` only converts.
"""

from __future__ import annotations

import contextlib

import torch

from pagoda.core.outputs import ModelRunnerOutput
from pagoda.kv_offload.planning.tiers import KVTransferReport
from pagoda.sample.logprobs import unpack_token_logprobs
from pagoda.spec_decode.verify import accept_draft_tokens

_copy_streams: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's stream for the step outputs' copies (made on first use)."""
    if device not in _copy_streams:
        _copy_streams[device] = torch.cuda.Stream(device=device)
    return _copy_streams[device]


def _start_copy(tensor: torch.Tensor, stream: torch.cuda.Stream | None) -> torch.Tensor:
    """A pinned host copy of tensor, queued on the current stream (CUDA), or tensor."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    if stream is not None:
        tensor.record_stream(stream)
    return host


class AsyncRunnerOutput:
    """Sampled ids (+ logprobs) of one step; `result()` builds the ModelRunnerOutput."""

    def __init__(
        self,
        req_ids: list[str],
        sample_req_ids: list[str],
        sampled: torch.Tensor | None,
        packed_logprobs: torch.Tensor | None,
        wanted_logprobs: list[int | None],
        packed_prompt_logprobs: dict[str, torch.Tensor],
        drafts: dict[str, list[int]] | None = None,
        spec_token_ids: dict[str, list[int]] | None = None,
        kv_transfers: KVTransferReport | None = None,
    ) -> None:
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
        self._event: torch.cuda.Event | None = None
        cuda = [
            t
            for t in (sampled, packed_logprobs, *packed_prompt_logprobs.values())
            if t is not None and t.device.type == "cuda"
        ]
        stream = _copy_stream(cuda[0].device) if cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(cuda[0].device))  # the sampling
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self._sampled = None if sampled is None else _start_copy(sampled, stream)
            self._logprobs = (
                None if packed_logprobs is None else _start_copy(packed_logprobs, stream)
            )
            self._prompt_logprobs = {
                rid: _start_copy(t, stream) for rid, t in packed_prompt_logprobs.items()
            }
            if cuda:
                self._event = torch.cuda.Event()
                self._event.record()  # on the copies' stream
        self._result: ModelRunnerOutput | None = None

    @classmethod
    def empty(cls, kv_transfers: KVTransferReport | None = None) -> AsyncRunnerOutput:
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
            converted = unpack_token_logprobs(
                self._logprobs, [w or 0 for w in self.wanted_logprobs]
            )
            logprobs = [
                lp if w is not None else None for lp, w in zip(converted, self.wanted_logprobs)
            ]
        tokens_of: dict[str, list[int]] = {}
        logprobs_of: dict[str, list] = {}
        for req_id, token, lp in zip(self.sample_req_ids, sampled, logprobs):
            tokens_of.setdefault(req_id, []).append(token)
            logprobs_of.setdefault(req_id, []).append(lp)
        result = ModelRunnerOutput(
            req_ids=self.req_ids,
            sampled_token_ids=[],
            prompt_logprobs={
                rid: unpack_token_logprobs(t) for rid, t in self._prompt_logprobs.items()
            },
            spec_token_ids=dict(self.spec_token_ids),
            kv_transfers=self.kv_transfers,
        )
        for req_id in self.req_ids:
            tokens = tokens_of.get(req_id, [])
            drafts = self.drafts.get(req_id)
            if drafts is not None:
                tokens = accept_draft_tokens(tokens, drafts)
            result.sampled_token_ids.append(tokens)
            lps = logprobs_of.get(req_id)
            result.logprobs.append(None if lps is None or lps[0] is None else lps[: len(tokens)])
        return result
