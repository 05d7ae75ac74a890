"""The engine that the replay and draft modes time: one LLM with a draft planner, run
with speculation off, always (the adaptive budget off) or adaptive (`Bench.run`); the
prompts of its runs; and the zeroing of residual branches that makes a dummy model's
greedy tokens independent of a step's shape."""

from __future__ import annotations

import time

import numpy as np

from benchmarks.spec_bench.common import KEY_LEN, draft_counts, spec_delta


def zero_residual_branches(model, expected: int) -> None:
    """Zeroes every decoder layer's o_proj and down_proj weight (and bias) in place, so
    captured CUDA graphs read the zeros; refuses anything but plain float Llama layers
    and a count other than `expected`."""
    import torch

    zeroed = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] not in ("o_proj", "down_proj"):
                continue
            method = getattr(getattr(module, "quant_method", None), "name", None)
            weight = getattr(module, "weight", None)
            if (
                method != "unquantized"
                or weight is None
                or weight.dtype not in (torch.bfloat16, torch.float16, torch.float32)
            ):
                raise SystemExit(
                    f"{name}: only plain float Llama layers can be zeroed "
                    f"(linear method {method!r})"
                )
            weight.zero_()
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
            zeroed += 1
    if zeroed != expected:
        raise SystemExit(
            f"zeroed {zeroed} projections, expected {expected} (o_proj and "
            "down_proj of every layer): not a Llama layout"
        )


def make_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    prompts = np.random.default_rng(seed).integers(3, vocab_size, size=(count, length)).tolist()
    assert len({tuple(p[:KEY_LEN]) for p in prompts}) == count, "prompt keys collide"
    return prompts


class Bench:
    """One engine with a draft planner; `run` times one configuration."""

    def __init__(self, args, speculative_config: dict) -> None:
        from pagoda import LLM

        self.args = args
        kwargs = dict(
            load_format="dummy",
            max_model_len=args.input_len + args.output_len + 64,
            max_num_seqs=max(args.concurrency),
            seed=0,
            speculative_config=speculative_config,
        )
        if args.smoke:
            kwargs.update(device="cpu", kv_cache_memory=64 << 20)
        if getattr(args, "async_scheduling", None) is not None:
            kwargs["async_scheduling"] = args.async_scheduling == "on"
        self.llm = LLM(args.model, **kwargs)
        self.engine = self.llm.llm_engine
        self.planner = self.engine.scheduler.draft_planner
        self.vocab = self.engine.model_info.vocab_size
        self.counter = None

    def run(self, mode: str, prompts, concurrency: int, proposer=None) -> dict:
        from pagoda import SamplingParams

        scheduler = self.engine.scheduler
        scheduler.max_num_seqs = concurrency
        scheduler.draft_planner = None if mode == "off" else self.planner
        self.planner.budget.adaptive = mode == "adaptive"
        if proposer is not None:
            self.planner.host_proposer = proposer
        params = SamplingParams(max_tokens=self.args.output_len, temperature=0, ignore_eos=True)
        before = draft_counts(self.planner.stats)
        counted = (self.counter.successes, self.counter.rejections) if self.counter else (0, 0)
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        outputs = [o.outputs[0].token_ids for o in outs]
        tokens = sum(len(o) for o in outputs)
        delta = spec_delta(draft_counts(self.planner.stats), before)
        row = {
            "mode": mode,
            "concurrency": concurrency,
            "seconds": seconds,
            "output_tokens": tokens,
            "ms_per_token": 1000 * seconds * concurrency / tokens,
            "tok_per_s": tokens / seconds,
            "acceptance": delta["acceptance"],
            "mean_accepted_length": delta["mean_accepted_length"],
            "verify_steps": delta["verify_steps"],
            "outputs": outputs,
        }
        if self.counter:
            successes = self.counter.successes - counted[0]
            rejections = self.counter.rejections - counted[1]
            row["draft_acceptance"] = (
                successes / (successes + rejections) if successes + rejections else None
            )
        return row
