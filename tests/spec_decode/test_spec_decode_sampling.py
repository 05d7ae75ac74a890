"""Sampling exactness of verify steps: with drafts, the tokens a request keeps follow
the target's processed distribution exactly (pagoda.spec_decode.verify's argument).

A tiny random Llama with a vocabulary of 8, saved as safetensors, generates 3 tokens
for each of NUM_REQUESTS copies of one prompt (unseeded: the engine's generator, from
a fixed engine seed, so the test is deterministic). A fixed drafter proposes the same
two drafts after every step, so t2 is verified against draft 1 (row 0) and t3 is the
bonus row after an accepted draft or a fresh step after a rejection. The expected
joint distribution of (t1, t2, t3) is computed here in float64 from transformers'
logits of the reloaded checkpoint and the definitions of each processor (logit bias,
penalties, temperature, top-k, top-p, min-p), independently of Pagoda's sampler.

Test: Pearson's chi-square over the joint's cells (cells expected below 5 draws are
pooled) against its upper 1e-4 quantile (Wilson-Hilferty), and no draw in a cell of
probability 0. False-alarm rate per case: 1e-4 (5 cases: < 5e-4 for the file), were
the engine seed random. Each case also checks that drafts were both accepted and
rejected, and that the same draws reject the distribution without the processing
(power: a verify row that ignored it would be caught).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers.tiny_models import save_tiny_hf_model

from pagoda import LLM, SamplingParams

VOCAB = 8
PROMPT = [3, 5, 1, 6]
NUM_REQUESTS = 3000
DRAFTS = [4, 0]
Z_1E4 = 3.7190  # upper 1e-4 quantile of the standard normal


def chi2_quantile(df: int) -> float:
    """Upper 1e-4 quantile of chi-square(df), Wilson-Hilferty (good from df ~ 3)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + Z_1E4 * math.sqrt(h)) ** 3


class FixedDrafter:
    """Proposes DRAFTS after every step (cut to what each request may take)."""

    def __init__(self) -> None:
        self.calls = 0

    def propose(self, starts):
        self.calls += 1
        return {s.req_id: DRAFTS[: s.num_drafts] for s in starts}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-vocab8")
    save_tiny_hf_model(path, "llama", seed=3, vocab_size=VOCAB, eos_token_id=7, bos_token_id=1)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    # Logits after PROMPT, PROMPT + [a], PROMPT + [a, b] for every a, b: one batch.
    pairs = list(itertools.product(range(VOCAB), repeat=2))
    ids = torch.tensor([PROMPT + [a, b] for a, b in pairs])
    with torch.inference_mode():
        logits = hf(ids).logits.double()
    n = len(PROMPT)
    after_prompt = logits[0, n - 1].tolist()
    after_one = {a: logits[a * VOCAB, n].tolist() for a in range(VOCAB)}
    after_two = {pair: logits[i, n + 1].tolist() for i, pair in enumerate(pairs)}
    llm = LLM(
        str(path),
        skip_tokenizer_init=True,
        kv_cache_memory=8 << 20,
        max_model_len=64,
        seed=7,
        speculative_config={
            "method": "layer_skip",
            "num_layers": 1,
            "num_speculative_tokens": 2,
            "adaptive": False,
        },
    )
    drafter = FixedDrafter()
    llm.llm_engine.executor.runner.drafter = drafter
    yield llm, drafter, (after_prompt, after_one, after_two)
    llm.shutdown()


def processed(
    logits: list[float], params: SamplingParams, outputs: list[int], plain: bool = False
) -> list[float]:
    """The distribution a row samples from, by the definitions (float64)."""
    x = list(logits)
    if not plain:
        for token, bias in (params.logit_bias or {}).items():
            x[int(token)] += bias
        for t in set(outputs):
            count = outputs.count(t)
            x[t] -= params.frequency_penalty * count + params.presence_penalty
    top = max(x)
    weights = [math.exp((v - top) / (1.0 if plain else params.temperature)) for v in x]
    total = sum(weights)
    probs = [w / total for w in weights]
    if plain:
        return probs
    order = sorted(range(VOCAB), key=lambda i: -probs[i])
    keep = set(order[: params.top_k] if params.top_k > 0 else order)
    if params.min_p > 0:
        keep &= {i for i in range(VOCAB) if probs[i] >= params.min_p * max(probs)}
    if params.top_p < 1.0:
        nucleus, mass = set(), 0.0
        for i in order:
            if mass >= params.top_p:
                break
            nucleus.add(i)
            mass += probs[i]
        keep &= nucleus
    total = sum(probs[i] for i in keep)
    return [probs[i] / total if i in keep else 0.0 for i in range(VOCAB)]


def joint(reference, params: SamplingParams, plain: bool = False) -> dict:
    after_prompt, after_one, after_two = reference
    p1 = processed(after_prompt, params, [], plain)
    cells = {}
    for a in range(VOCAB):
        p2 = processed(after_one[a], params, [a], plain)
        for b in range(VOCAB):
            p3 = processed(after_two[(a, b)], params, [a, b], plain)
            for c in range(VOCAB):
                cells[(a, b, c)] = p1[a] * p2[b] * p3[c]
    return cells


def fits(counts: dict, expected: dict, n: int) -> bool:
    if any(counts.get(cell, 0) and p == 0.0 for cell, p in expected.items()):
        return False
    chi2, pooled_count, pooled_p, bins = 0.0, 0, 0.0, 0
    for cell, p in expected.items():
        if p == 0.0:
            continue
        if n * p < 5:
            pooled_count += counts.get(cell, 0)
            pooled_p += p
            continue
        chi2 += (counts.get(cell, 0) - n * p) ** 2 / (n * p)
        bins += 1
    if pooled_p > 0:
        chi2 += (pooled_count - n * pooled_p) ** 2 / (n * pooled_p)
        bins += 1
    return chi2 < chi2_quantile(bins - 1)


CASES = {
    "temperature": SamplingParams(temperature=0.7),
    "top_p": SamplingParams(temperature=1.0, top_p=0.75),
    "top_k": SamplingParams(temperature=1.2, top_k=3),
    "min_p": SamplingParams(temperature=1.0, min_p=0.3),
    "penalties_bias": SamplingParams(
        temperature=1.0, presence_penalty=0.8, frequency_penalty=0.5, logit_bias={4: 1.0, 6: -2.0}
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kept_tokens_follow_the_processed_distribution(tiny, case):
    llm, drafter, reference = tiny
    params = CASES[case].clone(max_tokens=3, ignore_eos=True)
    engine = llm.llm_engine
    before = engine.get_stats().spec_decode
    drafted, accepted = before.num_draft_tokens, before.num_accepted_tokens
    outs = llm.generate([PROMPT] * NUM_REQUESTS, params, use_tqdm=False)
    counts: dict = {}
    for out in outs:
        cell = tuple(out.outputs[0].token_ids)
        counts[cell] = counts.get(cell, 0) + 1
    stats = engine.get_stats().spec_decode
    new_drafts = stats.num_draft_tokens - drafted
    new_accepted = stats.num_accepted_tokens - accepted
    assert 0 < new_accepted < new_drafts, (new_accepted, new_drafts)
    assert fits(counts, joint(reference, params), NUM_REQUESTS), case
    assert not fits(counts, joint(reference, params, plain=True), NUM_REQUESTS), case
