"""The worker's side of model drafters (speculative decoding): building the drafter a
SpeculativeConfig names, and, after a step's sampling, where each asked request's
drafting starts (its accepted tokens decide the position).

The scheduler asks for drafts through SchedulerOutput.num_drafts_to_propose; the
drafts go back in ModelRunnerOutput.spec_token_ids. n-gram drafts are the host's
(pagoda.core.draft_planner): no drafter here then.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagoda.sample.verify import accept_draft_tokens
from pagoda.spec_decode.layer_skip import DraftStart, LayerSkipProposer


def make_drafter(runner, max_model_len: int) -> Optional[LayerSkipProposer]:
    """The drafter for the runner's speculative config (None: none on the worker)."""
    spec = runner.config.speculative
    if spec is None or spec.method == "ngram":
        return None
    if spec.method == "layer_skip":
        return LayerSkipProposer(runner.model, spec.num_layers, runner.backend,
                                 runner.kv_pool, runner.block_size, runner.device,
                                 max_model_len)
    raise ValueError(f"speculative_config method {spec.method!r} is not available on the "
                     "worker")


def draft_starts(states: dict, inputs, sampled: torch.Tensor,
                 to_propose: dict[str, int]) -> list[DraftStart]:
    """Per request asked for drafts: its newest token and that token's position, from
    the step's sampled rows (waits for them: the host needs the accepted count)."""
    rows = sampled.tolist()
    first_row: dict[str, int] = {}
    for row, req_id in enumerate(inputs.sample_req_ids):
        first_row.setdefault(req_id, row)
    starts = []
    for req_id, num_drafts in to_propose.items():
        if req_id not in first_row:
            continue
        state = states[req_id]
        verified = inputs.verified_drafts.get(req_id, [])
        row = first_row[req_id]
        kept = accept_draft_tokens(rows[row:row + len(verified) + 1], verified)
        # Row 0 sampled after the last known token (pending: the one the previous step
        # sampled, not in state yet); the newest kept token comes len(kept) later.
        last = state.num_tokens - 1 + int(req_id in inputs.pending_output)
        starts.append(DraftStart(req_id, kept[-1], last + len(kept), num_drafts,
                                 state.block_ids))
    return starts
