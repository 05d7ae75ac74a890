"""torch_ref's batched decode path (one gather plan per step) against its plain reference.

TorchRefBackend() (batched_decode=True, the default the engine runs on CPU) must give
what TorchRefBackend(batched_decode=False) gives: the same cache writes exactly and the
same attention outputs to float32 rounding, on mixed steps (prompt chunks after a
cached prefix + decodes + padding rows), with GQA, over several layers sharing one
forward context (where the plan is built once, by build_metadata, and every layer
reads it) and over successive steps.
"""

import math

import pytest
import torch
from helpers.decode_steps import (
    BLOCK,
    HEAD_DIM,
    LAYERS,
    NUM_BLOCKS,
    make_step,
    run_layers,
    tables_for,
)
from helpers.kv_pool_helpers import pool_holding

from pagoda.attention import torch_ref
from pagoda.attention.torch_ref import TorchRefBackend


@pytest.mark.parametrize("n_heads,n_kv", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decode_matches_reference_on_mixed_steps(n_heads, n_kv, dtype):
    gen = torch.Generator().manual_seed(n_heads * 10 + n_kv)
    scale = 1 / math.sqrt(HEAD_DIM)
    fast = TorchRefBackend(n_heads, n_kv, HEAD_DIM, scale)
    ref = TorchRefBackend(n_heads, n_kv, HEAD_DIM, scale, batched_decode=False)
    initial = [
        torch.randn(2, NUM_BLOCKS, BLOCK, n_kv, HEAD_DIM, generator=gen).to(dtype)
        for _ in range(LAYERS)
    ]
    pool, ref_pool = pool_holding(initial), pool_holding(initial)
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    # Step 1: a fresh prompt, a chunk after a prefix-cache hit of 5 tokens, decodes of
    # different context lengths (one exactly at a block edge), two padding rows.
    # Step 2: decodes only, with the same requests' contexts grown by one.
    steps = [
        [(0, 7), (5, 6), (9, 1), (1, 1), (15, 1), (3, 1)],
        [(7, 1), (11, 1), (10, 1), (2, 1), (16, 1), (4, 1)],
    ]
    tables = tables_for([(c + 1, q) for c, q in steps[1]], perm)
    for shapes, pad in zip(steps, (2, 0)):
        md, qkv = make_step(gen, shapes, n_heads, n_kv, tables, pad)
        qkv = [(q.to(dtype), k.to(dtype), v.to(dtype)) for q, k, v in qkv]
        got, _ = run_layers(fast, md, qkv, pool)
        want, _ = run_layers(ref, md, qkv, ref_pool)
        for layer in range(LAYERS):
            tol = {} if dtype == torch.bfloat16 else {"atol": 1e-6, "rtol": 1e-6}
            torch.testing.assert_close(got[layer], want[layer], **tol)
            assert torch.equal(pool.cache(layer), ref_pool.cache(layer))


def test_the_plan_is_built_once_per_step_not_per_layer(monkeypatch):
    """build_metadata plans the step (one build_step_plan call); the layers' forwards
    only read that plan, and the workspace advances one step per forward."""
    calls = []
    real = torch_ref.build_step_plan
    monkeypatch.setattr(torch_ref, "build_step_plan", lambda *args: calls.append(1) or real(*args))
    gen = torch.Generator().manual_seed(3)
    backend = TorchRefBackend(4, 2, HEAD_DIM, 0.25)
    ref = TorchRefBackend(4, 2, HEAD_DIM, 0.25, batched_decode=False)
    initial = [torch.randn(2, NUM_BLOCKS, BLOCK, 2, HEAD_DIM, generator=gen)] * LAYERS
    pool, ref_pool = pool_holding(initial), pool_holding(initial)
    tables = tables_for([(7, 1), (3, 1)], list(range(NUM_BLOCKS)))
    for step, shapes in enumerate([[(5, 1), (2, 1)], [(6, 1), (3, 1)]]):
        md, qkv = make_step(gen, shapes, 4, 2, tables, 0)
        got, plan = run_layers(backend, md, qkv, pool)
        assert len(calls) == 2 * step + 1  # this step's plan: one call, for LAYERS layers
        want, _ = run_layers(ref, md, qkv, ref_pool)
        for layer in range(LAYERS):
            torch.testing.assert_close(got[layer], want[layer], atol=1e-6, rtol=1e-6)
        assert plan.workspace.step == step + 1
    assert plan.decode.assignment.carried == [True, True]


class Simulation:
    """Requests that join (some sharing a cached prefix block), decode, finish, get
    preempted (recomputed in new blocks), take multi-token verify steps that are then
    partly rolled back, and change order: what an engine does to the batch over time."""

    def __init__(self, gen, num_blocks: int = 96):
        self.gen = gen
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.reqs: dict[int, dict] = {}  # id -> {"table", "ctx" (cached), "next" (qlen)}
        self.next_id = 0

    def _blocks_for(self, req, tokens: int):
        while len(req["table"]) * BLOCK < tokens:
            req["table"].append(self.free.pop())

    def add(self, prompt: int, share_from=None):
        req = {"table": [], "ctx": 0, "next": prompt}
        if share_from is not None and share_from["ctx"] >= BLOCK:  # a prefix-cache hit
            req["table"], req["ctx"], req["next"] = [share_from["table"][0]], BLOCK, prompt - BLOCK
        self.reqs[self.next_id] = req
        self.next_id += 1

    def evolve(self, step: int):
        rand = lambda n: int(torch.randint(n, (1,), generator=self.gen))  # noqa: E731
        ids = list(self.reqs)
        if step % 7 == 3 and ids:  # finish one
            victim = self.reqs.pop(ids[rand(len(ids))])
            self.free += [
                b for b in victim["table"] if all(b not in r["table"] for r in self.reqs.values())
            ]
        if step % 5 == 0 or not self.reqs:  # join, sometimes sharing a prefix
            donor = next((r for r in self.reqs.values() if r["ctx"] >= BLOCK), None)
            self.add(5 + rand(7), donor if step % 10 == 0 else None)
        if step % 11 == 6 and len(self.reqs) > 1:  # preempt: recompute in fresh blocks
            req = self.reqs[list(self.reqs)[rand(len(self.reqs))]]
            self.free += [b for b in req["table"][1:]]
            req["table"], req["next"], req["ctx"] = req["table"][:0], req["ctx"] + 1, 0
        if step % 9 == 4:  # a verify step of 3 tokens for one decoding request
            for req in self.reqs.values():
                if req["next"] == 1:
                    req["next"] = 3
                    break

    def schedule(self, order_seed: int):
        ids = list(self.reqs)
        if order_seed % 4 == 1:  # the persistent batch reorders rows now and then
            ids = [ids[i] for i in torch.randperm(len(ids), generator=self.gen).tolist()]
        shapes, tables = [], []
        for i in ids:
            req = self.reqs[i]
            self._blocks_for(req, req["ctx"] + req["next"])
            shapes.append((req["ctx"], req["next"]))
            tables.append(list(req["table"]))
        return ids, shapes, tables

    def advance(self, ids):
        for i in ids:
            req = self.reqs[i]
            rolled_back = 2 if req["next"] == 3 else 0  # two of three drafts rejected
            req["ctx"] += req["next"] - rolled_back
            req["next"] = 1


def test_workspace_carries_exactly_over_an_engine_like_run():
    n_heads, n_kv = 6, 2
    gen = torch.Generator().manual_seed(11)
    fast = TorchRefBackend(n_heads, n_kv, HEAD_DIM, 0.3)
    ref = TorchRefBackend(n_heads, n_kv, HEAD_DIM, 0.3, batched_decode=False)
    pool = pool_holding([torch.zeros(2, 96, BLOCK, n_kv, HEAD_DIM)] * LAYERS)
    ref_pool = pool_holding([torch.zeros(2, 96, BLOCK, n_kv, HEAD_DIM)] * LAYERS)
    sim = Simulation(gen)
    carried_steps = 0
    for step in range(70):
        sim.evolve(step)
        ids, shapes, tables = sim.schedule(step)
        md, qkv = make_step(gen, shapes, n_heads, n_kv, tables, pad=step % 3 == 2)
        got, plan = run_layers(fast, md, qkv, pool)
        want, _ = run_layers(ref, md, qkv, ref_pool)
        for layer in range(LAYERS):
            torch.testing.assert_close(got[layer], want[layer], atol=1e-6, rtol=1e-6)
            assert torch.equal(pool.cache(layer), ref_pool.cache(layer))
        plan = plan.decode
        carried_steps += plan is not None and any(plan.assignment.carried)
        sim.advance(ids)
    assert carried_steps > 30  # the carrying path, not only fresh copies, was exercised


def test_workspace_slot_assignment():
    from pagoda.attention.decode_workspace import DecodeWorkspace

    ws = DecodeWorkspace(block_size=4)
    a = ws.assign([[7, 8], [3]], [5, 2])
    assert (a.slots, a.carried, a.num_slots, a.capacity) == ([0, 1], [False, False], 2, 64)
    # Both grew by one token, rows swapped and a new request joined: they keep their
    # slots, the newcomer takes the first free one.
    a = ws.assign([[3], [9, 1], [7, 8]], [3, 6, 6])
    assert (a.slots, a.carried, a.num_slots) == ([1, 2, 0], [True, False, True], 3)
    # Same length again (not one more), or another table: nothing carries.
    a = ws.assign([[3], [9, 1, 2]], [3, 7])
    assert a.carried == [False, True]
    # A context past the capacity: new buffers, nothing carries.
    a = ws.assign([[3] * 17], [65])
    assert (a.carried, a.capacity, a.num_slots) == ([False], 128, 1)
    # A forward without decode rows in between: nothing carries past it.
    ws.skip_step()
    assert ws.assign([[3] * 17], [66]).carried == [False]
    # Growth is at least a doubling; short contexts after a long one: the capacity
    # shrinks back once it is over 4x what is needed.
    assert ws.assign([[3] * 75], [300]).capacity == 320
    assert ws.assign([[5]], [3]).capacity == 64
