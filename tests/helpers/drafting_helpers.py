"""Test-only draft proposals: drive verify-shaped steps through a real engine.

`DraftingExecutor` wraps an executor's execute_model / sample_tokens (monkeypatched):
after each step it hands the scheduler, for every request that got tokens, the next
`num_drafts` tokens of a reference run as drafts (a speculative proposer's seam,
ModelRunnerOutput.spec_token_ids), making one of them wrong for the requests
`wrong(rid)` selects, and records (rid, drafts verified, tokens kept) per step.
"""

from __future__ import annotations

from collections.abc import Callable


class Done:
    """A RunnerOutputFuture whose output is already on the host."""

    def __init__(self, output) -> None:
        self.output = output

    def result(self):
        return self.output


class DraftingExecutor:
    def __init__(
        self,
        executor,
        reference: dict[str, list[int]],
        monkeypatch,
        num_drafts: int,
        wrong: Callable[[str], bool],
        vocab_size: int,
    ) -> None:
        self.inner_execute, self.inner_sample = executor.execute_model, executor.sample_tokens
        self.reference, self.num_drafts = reference, num_drafts
        self.wrong, self.vocab_size = wrong, vocab_size
        self.produced = {rid: 0 for rid in reference}
        self.steps: list[tuple[str, list[int], list[int]]] = []  # (rid, drafts, kept)
        self.launched = None
        monkeypatch.setattr(executor, "execute_model", self.execute_model)
        monkeypatch.setattr(executor, "sample_tokens", self.sample_tokens)

    @property
    def kept_several(self) -> int:
        return sum(len(kept) > 1 for _, _, kept in self.steps)

    def execute_model(self, out):
        self.launched = out
        return self.inner_execute(out)

    def sample_tokens(self, extras=None):
        output = self.inner_sample(extras).result()
        drafts_of = self.launched.scheduled_spec_decode_tokens
        for rid, kept in zip(output.req_ids, output.sampled_token_ids):
            if not kept:
                continue
            self.steps.append((rid, list(drafts_of.get(rid, [])), list(kept)))
            self.produced[rid] += len(kept)
            start = self.produced[rid]
            drafts = self.reference[rid][start : start + self.num_drafts]
            if self.wrong(rid) and len(drafts) > 1:
                drafts[1] = (drafts[1] + 1) % self.vocab_size
            output.spec_token_ids[rid] = drafts
        return Done(output)
