"""N-gram (prompt lookup) proposer: drafts a request's next tokens by finding its last
n tokens earlier in its own prompt + output and copying what followed them there.

Runs on the host after each step's tokens are known (the scheduler calls it through a
plain callable, so pagoda.core stays free of this module). numpy only, no torch: the
search over the history is vectorised - one comparison of the whole history against
each of the last n tokens - never a Python loop over tokens.

Which match: the longest n in [prompt_lookup_min, prompt_lookup_max] that occurs, and
among its occurrences the most recent one (the nearest context is the likeliest to
continue the same way; the suffix itself is not a candidate).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int
    ) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{prompt_lookup_min} and {prompt_lookup_max}"
            )
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: Sequence[int] | np.ndarray, max_drafts: int) -> list[int]:
        """Up to min(k, max_drafts) draft tokens continuing token_ids (none: no match)."""
        k = min(self.k, max_drafts)
        tokens = np.asarray(token_ids, dtype=np.int64)
        end = find_ngram_match(tokens, self.min_n, self.max_n)
        if k <= 0 or end < 0:
            return []
        return tokens[end + 1 : end + 1 + k].tolist()


def find_ngram_match(tokens: np.ndarray, min_n: int, max_n: int) -> int:
    """The index j of the last token of the chosen earlier occurrence of the history's
    final n-gram (j + 1 < len(tokens), so something follows it), or -1 if none.

    alive[j] after step n says tokens[j - n + 1 .. j] == tokens[L - n .. L - 1]; each
    step narrows it with one vectorised comparison."""
    length = len(tokens)
    if length < min_n + 1:
        return -1
    # Candidate ends j in [0, L - 2]: the occurrence must have a following token.
    alive = tokens[: length - 1] == tokens[length - 1]
    best = -1
    for n in range(1, min(max_n, length - 1) + 1):
        if n > 1:
            # The token n - 1 places before each candidate end must match too; ends
            # j < n - 1 have no room for an n-gram.
            alive[: n - 1] = False
            alive[n - 1 :] &= tokens[: length - n] == tokens[length - n]
        hits = np.flatnonzero(alive)
        if len(hits) == 0:
            break
        if n >= min_n:
            best = int(hits[-1])
    return best
