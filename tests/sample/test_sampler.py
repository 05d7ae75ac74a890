"""Tests of pagoda.sample: greedy, masks, penalties, bias, min_tokens, seeds, logprobs.

Hand-computed values use dyadic floats so assertions can be exact. Every test runs
on CPU, and on CUDA too when a GPU is present.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagoda.core.outputs import TokenLogprobs
from pagoda.sample.logprobs import compute_token_logprobs, to_token_logprobs
from pagoda.sample.metadata import SamplingRow, build_sampling_metadata, make_generator
from pagoda.sample.sampler import (
    Sampler,
    apply_top_k_only,
    apply_top_k_top_p,
    filter_logits,
    process_logits,
)
from pagoda.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def rows_of(params_list, prompts=None, outputs=None, generators=None):
    n = len(params_list)
    prompts = prompts or [[] for _ in range(n)]
    outputs = outputs or [[] for _ in range(n)]
    generators = generators or [None] * n
    return [
        SamplingRow(p, list(pr), list(o), g)
        for p, pr, o, g in zip(params_list, prompts, outputs, generators)
    ]


def sample(logits, rows, generator=None):
    metadata = build_sampling_metadata(rows, logits.shape[1], logits.device, generator=generator)
    return Sampler()(logits, metadata)


def kept(logits_row) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits_row)).flatten().tolist())


def log_probs(probs, device):
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32, device=device)


# ---------------------------------------------------------------- greedy


def test_all_greedy_is_argmax_and_takes_the_fast_path(device):
    torch.manual_seed(0)
    logits = torch.randn(6, 50, device=device)
    rows = rows_of([SamplingParams(temperature=0.0) for _ in range(6)])
    metadata = build_sampling_metadata(rows, 50, device)
    assert metadata.all_greedy and not metadata.all_random
    assert (metadata.temperature, metadata.top_k, metadata.top_p, metadata.min_p) == (
        None,
        None,
        None,
        None,
    )
    assert (metadata.penalties, metadata.logit_bias, metadata.min_tokens_bans) == (None, None, None)
    assert metadata.is_greedy is None and metadata.max_num_logprobs is None
    out = Sampler()(logits, metadata)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.sampled_ranks is None


def test_greedy_ties_take_the_lowest_index(device):
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [2.0, 2.0, 2.0, 2.0]], device=device)
    out = sample(logits, rows_of([SamplingParams(temperature=0.0)] * 2))
    assert out.sampled_token_ids.tolist() == [1, 0]


def test_greedy_settings_of_sampling_fields_are_ignored(device):
    # top_k/top_p/min_p of a greedy row cannot change its argmax: not even built.
    rows = rows_of([SamplingParams(temperature=0.0, top_k=2, top_p=0.5, min_p=0.5)])
    metadata = build_sampling_metadata(rows, 8, device)
    assert (metadata.top_k, metadata.top_p, metadata.min_p) == (None, None, None)


def test_temperature_zero_rows_in_a_mixed_batch(device):
    torch.manual_seed(1)
    logits = torch.randn(4, 16, device=device)
    logits[1] = 0.0  # a flat row: a random row there must vary
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, top_p=0.5),
        SamplingParams(temperature=0.8, top_k=5),
    ]
    metadata = build_sampling_metadata(rows_of(params), 16, device)
    assert not metadata.all_greedy and not metadata.all_random
    assert metadata.is_greedy.tolist() == [True, False, True, False]
    argmax = logits.argmax(dim=-1)
    seen_on_flat_row = set()
    for _ in range(40):
        tokens = Sampler()(logits, metadata).sampled_token_ids
        assert tokens[0] == argmax[0] and tokens[2] == argmax[2]
        seen_on_flat_row.add(int(tokens[1]))
    assert len(seen_on_flat_row) > 5


def test_top_k_1_equals_greedy(device):
    torch.manual_seed(2)
    logits = torch.randn(8, 40, device=device)
    logits[3, 7] = logits[3, 20] = logits[3].max() + 1.0  # a tie: the lowest index wins
    rows = rows_of([SamplingParams(temperature=1.3, top_k=1) for _ in range(8)])
    for _ in range(5):
        assert torch.equal(sample(logits, rows).sampled_token_ids, logits.argmax(dim=-1))
    assert sample(logits, rows).sampled_token_ids[3] == 7


# ---------------------------------------------------------------- masks


def test_temperature_scales_logits(device):
    logits = torch.tensor([[1.0, -2.0, 0.5], [1.0, -2.0, 0.5]], device=device)
    rows = rows_of([SamplingParams(temperature=0.5), SamplingParams(temperature=1.0)])
    out = filter_logits(logits, build_sampling_metadata(rows, 3, device))
    assert out.tolist() == [[2.0, -4.0, 1.0], [1.0, -2.0, 0.5]]


def test_min_p_keeps_exactly_the_tokens_above_the_scaled_threshold(device):
    probs = [0.4, 0.1, 0.3, 0.2]
    logits = log_probs(probs, device).repeat(3, 1)
    # thresholds 0.4*0.4=0.16 -> {0,2,3}; 0.6*0.4=0.24 -> {0,2}; 0 -> all.
    rows = rows_of(
        [SamplingParams(min_p=0.4), SamplingParams(min_p=0.6), SamplingParams(min_p=0.0)]
    )
    out = filter_logits(logits, build_sampling_metadata(rows, 4, device))
    assert [kept(r) for r in out] == [{0, 2, 3}, {0, 2}, {0, 1, 2, 3}]
    # Kept logits are untouched.
    assert torch.equal(out[1, [0, 2]], logits[1, [0, 2]])


def test_top_k_keeps_exactly_k_tokens(device):
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]], device=device).repeat(4, 1)
    rows = rows_of([SamplingParams(top_k=k) for k in (2, 3, 0, 9)])
    out = filter_logits(logits, build_sampling_metadata(rows, 5, device))
    assert [kept(r) for r in out] == [{1, 3}, {1, 2, 3}, {0, 1, 2, 3, 4}, {0, 1, 2, 3, 4}]


def test_top_k_without_sort_matches_the_sorted_path_even_with_ties(device):
    gen = torch.Generator().manual_seed(4)
    # Few distinct values: many ties at the k-th value.
    logits = torch.randint(-3, 3, (64, 40), generator=gen).float().to(device)
    logits[5, :] = 1.0
    logits[6, 10:] = float("-inf")  # k larger than the finite tokens
    top_k = torch.randint(1, 41, (64,), generator=gen).to(device)
    top_k[7] = 40  # disabled row
    max_top_k = int(top_k[top_k < 40].max())
    fast = apply_top_k_only(logits, top_k, max_top_k)
    assert torch.equal(fast, apply_top_k_top_p(logits, top_k, None))
    assert torch.equal(torch.isfinite(fast).sum(dim=-1)[:6], top_k[:6])
    assert kept(fast[5]) == set(range(int(top_k[5])))  # ties: lowest ids first


def test_top_p_keeps_the_smallest_prefix_reaching_p(device):
    # Sorted: token 1 (0.4), 3 (0.3), 2 (0.2), 0 (0.1); mass before: 0, .4, .7, .9.
    logits = log_probs([0.1, 0.4, 0.2, 0.3], device).repeat(5, 1)
    rows = rows_of([SamplingParams(top_p=p) for p in (0.35, 0.5, 0.75, 0.95, 1.0)])
    out = filter_logits(logits, build_sampling_metadata(rows, 4, device))
    assert [kept(r) for r in out] == [{1}, {1, 3}, {1, 2, 3}, {0, 1, 2, 3}, {0, 1, 2, 3}]


def test_top_p_applies_to_the_distribution_left_by_top_k(device):
    # After top_k=2: {1: 0.4/0.7=0.571, 3: 0.429}; top_p=0.5 keeps token 1 only
    # (on the full distribution 0.4 < 0.5 would have kept token 3 too).
    logits = log_probs([0.1, 0.4, 0.2, 0.3], device).unsqueeze(0)
    rows = rows_of([SamplingParams(top_k=2, top_p=0.5)])
    out = filter_logits(logits, build_sampling_metadata(rows, 4, device))
    assert kept(out[0]) == {1}


def test_min_p_applies_after_temperature(device):
    # probs [.4, .1, .3, .2] at temperature 0.5 become prop. to [.16, .01, .09, .04]:
    # min_p=0.3 -> threshold .3*.16=.048 -> {0, 2}; at temperature 1 it would keep {0,2,3}.
    logits = log_probs([0.4, 0.1, 0.3, 0.2], device).unsqueeze(0)
    rows = rows_of([SamplingParams(temperature=0.5, min_p=0.3)])
    out = filter_logits(logits, build_sampling_metadata(rows, 4, device))
    assert kept(out[0]) == {0, 2}


def test_sampled_tokens_stay_inside_the_masks(device):
    logits = log_probs([0.1, 0.4, 0.2, 0.3], device).repeat(3000, 1)
    rows = rows_of(
        [SamplingParams(top_p=0.5)] * 1000
        + [SamplingParams(top_k=3)] * 1000
        + [SamplingParams(min_p=0.6)] * 1000
    )
    tokens = sample(logits, rows).sampled_token_ids.tolist()
    assert set(tokens[:1000]) == {1, 3}
    assert set(tokens[1000:2000]) == {1, 2, 3}
    assert set(tokens[2000:]) == {1, 3}


# ---------------------------------------------------------------- penalties, bias, bans

PENALTY_LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]
PROMPT, OUTPUT = [0, 1], [3, 3, 4]  # seen: {0, 1, 3, 4}; output counts: 3 -> 2, 4 -> 1


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(repetition_penalty=2.0), [1.0, -2.0, 0.5, 1.5, -4.0, 1.0]),
        (SamplingParams(frequency_penalty=0.5), [2.0, -1.0, 0.5, 2.0, -2.5, 1.0]),
        (SamplingParams(presence_penalty=0.25), [2.0, -1.0, 0.5, 2.75, -2.25, 1.0]),
        (SamplingParams(frequency_penalty=-0.5), [2.0, -1.0, 0.5, 4.0, -1.5, 1.0]),
        (
            SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            [1.0, -2.0, 0.5, 0.25, -4.75, 1.0],
        ),
    ],
)
def test_penalties_exact_values(device, params, expected):
    logits = torch.tensor([PENALTY_LOGITS] * 2, device=device)
    # Row 1 has no penalty but the same history: it must come out bit-identical.
    rows = rows_of([params, SamplingParams()], prompts=[PROMPT, PROMPT], outputs=[OUTPUT, OUTPUT])
    out = process_logits(logits, build_sampling_metadata(rows, 6, device))
    assert out[0].tolist() == expected
    assert torch.equal(out[1], logits[1])


def test_prompt_tensor_is_built_only_for_the_repetition_penalty(device):
    rows = rows_of([SamplingParams(frequency_penalty=1.0)], prompts=[PROMPT], outputs=[OUTPUT])
    penalties = build_sampling_metadata(rows, 6, device).penalties
    assert penalties.prompt_mask is None and penalties.repetition is None
    assert penalties.output_token_counts.tolist() == [[0.0, 0.0, 0.0, 2.0, 1.0, 0.0]]
    rows = rows_of(
        [SamplingParams(), SamplingParams(repetition_penalty=1.2)], prompts=[[5, 5], PROMPT]
    )
    penalties = build_sampling_metadata(rows, 6, device).penalties
    assert penalties.prompt_mask.tolist() == [[False] * 5 + [True], [True, True] + [False] * 4]
    assert penalties.output_token_counts.tolist() == [[0.0] * 6] * 2


def test_penalty_changes_the_greedy_choice(device):
    logits = torch.tensor([[2.0, 1.5, 0.0]], device=device)
    rows = rows_of([SamplingParams(temperature=0.0, presence_penalty=1.0)], outputs=[[0]])
    assert sample(logits, rows).sampled_token_ids.tolist() == [1]


def test_logit_bias_is_added_to_its_row_only(device):
    logits = torch.tensor([[1.0, 2.0, 0.0, -1.0]] * 2, device=device)
    rows = rows_of(
        [
            SamplingParams(temperature=0.0, logit_bias={2: 5.0, 1: -0.5}),
            SamplingParams(temperature=0.0),
        ]
    )
    metadata = build_sampling_metadata(rows, 4, device)
    assert process_logits(logits, metadata).tolist() == [
        [1.0, 1.5, 5.0, -1.0],
        [1.0, 2.0, 0.0, -1.0],
    ]
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [2, 1]


def test_min_tokens_bans_stop_ids_until_reached(device):
    eos, stop = 1, 4
    logits = torch.tensor([[0.0, 9.0, 1.0, 0.5, 8.0, 0.25]] * 5, device=device)
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop])
    params.all_stop_token_ids.add(eos)  # what the engine does
    ignore_eos = SamplingParams(
        temperature=0.0, min_tokens=3, stop_token_ids=[stop], ignore_eos=True
    )
    outputs = [[], [7], [7, 7], [7, 7, 7], [7]]
    rows = rows_of([params] * 4 + [ignore_eos], outputs=outputs)
    metadata = build_sampling_metadata(rows, 6, device)
    processed = process_logits(logits, metadata)
    assert [kept(r) for r in processed] == [{0, 2, 3, 5}] * 3 + [set(range(6)), {0, 1, 2, 3, 5}]
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [2, 2, 2, 1, 1]


def test_input_logits_are_not_modified(device):
    logits = torch.tensor([[0.0, 9.0, 1.0, 0.5]], device=device)
    before = logits.clone()
    params = SamplingParams(
        temperature=0.7, top_k=2, min_tokens=2, logit_bias={0: 1.0}, repetition_penalty=1.5
    )
    params.all_stop_token_ids.add(1)
    sample(logits, rows_of([params], prompts=[[2]], outputs=[[3]]))
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- seeds


def _seeded_sequence(step_logits, seed, position, batch_size, device, unseeded_seed):
    """Tokens of one seeded row over steps, placed at `position` in a batch of
    `batch_size` with other random rows (one of them seeded differently)."""
    torch.manual_seed(unseeded_seed)  # the unseeded rows' draws differ between runs
    vocab = step_logits.shape[1]
    generators = [None] * batch_size
    generators[position] = make_generator(seed, device)
    params = [SamplingParams(temperature=1.0)] * batch_size
    params[position] = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
    if batch_size > 1:
        other = (position + 1) % batch_size
        generators[other] = make_generator(seed + 1, device)
        params[other] = SamplingParams(temperature=1.0, seed=seed + 1)
    tokens = []
    for step_row in step_logits:
        logits = torch.randn(batch_size, vocab, device=device)
        logits[position] = step_row
        rows = rows_of(params, outputs=[tokens] * batch_size, generators=generators)
        tokens.append(int(sample(logits, rows).sampled_token_ids[position]))
    return tokens


def test_seeded_row_is_independent_of_batch_and_position(device):
    gen = torch.Generator().manual_seed(5)
    step_logits = torch.randn(25, 64, generator=gen).to(device) * 0.5
    alone = _seeded_sequence(step_logits, 1234, 0, 1, device, unseeded_seed=0)
    assert len(set(alone)) > 5  # the row really samples
    for position, batch_size, unseeded_seed in [(0, 1, 9), (0, 2, 1), (3, 5, 2), (6, 7, 3)]:
        assert (
            _seeded_sequence(step_logits, 1234, position, batch_size, device, unseeded_seed)
            == alone
        )
    assert _seeded_sequence(step_logits, 4321, 0, 1, device, unseeded_seed=0) != alone


def test_seeded_row_without_generator_is_rejected(device):
    with pytest.raises(ValueError, match="seed"):
        build_sampling_metadata(rows_of([SamplingParams(seed=3)]), 8, device)


def test_unseeded_rows_follow_the_metadata_generator(device):
    logits = torch.zeros(4, 1000, device=device)
    rows = rows_of([SamplingParams()] * 4)
    first = sample(logits, rows, generator=make_generator(7, device)).sampled_token_ids
    second = sample(logits, rows, generator=make_generator(7, device)).sampled_token_ids
    assert torch.equal(first, second)


# ---------------------------------------------------------------- logprobs and errors


def test_compute_token_logprobs_hand_values(device):
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [1.0, 1.0, 0.0, -1.0]], device=device)
    ids, lps, ranks = compute_token_logprobs(logits, torch.tensor([1, 1], device=device), 2)
    assert ids[0].tolist() == [1, 3, 2]
    assert ranks.tolist() == [3, 1]  # a tie shares the better rank
    assert torch.equal(lps, torch.log_softmax(logits, dim=-1).gather(1, ids))
    ids0, lps0, _ = compute_token_logprobs(logits, torch.tensor([2, 3], device=device), 0)
    assert ids0.tolist() == [[2], [3]] and lps0.shape == (2, 1)


def test_sampler_logprobs_come_from_raw_logits(device):
    torch.manual_seed(3)
    logits = torch.randn(3, 30, device=device)
    params = [
        SamplingParams(temperature=0.0, logprobs=1, repetition_penalty=1.7),
        SamplingParams(temperature=0.5, top_k=4, logprobs=3, logit_bias={5: 7.0}),
        SamplingParams(temperature=1.0),
    ]
    out = sample(logits, rows_of(params, prompts=[[1, 2, 3]] * 3))
    sampled = out.sampled_token_ids
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs_token_ids.shape == (3, 4) and out.logprobs.shape == (3, 4)
    assert torch.equal(out.logprobs_token_ids[:, 0], sampled)
    assert torch.equal(out.logprobs, raw.gather(1, out.logprobs_token_ids))
    order = raw.argsort(dim=-1, descending=True)
    assert torch.equal(out.logprobs_token_ids[:, 1:], order[:, :3])
    expected_ranks = [order[i].tolist().index(int(sampled[i])) + 1 for i in range(3)]
    assert out.sampled_ranks.tolist() == expected_ranks


def test_to_token_logprobs_converts_and_truncates(device):
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.0, 1.0, 2.0]], device=device)
    ids, lps, ranks = compute_token_logprobs(logits, torch.tensor([0, 0], device=device), 2)
    result = to_token_logprobs(ids, lps, ranks, num_logprobs=[2, 0])
    assert all(isinstance(r, TokenLogprobs) for r in result)
    assert result[0].token_ids == [0, 3, 2] and result[0].sampled_rank == 4
    assert result[0].logprobs == lps[0].tolist()
    assert result[1].token_ids == [0] and result[1].sampled_rank == 1
    assert result[1].logprobs == [lps[1, 0].item()]
    assert [r.token_ids for r in to_token_logprobs(ids, lps, ranks)] == [[0, 3, 2], [0, 0, 3]]


def test_bad_inputs_raise_clear_errors(device):
    with pytest.raises(ValueError, match="logit_bias"):
        build_sampling_metadata(rows_of([SamplingParams(logit_bias={8: 1.0})]), 8, device)
    with pytest.raises(ValueError, match="stop_token_ids"):
        build_sampling_metadata(
            rows_of([SamplingParams(min_tokens=1, stop_token_ids=[9])]), 8, device
        )
    with pytest.raises(ValueError, match="output_token_ids"):
        build_sampling_metadata(
            rows_of([SamplingParams(presence_penalty=1.0)], outputs=[[3, 8]]), 8, device
        )
    metadata = build_sampling_metadata(rows_of([SamplingParams()]), 8, device)
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(2, 8, device=device), metadata)
