"""The worker's side of model drafters (speculative decoding): loading a draft model
or a checkpoint's MTP layer (before the KV cache is sized: its layers share the pool),
building the drafter a SpeculativeConfig names, handing the step's target hidden
states to a drafter that reads them (MTP), and, after a step's sampling, where each
asked request's drafting starts (its accepted tokens decide the position).

The scheduler asks for drafts through SchedulerOutput.num_drafts_to_propose; the
drafts go back in ModelRunnerOutput.spec_token_ids. n-gram drafts are the host's
(pagoda.spec_decode.planning.planner): no drafter here then.

Every asked request's kept tokens and new drafts are on the worker's host once it has
drafted (the drafting loop reads them): `record_kept` keeps them in its state, so that
an optimistic next step (scheduled before the scheduler has seen them, with
placeholder drafts: core/optimistic_drafts.py) is corrected on the worker's host.
"""

from __future__ import annotations

import torch

from pagoda.attention.selector import make_attention_backend
from pagoda.model.deepseek_mtp import load_deepseek_mtp
from pagoda.model.layers.attention import kv_cache_specs
from pagoda.spec_decode.proposers.draft_model import (
    DraftModelProposer,
    LoadedDraft,
    load_draft_model,
)
from pagoda.spec_decode.proposers.greedy_drafter import DraftStart, GreedyDrafter
from pagoda.spec_decode.proposers.layer_skip import LayerSkipProposer
from pagoda.spec_decode.proposers.mtp import MTPProposer
from pagoda.spec_decode.verify import accept_draft_tokens


def load_draft(runner) -> LoadedDraft | None:
    """The draft model of a draft_model speculative config, the MTP layer of an mtp
    one (None for other methods)."""
    spec = runner.config.speculative
    if spec is not None and spec.method == "mtp":
        return _load_mtp(runner)
    if spec is None or spec.method != "draft_model":
        return None
    return load_draft_model(
        spec.model,
        runner.arch,
        runner.config.model.load_format,
        runner.dtype,
        runner.device,
        runner.config.model.seed,
        runner.tp,
        runner.block_size,
        runner.kv_dtype,
    )


def _load_mtp(runner) -> LoadedDraft:
    """The target checkpoint's MTP layer, its attention in the pool layers after the
    target's."""
    first_layer = len(kv_cache_specs(runner.model, runner.block_size, runner.kv_dtype))
    mtp = load_deepseek_mtp(
        runner.model_path,
        runner.arch,
        runner.dtype,
        runner.device,
        first_layer,
        runner.tp,
        runner.config.model.load_format,
    )
    weight_bytes = sum(p.numel() * p.element_size() for p in mtp.parameters())
    specs = mtp.kv_cache_specs(runner.block_size, runner.kv_dtype)
    return LoadedDraft(mtp, runner.arch, weight_bytes, first_layer, specs)


def reads_target_hidden(drafter) -> bool:
    """Whether the drafter reads every row's target hidden state after each step (the
    runner's forward then computes every row's last layer)."""
    return isinstance(drafter, MTPProposer)


def feed_target_hidden(drafter, hidden, inputs, sampled, states: dict) -> None:
    """Hands a step's target hidden states and sampled ids to a drafter that reads them
    (before draft_starts / propose)."""
    if isinstance(drafter, MTPProposer):
        drafter.observe_step(hidden, inputs, sampled, states)


def make_drafter(runner, max_model_len: int) -> GreedyDrafter | MTPProposer | None:
    """The drafter for the runner's speculative config (None: none on the worker);
    called once the KV pool exists."""
    spec = runner.config.speculative
    if spec is None or spec.method == "ngram":
        return None
    if spec.method == "layer_skip":
        return LayerSkipProposer(
            runner.model,
            spec.num_layers,
            runner.backend,
            runner.kv_pool,
            runner.block_size,
            runner.device,
            max_model_len,
            spec.draft_confidence_threshold,
        )
    if spec.method == "draft_model":
        return _draft_model_proposer(runner, spec, max_model_len)
    if spec.method == "mtp":
        return MTPProposer(
            runner.draft.model,
            runner.model,
            runner.backend,
            runner.kv_pool,
            runner.block_size,
            runner.device,
            max_model_len,
            spec.draft_confidence_threshold,
        )
    raise ValueError(f"speculative_config method {spec.method!r} is not available on the worker")


def _draft_model_proposer(runner, spec, max_model_len: int):

    config = runner.config
    backend = make_attention_backend(
        config.device.attention_backend,
        config.device.device,
        runner.draft.arch.attention_shape(runner.tp.size),
    )
    graphs = runner.capture_cuda_graphs(runner.draft.model, backend, max_model_len)
    return DraftModelProposer(
        runner.draft,
        backend,
        runner.kv_pool,
        runner.block_size,
        runner.device,
        max_model_len,
        config.scheduler.max_num_batched_tokens,
        config.scheduler.max_num_seqs,
        spec.draft_confidence_threshold,
        graphs,
    )


def draft_starts(
    states: dict, inputs, sampled: torch.Tensor, to_propose: dict[str, int]
) -> list[DraftStart]:
    """Per request asked for drafts: its newest token and that token's position, from
    the step's sampled rows (waits for them: the host needs the accepted count), and
    the tokens the worker's state lacks (a pending one: read from the step's inputs)."""
    rows = sampled.tolist()
    first_row: dict[str, int] = {}
    for row, req_id in enumerate(inputs.sample_req_ids):
        first_row.setdefault(req_id, row)
    asked = [rid for rid in to_propose if rid in first_row]
    pending = _pending_tokens(inputs, first_row, asked)
    starts = []
    for req_id in asked:
        state = states[req_id]
        verified = inputs.verified_drafts.get(req_id, [])
        row = first_row[req_id]
        kept = accept_draft_tokens(rows[row : row + len(verified) + 1], verified)
        tail = ([pending[req_id]] if req_id in pending else []) + kept
        # Row 0 sampled after the last known token (pending: the one the previous step
        # sampled, not in state yet); the newest kept token comes len(kept) later.
        last = state.num_tokens - 1 + int(req_id in pending)
        starts.append(
            DraftStart(
                req_id,
                kept[-1],
                last + len(kept),
                to_propose[req_id],
                state.block_ids,
                state.prompt_token_ids,
                state.output_token_ids,
                tail,
            )
        )
    return starts


def record_kept(
    states: dict, inputs, starts: list[DraftStart], proposals: dict[str, list[int]]
) -> None:
    """After drafting: each asked request's state takes its tokens the scheduler has
    not seen (start.tail: a pending one, then the step's kept ones) as unsent output
    tokens, the drafts the step rejected of those the scheduler counted, and its new
    drafts (input_batch.py, optimistic steps)."""
    for start in starts:
        state = states[start.req_id]
        num_kept = len(start.tail) - int(start.req_id in inputs.pending_output)
        state.output_token_ids.extend(start.tail)
        state.num_unsent += len(start.tail)
        state.num_rejected = state.num_scheduled_drafts + 1 - num_kept
        state.proposed = proposals.get(start.req_id, [])


def _pending_tokens(inputs, first_row: dict[str, int], asked: list[str]) -> dict[str, int]:
    """req_id -> its pending token (the previous step's sample, known on the device
    only): the step fed it at the request's first sampled row."""
    wanted = [rid for rid in asked if rid in inputs.pending_output]
    if not wanted:
        return {}
    rows = torch.tensor(
        [inputs.sample_rows[first_row[rid]] for rid in wanted], dtype=torch.long
    ).to(inputs.input_ids.device)
    return dict(zip(wanted, inputs.input_ids.index_select(0, rows).tolist()))
