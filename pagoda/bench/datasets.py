"""Benchmark workloads: the prompts and output lengths a run sends.

Owns the four datasets of `pagoda bench` (vLLM's names and semantics):

- `random`: token-exact prompts of `input_len * [1 - r, 1 + r]` tokens (r = range
  ratio) after an optional shared prefix of `prefix_len` tokens; output lengths drawn
  the same way from `output_len`.
- `prefix-repetition`: `num_prefixes` long shared prefixes, each request one of them
  plus its own suffix, for measuring prefix caching.
- `sharegpt`: a ShareGPT-format JSON file the user brings (first human turn = prompt,
  first reply = its output length), filtered like vLLM's (prompt and output >= 4
  tokens, prompt <= 1024, prompt + output <= 2048) unless an output length is fixed.
- `custom`: JSONL, one `{"prompt": str, "output_tokens": int?}` per line.
- `multi-turn`: chat-like conversations for measuring KV offloading. Each turn's
  prompt is the conversation so far (the previous prompt, a stand-in for the
  assistant's reply, the next user message), so it extends the previous turn's prompt
  token for token, up to the last token of that prompt, whose tokenization may merge
  with the appended text. Requests go turn by turn over all conversations (turn 1 of
  every conversation, then turn 2 of every one, ...): each conversation comes back
  after all the others have run, so with enough of them (working set = conversations
  x last prompt length, e.g. >= 4x the GPU KV pool) its blocks were pushed out of GPU
  memory in between. Request i is turn i // num_conversations.

Every generator is deterministic for a given seed and tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from pagoda.bench.tokenizers import BenchTokenizer, build_exact_prompt, corpus_token_pool

DATASETS = ("random", "sharegpt", "prefix-repetition", "custom", "multi-turn")
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass
class SampleRequest:
    prompt: str | list[int]  # token ids only in the offline benchmarks
    prompt_len: int | None  # content tokens; None when no tokenizer measured it
    expected_output_len: int


def _need_tokenizer(tokenizer: BenchTokenizer | None, dataset: str) -> BenchTokenizer:
    if tokenizer is None:
        raise ValueError(
            f"dataset {dataset!r} needs a tokenizer: the server's /tokenize route, "
            "or --tokenizer PATH (local files)"
        )
    return tokenizer


def draw_lengths(mean: int, ratio: float, n: int, rng: np.random.Generator, name: str) -> list[int]:
    """n integers uniform in [mean * (1 - ratio), mean * (1 + ratio)], at least 1."""
    if not isinstance(mean, int) or mean < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {mean!r}")
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {ratio!r}")
    low = max(1, int(np.floor(mean * (1.0 - ratio))))
    high = max(low, int(np.ceil(mean * (1.0 + ratio))))
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def random_requests(
    tokenizer: BenchTokenizer | None,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Token-exact random prompts; prompt_len counts prefix + random part."""
    tok = _need_tokenizer(tokenizer, "random")
    _check_count(num_prompts)
    if prefix_len < 0:
        raise ValueError(f"random_prefix_len must be >= 0, got {prefix_len!r}")
    rng = np.random.default_rng(seed)
    pool = corpus_token_pool(tok)
    prefix = build_exact_prompt(tok, pool, prefix_len, rng)[0] if prefix_len else ""
    in_lens = draw_lengths(input_len, range_ratio, num_prompts, rng, "random_input_len")
    out_lens = draw_lengths(output_len, range_ratio, num_prompts, rng, "random_output_len")
    samples = []
    for n_in, n_out in zip(in_lens, out_lens):
        text, count = build_exact_prompt(tok, pool, prefix_len + n_in, rng, prefix=prefix)
        samples.append(SampleRequest(text, count, n_out))
    return samples


def prefix_repetition_requests(
    tokenizer: BenchTokenizer | None,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int = 0,
) -> list[SampleRequest]:
    """Requests sharing `num_prefixes` prefixes (assigned round-robin, then shuffled)."""
    tok = _need_tokenizer(tokenizer, "prefix-repetition")
    _check_count(num_prompts)
    for name, value in (
        ("prefix_repetition_prefix_len", prefix_len),
        ("prefix_repetition_suffix_len", suffix_len),
        ("prefix_repetition_num_prefixes", num_prefixes),
        ("prefix_repetition_output_len", output_len),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    rng = np.random.default_rng(seed)
    pool = corpus_token_pool(tok)
    prefixes = [build_exact_prompt(tok, pool, prefix_len, rng)[0] for _ in range(num_prefixes)]
    samples = []
    for i in range(num_prompts):
        text, count = build_exact_prompt(
            tok, pool, prefix_len + suffix_len, rng, prefix=prefixes[i % num_prefixes]
        )
        samples.append(SampleRequest(text, count, output_len))
    order = rng.permutation(num_prompts)
    return [samples[i] for i in order]


def multi_turn_requests(
    tokenizer: BenchTokenizer | None,
    num_conversations: int,
    num_turns: int,
    first_len: int,
    turn_len: int,
    output_len: int,
    seed: int = 0,
) -> list[SampleRequest]:
    """num_conversations x num_turns requests, turn-major (see the module docstring):
    turn 0 is `first_len` tokens, each later turn appends `output_len` (the previous
    reply's stand-in) + `turn_len` tokens; every request asks for `output_len` tokens."""
    tok = _need_tokenizer(tokenizer, "multi-turn")
    for name, value in (
        ("multi_turn_num_conversations", num_conversations),
        ("multi_turn_turns", num_turns),
        ("multi_turn_first_len", first_len),
        ("multi_turn_turn_len", turn_len),
        ("multi_turn_output_len", output_len),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    rng = np.random.default_rng(seed)
    pool = corpus_token_pool(tok)
    history = [""] * num_conversations
    length = [0] * num_conversations
    samples = []
    for turn in range(num_turns):
        for conv in range(num_conversations):
            target = first_len if turn == 0 else length[conv] + output_len + turn_len
            history[conv], length[conv] = build_exact_prompt(
                tok, pool, target, rng, prefix=history[conv]
            )
            samples.append(SampleRequest(history[conv], length[conv], output_len))
    return samples


def sharegpt_requests(
    path: str,
    tokenizer: BenchTokenizer | None,
    num_prompts: int,
    output_len: int | None = None,
    seed: int = 0,
) -> list[SampleRequest]:
    """Conversations from a ShareGPT JSON file, shuffled with `seed`."""
    _check_count(num_prompts)
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if (
            isinstance(turns, list)
            and len(turns) >= 2
            and all(isinstance(t, dict) for t in turns[:2])
        ):
            pairs.append((str(turns[0].get("value", "")), str(turns[1].get("value", ""))))
    order = np.random.default_rng(seed).permutation(len(pairs))
    samples: list[SampleRequest] = []
    for i in order:
        if len(samples) == num_prompts:
            break
        prompt, reply = pairs[i]
        sample = _sharegpt_sample(prompt, reply, tokenizer, output_len)
        if sample is not None:
            samples.append(sample)
    if len(samples) < num_prompts:
        raise ValueError(
            f"{path} has only {len(samples)} usable conversations "
            f"(of {len(pairs)} with two turns); lower --num-prompts"
        )
    return samples


def _sharegpt_sample(
    prompt: str, reply: str, tokenizer: BenchTokenizer | None, output_len: int | None
) -> SampleRequest | None:
    if output_len is not None:
        prompt_len = len(tokenizer.encode(prompt)) if tokenizer is not None else None
        return SampleRequest(prompt, prompt_len, output_len)
    tok = _need_tokenizer(tokenizer, "sharegpt (without --sharegpt-output-len)")
    prompt_len, reply_len = len(tok.encode(prompt)), len(tok.encode(reply))
    if prompt_len < SHAREGPT_MIN_LEN or reply_len < SHAREGPT_MIN_LEN:
        return None
    if prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + reply_len > SHAREGPT_MAX_TOTAL_LEN:
        return None
    return SampleRequest(prompt, prompt_len, reply_len)


def custom_requests(
    path: str,
    tokenizer: BenchTokenizer | None,
    num_prompts: int,
    output_len: int = 256,
    shuffle: bool = False,
    seed: int = 0,
) -> list[SampleRequest]:
    """JSONL lines `{"prompt": str, "output_tokens": int}`; output_tokens defaults to `output_len`."""
    _check_count(num_prompts)
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                rows.append(_custom_row(path, lineno, line, output_len))
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(rows))
        rows = [rows[i] for i in order]
    if len(rows) < num_prompts:
        raise ValueError(f"{path} has {len(rows)} prompts, fewer than --num-prompts {num_prompts}")
    return [
        SampleRequest(p, len(tokenizer.encode(p)) if tokenizer is not None else None, n)
        for p, n in rows[:num_prompts]
    ]


def _custom_row(path: str, lineno: int, line: str, default_output_len: int) -> tuple[str, int]:
    where = f"{path}:{lineno}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON: {err}") from err
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
        raise ValueError(f"{where}: each line needs a non-empty string field 'prompt'")
    n = row.get("output_tokens", default_output_len)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{where}: 'output_tokens' must be an integer >= 1, got {n!r}")
    unknown = set(row) - {"prompt", "output_tokens"}
    if unknown:
        raise ValueError(
            f"{where}: unknown field(s) {', '.join(sorted(unknown))}; "
            "supported: prompt, output_tokens"
        )
    return row["prompt"], n


def _check_count(num_prompts: int) -> None:
    if not isinstance(num_prompts, int) or num_prompts < 1:
        raise ValueError(f"num_prompts must be an integer >= 1, got {num_prompts!r}")


def samples_from_args(args, tokenizer: BenchTokenizer | None) -> list[SampleRequest]:
    """The dataset named by the CLI flags (`--dataset-name` and its own flags)."""
    name = args.dataset_name
    if name in ("sharegpt", "custom") and not args.dataset_path:
        raise ValueError(f"--dataset-name {name} needs --dataset-path")
    if name == "random":
        return random_requests(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
            args.seed,
        )
    if name == "prefix-repetition":
        return prefix_repetition_requests(
            tokenizer,
            args.num_prompts,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
            args.seed,
        )
    if name == "sharegpt":
        return sharegpt_requests(
            args.dataset_path, tokenizer, args.num_prompts, args.sharegpt_output_len, args.seed
        )
    if name == "custom":
        return custom_requests(
            args.dataset_path,
            tokenizer,
            args.num_prompts,
            args.custom_output_len,
            shuffle=False,
            seed=args.seed,
        )
    if name == "multi-turn":  # conversations x turns requests, capped by --num-prompts
        return multi_turn_requests(
            tokenizer,
            args.multi_turn_num_conversations,
            args.multi_turn_turns,
            args.multi_turn_first_len,
            args.multi_turn_turn_len,
            args.multi_turn_output_len,
            args.seed,
        )[: args.num_prompts]
    raise ValueError(f"dataset_name must be one of {', '.join(DATASETS)}, got {name!r}")
