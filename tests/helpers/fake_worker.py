"""FakeWorker: a worker without a model for the executor tests.

It learns tokens only from the SchedulerOutput diffs (plus, under async scheduling, the
token its own previous step sampled, as the real worker takes it from the device) and
samples a deterministic function of the tokens so far (`fake_next_token`); `expected`
applies that function directly, `run` drives an engine to compare with it.
"""

from __future__ import annotations

from helpers.drafting_helpers import Done
from pagoda.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig
from pagoda.core.outputs import ModelInfo, ModelRunnerOutput, SchedulerOutput, StepExtras
from pagoda.engine.llm_engine import LLMEngine
from pagoda.sampling_params import SamplingParams

VOCAB = 97
EOS = 5


def fake_next_token(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % VOCAB


class FakeWorker:
    def __init__(self, config, model_path: str) -> None:
        self.model_path = model_path
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.last_sampled: dict[str, int] = {}
        self.launched: list[SchedulerOutput] = []
        self.extras: list[StepExtras] = []
        self.kv_initialised = None

    def model_info(self) -> ModelInfo:
        return ModelInfo("FakeForCausalLM", VOCAB, 256, EOS)

    def describe_weights(self) -> str:
        return "none (a fake worker)"

    def determine_kv_cache_config(self, max_model_len: int) -> KVCacheConfig:
        return KVCacheConfig(64, [FullAttentionSpec(8, 2, 16, "float32")] * 2)

    def initialize_kv_cache(self, kv_config: KVCacheConfig, max_model_len: int) -> None:
        self.kv_initialised = (kv_config.num_blocks, max_model_len)

    def execute_model(self, out: SchedulerOutput) -> None:
        assert len(self.launched) == len(self.extras), "a forward was launched twice"
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.tokens.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        for cached in out.scheduled_cached_reqs:
            self.tokens[cached.req_id].extend(cached.new_token_ids)
            self.computed[cached.req_id] = cached.num_computed_tokens
        self.launched.append(out)

    def sample_tokens(self, extras: StepExtras) -> Done:
        assert len(self.launched) == len(self.extras) + 1, "sampling without a forward"
        self.extras.append(extras)
        out = self.launched[-1]
        req_ids, sampled, now = [], [], {}
        for rid, n in out.num_scheduled_tokens.items():
            tokens = self.tokens[rid]
            end = self.computed[rid] + n
            if end == len(tokens) + 1:  # the previous step's token, "on the device"
                tokens = tokens + [self.last_sampled[rid]]
            assert end <= len(tokens)
            req_ids.append(rid)
            if end == len(tokens):
                now[rid] = fake_next_token(tokens)
            sampled.append([now[rid]] if rid in now else [])
        self.last_sampled = now
        return Done(ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled))


def expected(prompt: list[int], max_tokens: int) -> list[int]:
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        token = fake_next_token(tokens)
        tokens.append(token)
        out.append(token)
        if token == EOS:
            break
    return out


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    done: dict[str, list[int]] = {}
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            return done
    raise AssertionError("requests did not finish")
