"""MTP speculation (a DeepSeek V3 checkpoint's multi-token prediction layer) on a tiny
random checkpoint, CPU, the reference MLA backend.

The checkpoint: transformers' tiny DeepseekV3 (2 layers: dense, MoE) saved as
safetensors with num_nextn_predict_layers = 1, and an MTP layer 2 written beside it
(transformers does not keep one): an MoE decoder block taken from a random 3-layer
model, enorm / hnorm / eh_proj / shared_head, and the embedding copy.

- the MTP module's logits equal a reference of the MTP math computed here from the
  saved tensors (plain torch, and transformers' own decoder layer for the block),
  through the paged latent cache in two chunks;
- greedy outputs with mtp k = 1 and k = 2 equal speculation off's, with chunked
  prefill, prefix-cache hits, preemption, several requests at once (sync and async
  scheduling), and seeded sampled outputs too (their randomness is per output index);
- every draft the engine proposes equals the reference's greedy guess for the tokens
  the request held then (the first from the target's hidden state, the second from
  the layer applied again to its own output): a stale or missing KV entry of the
  layer, a row fed the wrong next token or hidden state, would change some;
- an "echo" checkpoint, whose MTP layer guesses what the target says next, has most
  drafts accepted (k = 3), outputs unchanged: verify steps that keep several rows,
  and the rows the next step feeds the layer after them, are right;
- a model without MTP layers is refused.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.engine_checks import assert_all_blocks_free
from helpers.hf_compare import randomize
from helpers.tiny_models import tiny_deepseek_config
from safetensors.torch import load_file, save_file
from torch import nn

from pagoda import LLM, SamplingParams
from pagoda.attention.forward_context import forward_context
from pagoda.attention.kv_pool import KVCachePool
from pagoda.attention.metadata import build_attention_metadata
from pagoda.attention.mla_backend import MLATorchBackend
from pagoda.core.kv_cache_spec import KVCacheConfig
from pagoda.model.deepseek_mtp import load_deepseek_mtp
from pagoda.model.layers.attention import kv_cache_specs
from pagoda.model.loader import load_model
from pagoda.model.mla_config import mla_softmax_scale

torch.set_num_threads(1)

MTP = "model.layers.2."
OVERRIDES = dict(q_lora_rank=24)


def _random(model, seed: int, quiet: bool) -> None:
    """Random weights (helpers.hf_compare.randomize) and routing bias; quiet: the blocks'
    output projections scaled by 0.01, so that each position's logits follow from its
    own token (the echo checkpoint)."""
    randomize(model, seed)
    gen = torch.Generator().manual_seed(seed)
    for name, buf in model.named_buffers():  # V3's routing bias: loaded, and it matters
        if name.endswith("e_score_correction_bias"):
            buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))
    if quiet:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "o_proj" in name or "down_proj" in name:
                    param.mul_(0.01)


def save_donor(path, seed: int, quiet: bool = False, arch: str = "deepseek_v3") -> None:
    """A random 3-layer model whose layer 2 (an MoE block: index >= first_k_dense_replace)
    becomes the MTP layer's block, saved in the checkpoint's tensor layout."""
    config, cls = tiny_deepseek_config(arch, num_hidden_layers=3, **OVERRIDES)
    torch.manual_seed(seed)
    donor = cls(config).eval()
    _random(donor, seed, quiet)
    donor.save_pretrained(path, safe_serialization=True)


def _mtp_tensors(donor_path, seed: int, hf, echo: bool) -> dict[str, torch.Tensor]:
    """The donor's layer 2 and the MTP layer's own tensors, under the checkpoint's names.
    echo: eh_proj passes the token's normed embedding through and the shared head is
    the target's norm and LM head, so the layer guesses what the target says after
    that token (which, with quiet blocks, is what the target says after it)."""
    saved = load_file(str(donor_path / "model.safetensors"))
    tensors = {k: v for k, v in saved.items() if k.startswith(MTP)}
    gen = torch.Generator().manual_seed(seed)
    embed = hf.model.embed_tokens.weight.detach()
    hidden, vocab = embed.shape[1], embed.shape[0]
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{MTP}{norm}.weight"] = 0.5 + torch.rand(hidden, generator=gen)
    tensors[MTP + "eh_proj.weight"] = 0.15 * torch.randn(hidden, 2 * hidden, generator=gen)
    tensors[MTP + "shared_head.head.weight"] = 0.3 * torch.randn(vocab, hidden, generator=gen)
    if echo:
        tensors[MTP + "enorm.weight"] = torch.ones(hidden)
        eye = torch.eye(hidden)
        tensors[MTP + "eh_proj.weight"] = torch.cat([eye, 0.01 * eye], dim=1)
        tensors[MTP + "shared_head.norm.weight"] = hf.model.norm.weight.detach().clone()
        tensors[MTP + "shared_head.head.weight"] = hf.lm_head.weight.detach().clone()
    tensors[MTP + "embed_tokens.weight"] = embed.clone()
    return tensors


def save_mtp_checkpoint(
    path, donor_path=None, seed: int = 0, echo: bool = False, arch: str = "deepseek_v3"
):
    """A tiny DeepseekV3 (or arch) directory, with an MTP layer from the donor's layer 2
    (none without a donor); returns the transformers target model."""
    nextn = 0 if donor_path is None else 1
    config, cls = tiny_deepseek_config(arch, num_nextn_predict_layers=nextn, **OVERRIDES)
    torch.manual_seed(seed)
    hf = cls(config).eval()
    _random(hf, seed, quiet=echo)
    hf.save_pretrained(path, safe_serialization=True)
    written = json.loads((path / "config.json").read_text())
    assert written.get("num_nextn_predict_layers", 0) == nextn
    if donor_path is not None:
        tensors = _mtp_tensors(donor_path, seed + 100, hf, echo)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "mtp.safetensors"))
    return hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, transformers target, donor directory)."""
    donor = tmp_path_factory.mktemp("mtp-donor")
    save_donor(donor, seed=5)
    path = tmp_path_factory.mktemp("deepseek-mtp")
    return path, save_mtp_checkpoint(path, donor), donor


@pytest.fixture(scope="module")
def echo_checkpoint(tmp_path_factory):
    donor = tmp_path_factory.mktemp("mtp-echo-donor")
    save_donor(donor, seed=6, quiet=True)
    path = tmp_path_factory.mktemp("deepseek-mtp-echo")
    save_mtp_checkpoint(path, donor, seed=2, echo=True)
    return path


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class MTPReference:
    """The MTP math over one whole sequence, from the saved tensors: plain torch for
    the norms, projection and head; transformers' DeepseekV3 decoder layer (loaded
    with the saved block) for the block, run alone through its model's forward."""

    def __init__(self, path, hf_target, donor_path):
        saved = load_file(str(path / "mtp.safetensors"))
        self.hf_target = hf_target
        self.w = {k[len(MTP) :]: v for k, v in saved.items()}
        _, cls = tiny_deepseek_config("deepseek_v3")
        donor = cls.from_pretrained(
            str(donor_path), dtype=torch.float32, attn_implementation="eager"
        ).eval()
        # The donor's layer 2 is the block the MTP layer's tensors were written from.
        donor.model.layers = nn.ModuleList([donor.model.layers[2]])
        donor.model.norm = nn.Identity()
        self.block_model = donor.model

    @torch.no_grad()
    def target_hidden(self, tokens: list[int]) -> torch.Tensor:
        """The target's final (normed) hidden states [len(tokens), hidden]."""
        return self.hf_target.model(torch.tensor([tokens])).last_hidden_state[0]

    @torch.no_grad()
    def hidden(self, next_tokens: list[int], prev_hidden: torch.Tensor) -> torch.Tensor:
        """h' of rows 0.. (row i: position i, the token at i + 1, a hidden state)."""
        w = self.w
        embeds = w["embed_tokens.weight"][torch.tensor(next_tokens)]
        x = torch.cat([_rms(embeds, w["enorm.weight"]), _rms(prev_hidden, w["hnorm.weight"])], -1)
        x = x @ w["eh_proj.weight"].T
        return self.block_model(inputs_embeds=x[None]).last_hidden_state[0]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return _rms(h, self.w["shared_head.norm.weight"]) @ self.w["shared_head.head.weight"].T

    def drafts(self, tokens: list[int], k: int) -> list[tuple[int, float]]:
        """(greedy guess, its top-2 logit margin) of the first k drafts after tokens:
        the first from the target's hidden states, each next one from the layer's own
        h' of the row before, one position on."""
        target = self.target_hidden(tokens)[:-1]  # rows 0 .. P - 1 (P: the last token)
        next_tokens, prev = list(tokens[1:]), target
        out = []
        for depth in range(k):
            h = self.hidden(next_tokens, prev)
            top = self.logits(h[-1]).topk(2)
            out.append((int(top.indices[0]), float(top.values[0] - top.values[1])))
            if depth + 1 < k:  # the chain row: the guess, fed the layer's last h'
                next_tokens = next_tokens + [out[-1][0]]
                prev = torch.cat([target, h[len(target) - 1 :]])
        return out


@pytest.fixture(scope="module")
def reference(checkpoint):
    return MTPReference(*checkpoint)


TOKENS = torch.randint(3, 384, (45,), generator=torch.Generator().manual_seed(7)).tolist()


def test_mtp_module_logits_match_the_reference(checkpoint, reference):
    path = checkpoint[0]
    model, arch = load_model(str(path), dtype="float32")
    block_size, specs = 4, kv_cache_specs(model, 4, torch.float32)
    mtp = load_deepseek_mtp(str(path), arch, torch.float32, torch.device("cpu"), len(specs))
    assert [a.layer_idx for a in mtp.attention_layers()] == [2]
    mtp_specs = mtp.kv_cache_specs(block_size, torch.float32)
    pool = KVCachePool(KVCacheConfig(32, specs + mtp_specs), "cpu")
    backend = MLATorchBackend(
        arch.num_attention_heads,
        arch.mla.kv_lora_rank,
        arch.mla.qk_rope_head_dim,
        mla_softmax_scale(arch.mla, arch.rope_scaling),
        "decode",
    )
    target = reference.target_hidden(TOKENS)
    next_tokens = torch.tensor(TOKENS[1:])
    rows = len(TOKENS) - 1
    expected = reference.logits(reference.hidden(TOKENS[1:], target[:rows]))
    table = torch.randperm(32, generator=torch.Generator().manual_seed(1)).tolist()
    got = []
    for start, end in ((0, 26), (26, rows)):  # the second chunk reads the first's cache
        metadata = build_attention_metadata([end - start], [end], [table], block_size, "cpu")
        with torch.no_grad(), forward_context(backend, backend.build_metadata(metadata), pool):
            ids = model.model.embed_tokens(next_tokens[start:end])
            h = mtp(ids, torch.arange(start, end), target[start:end])
            got.append(mtp.compute_logits(h))
    got = torch.cat(got)
    assert (got - expected).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def make_llm(path, speculative_config=None, async_scheduling=False) -> LLM:
    # 14 blocks of 16 tokens for 6 requests of up to 64 tokens: preemption; 32 tokens a
    # step: chunked prefill; a shared 32-token prefix: prefix-cache hits.
    return LLM(
        str(path),
        skip_tokenizer_init=True,
        device="cpu",
        dtype="float32",
        max_model_len=128,
        block_size=16,
        num_gpu_blocks_override=14,
        max_num_batched_tokens=32,
        max_num_seqs=6,
        async_scheduling=async_scheduling,
        speculative_config=speculative_config,
    )


def _prompts() -> tuple[list[list[int]], list[int]]:
    """(prompts, the 32-token prefix the first three share)."""
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 384, (32,), generator=gen).tolist()
    shared = [prefix + torch.randint(3, 384, (n,), generator=gen).tolist() for n in (4, 9, 1)]
    alone = [torch.randint(3, 384, (n,), generator=gen).tolist() for n in (45, 13, 30)]
    return shared + alone, prefix


def prompts() -> list[list[int]]:
    return _prompts()[0]


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)


def run(llm, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def expected(checkpoint):
    llm = make_llm(checkpoint[0])
    return run(llm, GREEDY), run(llm, SEEDED)


def record_drafts(llm) -> list[tuple[list[int], list[int]]]:
    """From here on: (the request's tokens, its drafts) of every proposal."""
    drafter, seen = llm.llm_engine.executor.runner.drafter, []
    propose = drafter.propose

    def recording(starts):
        drafts = propose(starts)
        for start in starts:
            tokens = start.tokens_between(0, start.position + 1)
            seen.append((tokens, drafts[start.req_id]))
        return drafts

    drafter.propose = recording
    return seen


@pytest.mark.parametrize(("k", "async_scheduling"), [(1, False), (2, False), (2, True)])
def test_greedy_and_seeded_outputs_equal_speculation_off(
    checkpoint, reference, expected, k, async_scheduling
):
    spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive": False}
    llm = make_llm(checkpoint[0], spec, async_scheduling)
    seen = record_drafts(llm)
    assert run(llm, GREEDY) == expected[0]
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_decode.num_draft_tokens > 40
    assert_all_blocks_free(llm)
    # Every proposal is the reference's greedy guess (near-ties left out: the engine's
    # float32 sums run in another order than transformers'). Requests that took a
    # prefix-cache hit from another request are left out: the layer's entry at the
    # hit's last position holds the other request's next token (module docstring of
    # pagoda/spec_decode/proposers/mtp.py).
    prefix, checked = _prompts()[1], [0] * k
    for tokens, drafts in seen[::2]:
        if tokens[: len(prefix)] == prefix:
            continue
        for depth, (got, (want, margin)) in enumerate(
            zip(drafts, reference.drafts(tokens, len(drafts)))
        ):
            if margin < 1e-3:
                break
            assert got == want, (depth, tokens, drafts)
            checked[depth] += 1
    assert min(checked) > 10, checked
    assert run(llm, SEEDED) == expected[1]


@pytest.mark.parametrize(("k", "async_scheduling"), [(3, False), (3, True)])
def test_drafts_an_echo_layer_gets_right_are_accepted(echo_checkpoint, k, async_scheduling):
    """The echo layer guesses what the target will say: most drafts are accepted, so
    verify steps keep several rows and the layer's next step starts past them."""
    off = run(make_llm(echo_checkpoint), GREEDY)
    spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive": False}
    llm = make_llm(echo_checkpoint, spec, async_scheduling)
    assert run(llm, GREEDY) == off
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    spec_stats = stats.spec_decode
    assert spec_stats.num_accepted_tokens > 0.8 * spec_stats.num_draft_tokens > 40
    assert_all_blocks_free(llm)


def test_mtp_on_a_sparse_attention_model_keeps_outputs(tmp_path_factory):
    """DeepSeek-V3.2: the MTP layer's block holds its own indexer (its keys in a pool
    layer after the target's); with the echo layer most drafts are accepted and the
    outputs equal speculation off's."""
    donor = tmp_path_factory.mktemp("mtp-v32-donor")
    save_donor(donor, seed=8, quiet=True, arch="deepseek_v32")
    path = tmp_path_factory.mktemp("deepseek-v32-mtp")
    save_mtp_checkpoint(path, donor, seed=3, echo=True, arch="deepseek_v32")
    off = run(make_llm(path), GREEDY)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    llm = make_llm(path, spec)
    assert run(llm, GREEDY) == off
    spec_stats = llm.llm_engine.get_stats().spec_decode
    assert spec_stats.num_accepted_tokens > 0.8 * spec_stats.num_draft_tokens > 40
    assert_all_blocks_free(llm)


def test_mtp_is_refused_for_a_model_without_mtp_layers(tmp_path):
    save_mtp_checkpoint(tmp_path, seed=1)
    with pytest.raises(ValueError, match="num_nextn_predict_layers missing or 0"):
        make_llm(tmp_path, {"method": "mtp", "num_speculative_tokens": 1})


def test_mtp_config_keys():
    from pagoda.config import SpeculativeConfig

    spec = SpeculativeConfig.from_dict(
        {"method": "mtp", "num_speculative_tokens": 2, "draft_confidence_threshold": 0.5}
    )
    assert (spec.method, spec.num_speculative_tokens) == ("mtp", 2)
    with pytest.raises(ValueError, match="belongs to method 'draft_model'"):
        SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 2, "model": "x"})
