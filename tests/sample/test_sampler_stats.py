"""Statistical tests of the sampler: empirical distributions match the definitions.

20,000 rows with the same logits over a vocabulary of 8 are sampled as one batch
from a fixed seed, so each test is deterministic. The expected distributions are
computed here in float64 from the definitions of temperature, top-k, top-p and
min-p, independently of the implementation. Pearson's chi-square is compared to
its 0.9999 quantile; tokens the definition excludes must never be drawn. Each test
also checks that the same samples reject a slightly wrong expectation (temperature
ignored, one token too many or too few), so the statistic has the power to catch
those bugs.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagoda.sample.metadata import SamplingRow, build_sampling_metadata, make_generator
from pagoda.sample.sampler import Sampler
from pagoda.sampling_params import SamplingParams

NUM_SAMPLES = 20_000
LOGITS = [1.2, 0.9, 0.5, 0.2, -0.1, -0.6, -1.0, -1.5]
VOCAB = len(LOGITS)
# Upper 0.9999 quantiles of chi-square with df = 1..7 degrees of freedom.
CHI2_9999 = {1: 15.137, 2: 18.421, 3: 21.108, 4: 23.513, 5: 25.745, 6: 27.856, 7: 29.878}


def softmax(values: list[float], temperature: float = 1.0) -> list[float]:
    top = max(values)
    weights = [math.exp((v - top) / temperature) for v in values]
    total = sum(weights)
    return [w / total for w in weights]


def renormalized(probs: list[float], allowed: set[int]) -> list[float]:
    total = sum(probs[i] for i in allowed)
    return [p / total if i in allowed else 0.0 for i, p in enumerate(probs)]


def top_k_tokens(probs: list[float], k: int) -> set[int]:
    return set(sorted(range(len(probs)), key=lambda i: -probs[i])[:k])


def top_p_tokens(probs: list[float], p: float) -> set[int]:
    """The smallest most-probable prefix whose mass reaches p."""
    kept, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        if mass >= p:
            break
        kept.add(i)
        mass += probs[i]
    return kept


def min_p_tokens(probs: list[float], min_p: float) -> set[int]:
    return {i for i, q in enumerate(probs) if q >= min_p * max(probs)}


def matches(counts: list[int], expected: list[float]) -> bool:
    """Chi-square goodness of fit at the 1e-4 level; a draw of an excluded token fails."""
    if any(c > 0 and p == 0.0 for c, p in zip(counts, expected)):
        return False
    support = [(c, p) for c, p in zip(counts, expected) if p > 0.0]
    n = sum(counts)
    chi2 = sum((c - n * p) ** 2 / (n * p) for c, p in support)
    return chi2 < CHI2_9999[len(support) - 1]


def empirical_counts(params: SamplingParams, seeded: bool = False) -> list[int]:
    """Samples NUM_SAMPLES rows with LOGITS in one batch, deterministically."""
    torch.manual_seed(0)
    if seeded:  # every row its own generator: the per-row noise path
        rows = [
            SamplingRow(params.clone(seed=s), [], [], make_generator(s, "cpu"))
            for s in range(NUM_SAMPLES)
        ]
    else:
        rows = [SamplingRow(params, [], [], None)] * NUM_SAMPLES
    metadata = build_sampling_metadata(
        rows, VOCAB, "cpu", generator=make_generator(20240601, "cpu")
    )
    logits = torch.tensor([LOGITS], dtype=torch.float32).expand(NUM_SAMPLES, VOCAB).contiguous()
    tokens = Sampler()(logits, metadata).sampled_token_ids
    return torch.bincount(tokens, minlength=VOCAB).tolist()


PROBS = softmax(LOGITS)


def test_plain_sampling_matches_softmax():
    counts = empirical_counts(SamplingParams(temperature=1.0))
    assert matches(counts, PROBS)
    assert not matches(counts, softmax(LOGITS, 0.9))


def test_temperature():
    counts = empirical_counts(SamplingParams(temperature=0.7))
    assert matches(counts, softmax(LOGITS, 0.7))
    assert not matches(counts, PROBS)  # temperature ignored
    assert not matches(counts, softmax(LOGITS, 0.6))


def test_seeded_rows_sample_the_same_distribution():
    counts = empirical_counts(SamplingParams(temperature=0.7), seeded=True)
    assert matches(counts, softmax(LOGITS, 0.7))
    assert not matches(counts, PROBS)


@pytest.mark.parametrize("k", [2, 3, 5])
def test_top_k(k):
    counts = empirical_counts(SamplingParams(top_k=k))
    assert matches(counts, renormalized(PROBS, top_k_tokens(PROBS, k)))
    assert not matches(counts, renormalized(PROBS, top_k_tokens(PROBS, k + 1)))
    assert not matches(counts, renormalized(PROBS, top_k_tokens(PROBS, k - 1)))


@pytest.mark.parametrize("p", [0.5, 0.8])
def test_top_p(p):
    kept = top_p_tokens(PROBS, p)
    assert 2 <= len(kept) < VOCAB - 1  # the cutoff is interior
    counts = empirical_counts(SamplingParams(top_p=p))
    assert matches(counts, renormalized(PROBS, kept))
    by_prob = sorted(range(VOCAB), key=lambda i: -PROBS[i])
    one_more = set(by_prob[: len(kept) + 1])
    one_less = set(by_prob[: len(kept) - 1])
    assert not matches(counts, renormalized(PROBS, one_more))
    assert not matches(counts, renormalized(PROBS, one_less))
    # Top-p of the untempered distribution: also the plain probabilities are wrong.
    assert not matches(counts, PROBS)


def test_min_p():
    kept = min_p_tokens(PROBS, 0.3)
    assert 2 <= len(kept) < VOCAB
    counts = empirical_counts(SamplingParams(min_p=0.3))
    assert matches(counts, renormalized(PROBS, kept))
    by_prob = sorted(range(VOCAB), key=lambda i: -PROBS[i])
    assert not matches(counts, renormalized(PROBS, set(by_prob[: len(kept) + 1])))
    assert not matches(counts, renormalized(PROBS, set(by_prob[: len(kept) - 1])))


def test_temperature_then_min_p_top_k_top_p():
    # vLLM's order: temperature scales first, the filters see the tempered
    # distribution, and top-p sees what min-p and top-k left (renormalized).
    def allowed_tokens(probs: list[float]) -> set[int]:
        allowed = min_p_tokens(probs, 0.1) & top_k_tokens(probs, 3)
        return top_p_tokens(renormalized(probs, allowed), 0.8)

    tempered = softmax(LOGITS, 0.7)
    allowed = allowed_tokens(tempered)
    untempered_allowed = allowed_tokens(PROBS)
    assert allowed != untempered_allowed  # the order is observable
    counts = empirical_counts(SamplingParams(temperature=0.7, min_p=0.1, top_k=3, top_p=0.8))
    assert matches(counts, renormalized(tempered, allowed))
    assert not matches(counts, renormalized(PROBS, untempered_allowed))
    assert not matches(counts, renormalized(tempered, untempered_allowed))
