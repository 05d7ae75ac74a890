"""The n-gram (prompt lookup) proposer: exact matches on hand-made histories, and the
vectorised search against a plain-Python reference on random histories."""

from __future__ import annotations

import numpy as np
import pytest

from pagoda.spec_decode.proposers.ngram import NgramProposer, find_ngram_match


def reference_match(tokens: list[int], min_n: int, max_n: int) -> int:
    """Longest n in [min_n, max_n] whose final n-gram occurs earlier with a token after
    it; the most recent such occurrence's last index, or -1."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return end
    return -1


def test_copies_what_followed_the_longest_match():
    proposer = NgramProposer(3, 1, 3)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # "6 7" occurs at 1-2 (then 8) and 6-7 (then 2); "2 6 7" only at the end; the
    # most recent "6 7" wins.
    assert find_ngram_match(np.array(tokens), 1, 3) == 7
    assert proposer.propose(tokens, 3) == [2, 6, 7]
    assert proposer.propose(tokens, 1) == [2]
    # A longer match beats a more recent shorter one.
    tokens = [1, 2, 3, 4, 9, 3, 4, 1, 2, 3]
    assert proposer.propose(tokens, 3) == [4, 9, 3]


def test_no_match_proposes_nothing():
    proposer = NgramProposer(4, 2, 4)
    assert proposer.propose([1, 2, 3, 4, 5], 4) == []
    assert proposer.propose([7], 4) == []
    assert proposer.propose([7, 7], 4) == []  # n=1 would match, but min is 2
    assert NgramProposer(4, 1, 4).propose([7, 7], 4) == [7]
    assert proposer.propose([1, 2, 1, 2], 0) == []


def test_proposal_stops_at_the_history_end():
    assert NgramProposer(5, 1, 2).propose([3, 4, 3, 4], 5) == [3, 4]


def test_bad_sizes_refused():
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        NgramProposer(2, 3, 2)
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        NgramProposer(0, 1, 2)


@pytest.mark.parametrize("vocab", [2, 3, 8])
def test_matches_the_reference_on_random_histories(vocab):
    rng = np.random.default_rng(vocab)
    for _ in range(300):
        length = int(rng.integers(1, 40))
        tokens = rng.integers(0, vocab, length).tolist()
        low = int(rng.integers(1, 4))
        high = low + int(rng.integers(0, 4))
        assert find_ngram_match(np.array(tokens), low, high) == reference_match(tokens, low, high)
