"""Multi-token prediction (MTP) speculation: the checkpoint's own MTP layer
(pagoda/model/deepseek_mtp.py) drafts from the target's hidden states.

The layer at position i reads the target's final hidden state at i and the token at
i + 1, and keeps its own KV (pool layers after the target's, like a draft model's).
So it runs on every scheduled row of every request, every step, right after the
target's forward (`observe_step`: the runner hands over the step's hidden states and
sampled ids), prefill rows included: a request that drafts later finds the layer's
cache filled. A row's next token is the next row's input, or, for the last row of a
chunk that samples nothing, the request's next known token; a sampled row's is the
token sampled there.

Drafting (`propose`): for a request whose newest token t sits at position P, the
step's row at P - 1 (input t, the target's hidden state at P - 1) gives the first
draft; each further draft applies the layer again one position on, fed its previous
draft and the layer's own output hidden state in place of the target's.

KV invariant (layer-skip's, spec_decode/proposers/layer_skip.py): the rows of a verify
step past the accepted drafts, and the chained draft positions P .. P + k - 2, write
values computed from guesses; the next step schedules every position from P on again
and its `observe_step` stores each of them before it attends, so no forward reads a
stale value. Hidden states of rejected rows are never read: drafts start from the row
of the newest accepted token. A prefix-cache hit brings the layer's KV with the target's;
the entry at a cached block's last position was computed with the token after it in
the request that wrote it (a guess's quality, never an output, depends on it).
"""

from __future__ import annotations

import torch

from pagoda.attention.forward_context import forward_context
from pagoda.spec_decode.proposers.greedy_drafter import DraftStart, Segment, segment_inputs


class MTPProposer:
    def __init__(
        self,
        mtp,
        target,
        backend,
        kv_pool,
        block_size: int,
        device: torch.device,
        max_model_len: int,
        confidence_threshold: float | None = None,
    ) -> None:
        """mtp: the loaded DeepseekMTP (its attention in pool layers after the
        target's); target: the target model, whose token embedding the layer shares."""
        self.mtp, self.embed = mtp, target.model.embed_tokens
        self.backend, self.kv_pool = backend, kv_pool
        self.block_size, self.device = block_size, device
        self.max_model_len = max_model_len
        self.confidence_threshold = confidence_threshold
        # The last step's MTP output rows, and req_id -> (its first row, that row's
        # position); None until a step ran, and once its drafts are proposed.
        self._step: tuple[torch.Tensor, dict[str, tuple[int, int]]] | None = None

    @torch.inference_mode()
    def observe_step(self, hidden: torch.Tensor, inputs, sampled, states: dict) -> None:
        """Runs the layer over the step's rows (inputs: the runner's StepInputs; hidden:
        the target's final hidden state of every row; sampled: the sampled ids of
        inputs.sample_rows on the device, or None when no row sampled)."""
        metadata = inputs.metadata
        rows = inputs.input_ids.shape[0]
        starts = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        first = {
            req_id: (starts[i], seq_lens[i] - (starts[i + 1] - starts[i]))
            for i, req_id in enumerate(inputs.req_ids)
        }
        next_ids = self._next_tokens(inputs, sampled, states, starts, seq_lens)
        plan = self.backend.build_metadata(metadata)
        with forward_context(self.backend, plan, self.kv_pool):
            out = self.mtp(self.embed(next_ids), inputs.positions, hidden[:rows])
        self._step = (out, first)

    def _next_tokens(self, inputs, sampled, states, starts, seq_lens) -> torch.Tensor:
        """The token after each row's: the next row's input; the request's next token
        after a chunk that samples nothing; the sampled token at a sampled row."""
        next_ids = torch.roll(inputs.input_ids, -1)
        sampled_rows = set(inputs.sample_rows)
        fix_rows, fix_tokens = [], []
        for i, req_id in enumerate(inputs.req_ids):
            last = starts[i + 1] - 1
            if last in sampled_rows:
                continue
            state, pos = states[req_id], seq_lens[i]
            fix_rows.append(last)
            # A chunk that samples nothing stops before the request's last known token.
            fix_tokens.append(state.token_at(pos) if pos < state.num_tokens else 0)
        if fix_rows:
            both = torch.tensor([fix_rows, fix_tokens], dtype=torch.long).to(self.device)
            next_ids.index_copy_(0, both[0], both[1])
        if sampled is not None and inputs.sample_rows:
            index = torch.tensor(inputs.sample_rows, dtype=torch.long).to(self.device)
            next_ids.index_copy_(0, index, sampled.to(next_ids.dtype))
        return next_ids

    @torch.inference_mode()
    def propose(self, starts: list[DraftStart]) -> dict[str, list[int]]:
        """req_id -> its greedy drafts (fewer where max_model_len or the confidence
        threshold stop it), from the last observed step."""
        drafts: dict[str, list[int]] = {s.req_id: [] for s in starts}
        step, self._step = self._step, None
        if step is None:
            return drafts
        out, first = step
        active, rows = [], []
        for start in starts:
            # Draft i sits at position + i + 1 and must stay inside max_model_len.
            limit = min(start.num_drafts, self.max_model_len - 1 - start.position)
            if limit <= 0 or start.req_id not in first:
                continue
            first_row, first_pos = first[start.req_id]
            if start.position - 1 < first_pos:
                continue  # the step ran no row of this request before its newest token
            active.append((start, limit))
            rows.append(first_row + start.position - 1 - first_pos)
        if not active:
            return drafts
        hidden = out.index_select(0, torch.tensor(rows, dtype=torch.long).to(self.device))
        depth = 0
        while active:
            guesses, sure = self._guess(hidden)
            still, keep = [], []
            for i, ((start, limit), token, ok) in enumerate(zip(active, guesses, sure)):
                if not ok:
                    continue  # its guess is not proposed, and it stops here
                drafts[start.req_id].append(token)
                if limit > depth + 1:
                    still.append((start, limit))
                    keep.append(i)
            depth += 1
            active = still
            if active:
                if len(keep) != hidden.shape[0]:
                    hidden = hidden[torch.tensor(keep, dtype=torch.long).to(self.device)]
                hidden = self._chain(active, hidden, depth, drafts)
        return drafts

    def _chain(self, active, hidden: torch.Tensor, depth: int, drafts) -> torch.Tensor:
        """The layer applied again one position on: at position P + depth - 1, fed the
        request's latest draft and the layer's previous output (hidden)."""
        segments = [
            Segment(start.position + depth - 1, [drafts[start.req_id][-1]], start.block_ids)
            for start, _ in active
        ]
        metadata, ids, pos, _ = segment_inputs(segments, self.block_size, self.device)
        with forward_context(self.backend, self.backend.build_metadata(metadata), self.kv_pool):
            return self.mtp(self.embed(ids), pos, hidden)

    def _guess(self, hidden: torch.Tensor) -> tuple[list[int], list[bool]]:
        """Each row's next token, and whether it clears the confidence threshold."""
        logits = self.mtp.compute_logits(hidden)
        if self.confidence_threshold is None:
            return logits.argmax(dim=-1).tolist(), [True] * hidden.shape[0]
        probs, ids = torch.softmax(logits, dim=-1).max(dim=-1)
        return ids.tolist(), (probs >= self.confidence_threshold).tolist()
