"""Speculative decoding's engine-side set-up: the scheduler's DraftPlanner for a
SpeculativeConfig, and the KV lookahead its proposer needs.

n-gram drafts are proposed on the host (the planner calls the proposer after each
step); model drafters (layer_skip, draft_model, mtp) run on the worker, which writes
their drafts' KV past the scheduled tokens: the scheduler reserves k lookahead slots
for it.
"""

from __future__ import annotations

from pagoda.config import SpeculativeConfig
from pagoda.spec_decode.planning.budget import MIN_GAIN, SpecBudget
from pagoda.spec_decode.planning.planner import DraftPlanner
from pagoda.spec_decode.proposers.ngram import NgramProposer

# Tokens per step from which drafts stop paying, when speculative_config does not say
# (compute_bound_tokens). GPU: an 8B model's decode GEMMs on an H200 reach the ridge
# (~790 TFLOP/s over ~4.3 TB/s, ~185 FLOP per weight byte) at a couple of hundred rows,
# but verify rows cost more before that (attention, sampling, host work per row):
# measured at 80 % acceptance, 160-row steps (32 requests x 5) still paid 1.6x over off,
# 640-row steps (128 x 5) lost (0.84x), and 256 rows at 128 requests lost too (0.71x).
# CPU (2 cores, SmolLM2-135M): a step's cost doubles from 1 to ~16 tokens.
COMPUTE_BOUND_TOKENS = {"cuda": 128, "cpu": 16}


def draft_cost(
    spec: SpeculativeConfig, num_target_layers: int, draft_weight_fraction: float = 0.0
) -> float:
    """One draft token's proposer work, in target forwards: a layer-skip draft runs
    num_layers of the target's layers (its LM head is left out: the estimate only has
    to rank depths); a draft model or an MTP layer reads its weights once per draft
    (a decode step is memory-bound: its cost follows the bytes read),
    draft_weight_fraction of the target's; n-gram lookups are free."""
    if spec.method == "layer_skip":
        spec.check_target(num_target_layers)
        return spec.num_layers / num_target_layers
    if spec.method in ("draft_model", "mtp"):
        return draft_weight_fraction
    return 0.0


def build_draft_planner(
    spec: SpeculativeConfig | None,
    device: str,
    max_model_len: int,
    num_target_layers: int,
    draft_weight_fraction: float = 0.0,
    async_scheduling: bool = False,
) -> tuple[DraftPlanner | None, int]:
    """(the scheduler's planner, its num_lookahead_tokens); (None, 0) when off.
    draft_weight_fraction: a draft model's weight bytes over the target's;
    async_scheduling: the scheduler's (with the host proposer, n-gram, a drafting step
    then holds the batch; worker proposers are scheduled optimistically)."""
    if spec is None:
        return None, 0
    bound = spec.compute_bound_tokens or COMPUTE_BOUND_TOKENS.get(device, 16)
    # A draft pays when its expected gain covers its verification and its proposer.
    budget = SpecBudget(
        spec.num_speculative_tokens,
        bound,
        adaptive=spec.adaptive,
        min_gain=MIN_GAIN + draft_cost(spec, num_target_layers, draft_weight_fraction),
        drafting_holds=async_scheduling and spec.method == "ngram",
    )
    if spec.method == "ngram":
        proposer = NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
        return DraftPlanner(budget, max_model_len, proposer.propose), 0
    return DraftPlanner(budget, max_model_len), spec.num_speculative_tokens
