"""The batched sampler: logits [B, V] + SamplingMetadata -> one token per row.

Order of work (vLLM's): logit bias, min_tokens bans, penalties; then greedy rows
take the argmax; random rows go through temperature, min-p, top-k, top-p and are
sampled. Logprobs are taken from the raw logits (before any of this). On CUDA an
all-greedy batch that nothing else touches (no bias, bans, penalties or logprobs) takes
the argmax of the model's logits as they are, without the float32 copy; greedy argmaxes
on CUDA go through pagoda.kernels.sample.argmax (greedy_argmax).

Sampling is exact per row: token = argmax(probs / q) with q ~ Exp(1) i.i.d. per
token (the exponential-race form of categorical sampling). A seeded row draws its
q alone from its own generator, so its tokens depend only on its logits, params
and generator - not on the batch it is in or its position. Unseeded rows share
one batch-wide draw.

No host sync: every branch is taken on Python flags of the metadata, never on
tensor values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.sample.logprobs import compute_token_logprobs
from pagoda.sample.metadata import SamplingMetadata
from pagoda.sample.penalties import apply_logit_bias, apply_min_tokens_bans, apply_penalties

_MINUS_INF = float("-inf")
# Top-k alone (no top-p) with every k up to this uses torch.topk instead of a full
# sort of the vocabulary: selecting k values is much cheaper than sorting them all
# (figures: docs/performance.md, "measured reasons").
TOP_K_ONLY_MAX_K = 1024


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    # Present when a row asked for logprobs: the sampled token first, then the top-k
    # of the batch's largest k (rows asking fewer keep a prefix).
    logprobs_token_ids: torch.Tensor | None = None  # [B, k+1] int64
    logprobs: torch.Tensor | None = None  # [B, k+1] float32
    sampled_ranks: torch.Tensor | None = None  # [B] int64, 1-based


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    if temperature is None:
        return logits
    return logits / temperature.unsqueeze(1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Drops tokens whose probability is below min_p * (the row's top probability)."""
    if min_p is None:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, _MINUS_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keeps the k largest logits, then the smallest prefix whose mass reaches top_p.

    Works in descending order from a stable sort, so ties are ordered by token id:
    top_k=1 keeps exactly the token greedy argmax picks. Top-p keeps a token when the
    mass of the tokens before it is < top_p (the first token is always kept); top-p
    is computed on the distribution left after top-k, as vLLM does.
    """
    if top_k is None and top_p is None:
        return logits
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        positions = torch.arange(logits.shape[1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(
            positions.unsqueeze(0) >= top_k.unsqueeze(1), _MINUS_INF
        )
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Exclusive prefix sum, shifted rather than (cumsum - probs) to stay exact.
        mass_before = F.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))
        top_p = top_p.unsqueeze(1)
        # top_p == 1 keeps all: float rounding may make the cumsum reach 1 early.
        drop = (mass_before >= top_p) & (top_p < 1.0)
        sorted_logits = sorted_logits.masked_fill(drop, _MINUS_INF)
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Top-k without a full sort; the same tokens as `apply_top_k_top_p(logits, top_k, None)`.

    Keeps the logits above the row's k-th largest value, then as many of those equal
    to it as fit in k, lowest token ids first (the stable sort's order).
    """
    vocab_size = logits.shape[1]
    top_k = top_k.unsqueeze(1)
    largest = logits.topk(max_top_k, dim=-1).values
    # Disabled rows (k = V) read any column; they keep everything below.
    kth_value = largest.gather(1, top_k.clamp(max=max_top_k) - 1)
    above = logits > kth_value
    tied = logits == kth_value
    room_for_ties = top_k - above.sum(dim=-1, keepdim=True)
    keep = above | (tied & (tied.cumsum(dim=-1) <= room_for_ties)) | (top_k >= vocab_size)
    return logits.masked_fill(~keep, _MINUS_INF)


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Bias, min_tokens bans and penalties: what greedy and random rows both see."""
    logits = apply_logit_bias(logits, metadata.logit_bias)
    logits = apply_min_tokens_bans(logits, metadata.min_tokens_bans)
    return apply_penalties(logits, metadata.penalties)


def filter_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p: the distribution random rows sample from."""
    logits = apply_temperature(logits, metadata.temperature)
    logits = apply_min_p(logits, metadata.min_p)
    if (
        metadata.top_p is None
        and metadata.max_top_k is not None
        and metadata.max_top_k <= TOP_K_ONLY_MAX_K
    ):
        return apply_top_k_only(logits, metadata.top_k, metadata.max_top_k)
    return apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)


def draw_exponential_noise(shape: torch.Size, metadata: SamplingMetadata) -> torch.Tensor:
    """q ~ Exp(1) [B, V]: seeded rows from their own generator, the rest in one draw."""
    noise = torch.empty(shape, dtype=torch.float32, device=metadata.device)
    if len(metadata.seeded_random_rows) < metadata.num_rows:
        noise.exponential_(generator=metadata.generator)
    for row in metadata.seeded_random_rows:
        # A row of a contiguous [B, V] tensor draws exactly what a fresh [V] tensor would.
        noise[row].exponential_(generator=metadata.generators[row])
    # exponential_ may return 0; keep probs / q finite (0 / 0 would be NaN, and argmax picks NaN).
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def sample_random(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    noise = draw_exponential_noise(probs.shape, metadata)
    return (probs / noise).argmax(dim=-1)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> int64 [B]: torch.argmax's tokens (the lowest index among ties, the
    first NaN before any number). On CUDA through pagoda.kernels.sample.argmax where it takes
    the shape: torch's reduction picks a slow launch configuration at some vocabulary
    sizes (Llama-3's among them)."""
    if logits.is_cuda:
        from pagoda.kernels.sample.argmax import (  # imports triton: CUDA only
            argmax_covers,
            argmax_rows,
        )

        if argmax_covers(logits):
            return argmax_rows(logits)
    return logits.argmax(dim=-1)


def takes_model_logits_argmax(logits: torch.Tensor, metadata: SamplingMetadata) -> bool:
    """Whether the sampled tokens are the argmax of the logits as the model gave them:
    every row greedy (greedy rows see no temperature or filter), nothing that edits
    logits (bias, min_tokens bans, penalties: process_logits), no logprobs (taken from
    float32 logits), and a dtype that widens to float32 exactly."""
    return (
        metadata.all_greedy
        and metadata.logit_bias is None
        and metadata.min_tokens_bans is None
        and metadata.penalties is None
        and metadata.max_num_logprobs is None
        and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


class Sampler:
    """Stateless: all per-step state is in the SamplingMetadata."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape != (metadata.num_rows, metadata.vocab_size):
            raise ValueError(
                f"logits must be [{metadata.num_rows}, {metadata.vocab_size}] to match the metadata, "
                f"got {list(logits.shape)}"
            )
        if logits.is_cuda and takes_model_logits_argmax(logits, metadata):
            # Widening to float32 is exact and monotonic: it cannot move the argmax.
            return SamplerOutput(sampled_token_ids=greedy_argmax(logits))
        raw_logits = logits.to(torch.float32)
        sampled = self._sample(process_logits(raw_logits, metadata), metadata)
        output = SamplerOutput(sampled_token_ids=sampled)
        if metadata.max_num_logprobs is not None:
            ids, logprobs, ranks = compute_token_logprobs(
                raw_logits, sampled, metadata.max_num_logprobs
            )
            output.logprobs_token_ids, output.logprobs, output.sampled_ranks = ids, logprobs, ranks
        return output

    @staticmethod
    def _sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy = None
        if not metadata.all_random:
            greedy = greedy_argmax(logits)
            if metadata.all_greedy:
                return greedy
        random = sample_random(filter_logits(logits, metadata), metadata)
        if greedy is None:
            return random
        return torch.where(metadata.is_greedy, greedy, random)
