"""Verifying draft tokens by token match: which of a request's sampled rows it keeps.

A verify step computes a request's last known token and its k drafts in one forward
and samples one token per row: row i predicts the token after draft i (row 0: after
the last known token). drafts[i] is accepted when the token sampled at row i equals
it; the kept tokens are the sampled rows up to and including the first mismatch (all
k + 1 when every draft matched, the last one being the bonus token).

Exactness: for a proposer whose draft is a single token (n-gram lookup, a greedy draft
model), keeping a draft d with probability p(d) and otherwise a token x != d with
probability p(x) / (1 - p(d)) (rejection sampling against a one-hot proposal) is the
same distribution as sampling x ~ p and keeping it whether or not it equals d. So
sampling each row as usual and comparing is the exact rejection sampler for such
proposers; greedy rows make it exact argmax verification. A proposer with a full
draft distribution needs probability-ratio acceptance instead.
"""

from __future__ import annotations

from collections.abc import Sequence


def accept_draft_tokens(sampled: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The tokens a request keeps from its verify rows (len(sampled) == len(drafts) + 1)."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(
            f"a verify step samples one row per draft plus one: got "
            f"{len(sampled)} rows for {len(drafts)} drafts"
        )
    kept = []
    for i, token in enumerate(sampled):
        kept.append(token)
        if i == len(drafts) or token != drafts[i]:
            break
    return kept
