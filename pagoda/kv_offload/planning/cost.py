"""Cost-aware admission of KV offload hits (no torch): which blocks of a prefix hit in the
tiers are worth loading, because loading them is expected to be faster than computing
them again.

A tier can be slower than recompute: an H200 prefills an 8B model at ~40k tokens/s, and
one token's KV is 128 KiB, so recompute "produces" KV at ~5 GB/s; a disk read at
1.5 GB/s loses to it. The engine keeps running estimates:
- per tier, its load bandwidth (bytes over the seconds the worker measured for its
  load copies: device-timed GPU copies for the CPU tier, the reader's wall time for a
  lower tier), seeded with what the worker measured at start-up, else with a
  conservative default per tier kind, until loads are measured;
- the engine's prefill throughput (tokens/s of steps that computed at least
  PREFILL_SAMPLE_MIN_TOKENS tokens, from the scheduler's step timing), seeded with the
  worker's start-up measurement of one prefill forward.

The model: recomputing a block costs block_tokens / prefill rate; loading a block from
tier j costs block_bytes / bandwidth_j, plus block_bytes / bandwidth_cpu when j is a
lower tier (its bytes go on through a CPU slot to the GPU). A hit is a prefix (block i
needs blocks < i), so the choice is a cut: load the first k blocks, recompute the rest.
The k chosen maximizes the time saved, sum over i < k of (recompute - load_i); the
smallest such k, so a block is loaded only when that is strictly faster. A slower tier's
part of a hit is dropped this way; its tier keeps its copy.

Exploration: a tier whose blocks are always skipped would never be measured again
(page caches warm, disks differ). After `explore_every` decisions in a row that
skipped a tier's blocks, the next hit that reaches that tier is loaded whole, and its
load is measured. A tier whose bandwidth the user pinned (kv_offloading_bandwidth) is
never re-measured nor explored.

Every estimate is an exponentially decayed ratio: on each observation the sums of
amount and seconds are multiplied by (1 - decay), then the observation is added.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# Load bandwidth assumed for a tier not measured yet, bytes/s, by tier name (a plugin
# tier gets the disk's). Conservative: a host-to-device copy from pinned memory runs at
# 20-50 GB/s, a local NVMe at 2-7 GB/s.
DEFAULT_LOAD_BYTES_PER_S = {"cpu": 8e9, "disk": 1e9}
DEFAULT_LOWER_LOAD_BYTES_PER_S = 1e9
# Prefill throughput assumed when the worker could not measure it.
DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0
# Steps that computed fewer tokens are mostly fixed per-step cost (decode steps): they
# say little about what recomputing a prefix costs, so they are not sampled.
PREFILL_SAMPLE_MIN_TOKENS = 256
PREFILL_DECAY = 0.125
LOAD_DECAY = 0.25
EXPLORE_EVERY = 32


class RunningRate:
    """amount per second, exponentially decayed; `seed` until the first observation."""

    def __init__(self, seed: float, decay: float, pinned: bool = False) -> None:
        if not seed > 0:
            raise ValueError(f"a rate must be > 0, got {seed!r}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        self.seed = float(seed)
        self.decay = decay
        self.pinned = pinned  # fixed by the user: observations are ignored
        self.amount = 0.0
        self.seconds = 0.0
        self.observations = 0

    @property
    def measured(self) -> bool:
        return self.observations > 0

    @property
    def value(self) -> float:
        return self.amount / self.seconds if self.observations else self.seed

    def observe(self, amount: float, seconds: float) -> None:
        """One measurement; ignored when pinned or when either figure is not > 0."""
        if self.pinned or not amount > 0 or not seconds > 0:
            return
        keep = 1.0 - self.decay if self.observations else 0.0
        self.amount = self.amount * keep + amount
        self.seconds = self.seconds * keep + seconds
        self.observations += 1


@dataclass
class LoadDecision:
    """How many leading blocks of a hit to load; the rest are recomputed."""

    num_load: int
    skipped: Counter = field(default_factory=Counter)  # tier index -> blocks not loaded
    explored: bool = False  # loaded whole to re-measure a tier that kept losing
    load_seconds: float = 0.0  # expected, for the blocks loaded
    recompute_seconds: float = 0.0  # expected, for the same blocks


class LoadCostModel:
    """The estimates and the cut. Tiers by index, top (CPU) first, as in the TierStack."""

    def __init__(
        self,
        tier_names: Sequence[str],
        block_bytes: int,
        block_tokens: int,
        prefill_sample: tuple[int, float] | None = None,
        load_samples: Mapping[str, tuple[int, float]] | None = None,
        pinned_bytes_per_s: Mapping[str, float] | None = None,
        explore_every: int = EXPLORE_EVERY,
    ) -> None:
        """prefill_sample (tokens, seconds) and load_samples (tier name -> bytes, seconds):
        what the worker measured at start-up; a tier without one starts at its kind's
        default. pinned_bytes_per_s: figures the user fixed (math.inf: always load from
        that tier)."""
        if block_bytes < 1 or block_tokens < 1:
            raise ValueError("block_bytes and block_tokens must be >= 1")
        if not isinstance(explore_every, int) or explore_every < 0:
            raise ValueError(
                f"explore_every must be an integer >= 0 (0: never), got {explore_every!r}"
            )
        pinned = dict(pinned_bytes_per_s or {})
        unknown = sorted(set(pinned) - set(tier_names))
        if unknown:
            raise ValueError(
                f"kv_offloading_bandwidth names tier(s) {', '.join(unknown)}; "
                f"the tiers are {', '.join(tier_names)}"
            )
        samples = dict(load_samples or {})
        self.tier_names = list(tier_names)
        self.block_bytes = block_bytes
        self.block_tokens = block_tokens
        self.explore_every = explore_every
        self.prefill = RunningRate(DEFAULT_PREFILL_TOKENS_PER_S, PREFILL_DECAY)
        if prefill_sample is not None:
            self.prefill.observe(*prefill_sample)
        self.bandwidth: list[RunningRate] = []
        for name in self.tier_names:
            if name in pinned:
                self.bandwidth.append(RunningRate(pinned[name], LOAD_DECAY, pinned=True))
                continue
            rate = RunningRate(
                DEFAULT_LOAD_BYTES_PER_S.get(name, DEFAULT_LOWER_LOAD_BYTES_PER_S), LOAD_DECAY
            )
            if name in samples:
                rate.observe(*samples[name])
            self.bandwidth.append(rate)
        self._skip_streak = [0] * len(self.tier_names)  # decisions in a row that skipped it

    # ---- measurements -----------------------------------------------------------------
    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= PREFILL_SAMPLE_MIN_TOKENS:
            self.prefill.observe(num_tokens, seconds)

    def observe_load(self, tier_name: str, num_bytes: int, seconds: float) -> None:
        if tier_name in self.tier_names:
            self.bandwidth[self.tier_names.index(tier_name)].observe(num_bytes, seconds)

    # ---- the decision -----------------------------------------------------------------
    def recompute_seconds(self) -> float:
        """Expected time to compute one block again."""
        return self.block_tokens / self.prefill.value

    def load_seconds(self, tier_index: int) -> float:
        """Expected time to bring one block from the tier to the GPU (through a CPU slot
        for a lower tier)."""
        seconds = self.block_bytes / self.bandwidth[tier_index].value
        if tier_index > 0:
            seconds += self.block_bytes / self.bandwidth[0].value
        return seconds

    def choose(self, sources: Sequence[int]) -> LoadDecision:
        """The cut for a hit whose block i is in tier sources[i] (the highest holding it)."""
        recompute = self.recompute_seconds()
        costs = {tier: self.load_seconds(tier) for tier in set(sources)}
        best, best_k, saved = 0.0, 0, 0.0
        for index, tier in enumerate(sources):
            saved += recompute - costs[tier]
            if saved > best:
                best, best_k = saved, index + 1
        skipped = Counter(sources[best_k:])
        explored = False
        if skipped and self.explore_every:
            due = [
                t
                for t in skipped
                if not self.bandwidth[t].pinned and self._skip_streak[t] + 1 >= self.explore_every
            ]
            if due:
                best_k, skipped, explored = len(sources), Counter(), True
        for tier in set(sources[:best_k]):
            self._skip_streak[tier] = 0
        for tier in skipped:
            self._skip_streak[tier] += 1
        load = math.fsum(costs[t] for t in sources[:best_k])
        return LoadDecision(best_k, skipped, explored, load, recompute * best_k)

    def snapshot(self) -> dict:
        """The estimates, for the stats: prefill tokens/s and each tier's bytes/s."""
        return {
            "prefill_tokens_per_s": self.prefill.value,
            "load_bytes_per_s": {
                name: rate.value for name, rate in zip(self.tier_names, self.bandwidth)
            },
        }
