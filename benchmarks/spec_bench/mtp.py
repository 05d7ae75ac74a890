"""spec_decode mtp: MTP speculation (a DeepSeek-V3 checkpoint's own multi-token
prediction layer) at controlled acceptance, batch 1.

The model: the DeepSeek-V3 preset's shape cut to --layers decoder layers (the preset's
first_k_dense_replace = 3 of them dense, the rest MoE) plus its MTP layer (index
--layers, MoE), written with random weights as a safetensors directory (MTP reads a
real checkpoint: dummy weights are refused for it). --experts routed experts per MoE
layer instead of the preset's 256 (default 64): a decode row reads only its 8 routed
experts and the shared one, so the count barely moves a decode step, while a verify
step of k + 1 rows reads the union of its rows' experts (k = 3: ~26.5 distinct at 64,
~30.5 at 256, 22 at 32); the checkpoint shrinks from ~55 GB to ~21.5 GB.

What the cut does to the figure: one MTP application reads about as many weight bytes
as a decode step of one MoE layer plus the LM head, so at 4 layers it costs about half
a target decode step (0.50 of its bytes), against 0.044 in the 61-layer model. The run
prints that fraction beside the times; speed-ups scale with it (--layers raises it
within the GPU's memory and the checkpoint's write time).

Replay, as the replay mode does it: the target's o_proj and MLP / MoE down
projections (routed and shared experts) are written as zeros, so each layer adds
exactly 0 to the residual while every kernel does its full work, and the greedy next
token is a function of the current token only, whatever the step's shape. The MTP
layer keeps random weights and RUNS every step (its cost is what is measured), but
the drafts it proposes are replaced by ReplayProposer's (the recorded greedy
continuation, each draft corrupted with probability 1 - target acceptance): the
drafter's propose() is wrapped on the engine's instance, nothing else changes.

One engine (num_speculative_tokens = max(--k)) serves every configuration: "off"
detaches the scheduler's draft planner and the runner's drafter (the runner then does
what an engine without speculation does; only the KV pool keeps the MTP layer's
blocks); "layer only" detaches the planner alone (the MTP layer runs on every step,
nothing is drafted: what the product pays when the budget drafts nothing); "always"
(the adaptive budget off) and "adaptive" (the default) run with the budget's max_k
set to each --k (the lookahead slots the scheduler keeps for max(--k) only allocate).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time

from benchmarks.spec_bench.bench import Bench, make_prompts
from benchmarks.spec_bench.common import KEY_LEN
from benchmarks.spec_bench.replay import DraftAcceptance, ReplayProposer, acceptance_text

TARGETS = (0.0, 0.5, 0.8, 0.95)
MODES = ("always", "adaptive")
WEIGHT_STD = 0.02  # the dummy loader's: sane activations through random layers
SHARD_PREFIX = "model-"


def add_mtp_args(p) -> None:
    p.add_argument("--layers", type=int, default=4, help="target decoder layers (3 dense)")
    p.add_argument("--experts", type=int, default=64, help="routed experts per MoE layer")
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 3], help="drafts per step")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch1-requests", type=int, default=4)
    p.add_argument("--checkpoint-root", default=None, help="where the checkpoint goes (/tmp)")
    p.add_argument("--keep-checkpoint", action="store_true", help="do not delete it")
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny V3 shape, a few tokens")


def model_arch(args):
    """The DeepSeek-V3 preset cut to args.layers layers and args.experts experts (the
    smoke run: a tiny V3 of 1 dense and 1 MoE layer)."""
    from pagoda.model.presets import get_preset

    arch = get_preset("deepseek-v3")
    if args.smoke:
        arch = arch.replace(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=8,
            intermediate_size=128,
            vocab_size=512,
            max_position_embeddings=4096,
            torch_dtype="float32",
            mla=dataclasses.replace(
                arch.mla,
                q_lora_rank=24,
                kv_lora_rank=32,
                qk_nope_head_dim=16,
                qk_rope_head_dim=8,
                v_head_dim=16,
            ),
            moe=dataclasses.replace(
                arch.moe,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                n_group=4,
                topk_group=2,
                first_k_dense_replace=1,
            ),
        )
    moe = dataclasses.replace(arch.moe, num_experts=args.experts)
    return arch.replace(num_hidden_layers=args.layers, moe=moe)


_ARCH_KEYS = (
    "hidden_size num_hidden_layers num_attention_heads num_key_value_heads "
    "intermediate_size vocab_size rms_norm_eps rope_theta rope_scaling "
    "max_position_embeddings tie_word_embeddings torch_dtype bos_token_id eos_token_id"
).split()
_MLA_KEYS = "q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim".split()
_MOE_KEYS = (
    "num_experts_per_tok moe_intermediate_size scoring_func topk_method n_group "
    "topk_group routed_scaling_factor n_shared_experts first_k_dense_replace moe_layer_freq"
).split()


def hf_config(arch) -> dict:
    """config.json of a V3 checkpoint of arch's shape with one MTP layer."""
    return {
        "architectures": [arch.architecture],
        "model_type": "deepseek_v3",
        **{k: getattr(arch, k) for k in _ARCH_KEYS},
        **{k: getattr(arch.mla, k) for k in _MLA_KEYS},
        **{k: getattr(arch.moe, k) for k in _MOE_KEYS},
        "n_routed_experts": arch.moe.num_experts,
        "norm_topk_prob": arch.moe.renormalize,
        "num_nextn_predict_layers": 1,
    }


def layer_tensors(arch, index: int):
    """(name, shape, kind) of decoder layer `index` (index num_hidden_layers: the MTP
    layer, with its own projections and head); kind: "norm" (ones), "bias" (zeros,
    float32), "branch" (a residual branch's output projection: zeros in the target,
    random in the MTP layer) or "random"."""
    mla, moe, h = arch.mla, arch.moe, arch.hidden_size
    heads, p = arch.num_attention_heads, f"model.layers.{index}."
    out = [(p + "input_layernorm.weight", (h,), "norm")]
    out += [(p + "post_attention_layernorm.weight", (h,), "norm")]
    a = p + "self_attn."
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    out += [
        (a + "q_a_proj.weight", (mla.q_lora_rank, h), "random"),
        (a + "q_a_layernorm.weight", (mla.q_lora_rank,), "norm"),
        (a + "q_b_proj.weight", (heads * qk, mla.q_lora_rank), "random"),
        (a + "kv_a_proj_with_mqa.weight", (mla.kv_lora_rank + mla.qk_rope_head_dim, h), "random"),
        (a + "kv_a_layernorm.weight", (mla.kv_lora_rank,), "norm"),
        (a + "kv_b_proj.weight", (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank), "random"),
        (a + "o_proj.weight", (h, heads * mla.v_head_dim), "branch"),
    ]  # fmt: skip
    if moe.is_moe_layer_index(arch.architecture, index):
        m = p + "mlp."
        out += [(m + "gate.weight", (moe.num_experts, h), "random")]
        if moe.topk_method == "noaux_tc":
            out += [(m + "gate.e_score_correction_bias", (moe.num_experts,), "bias")]
        mlps = [(f"{m}experts.{e}.", moe.moe_intermediate_size) for e in range(moe.num_experts)]
        mlps += [(m + "shared_experts.", moe.shared_intermediate_size)]
    else:
        mlps = [(p + "mlp.", arch.intermediate_size)]
    for prefix, width in mlps:
        out += [
            (prefix + "gate_proj.weight", (width, h), "random"),
            (prefix + "up_proj.weight", (width, h), "random"),
            (prefix + "down_proj.weight", (h, width), "branch"),
        ]
    if index == arch.num_hidden_layers:  # MTP: its input projection and its own head
        out += [(p + n, (h,), "norm") for n in ("enorm.weight", "hnorm.weight")]
        out += [(p + "eh_proj.weight", (h, 2 * h), "random")]
        out += [(p + "shared_head.norm.weight", (h,), "norm")]
        out += [(p + "shared_head.head.weight", (arch.vocab_size, h), "random")]
    return out


def _make(shape, kind: str, is_mtp: bool, dtype, device, generator):
    import torch

    if kind == "norm":
        return torch.ones(shape, dtype=dtype)
    if kind == "bias":
        return torch.zeros(shape, dtype=torch.float32)
    if kind == "branch" and not is_mtp:
        return torch.zeros(shape, dtype=dtype)
    values = torch.empty(shape, dtype=dtype, device=device)
    return values.normal_(0.0, WEIGHT_STD, generator=generator).cpu()


def write_checkpoint(arch, path: str) -> int:
    """A safetensors directory of arch's shape (one shard a layer, an index); returns
    its bytes. Random values are drawn on the GPU when there is one."""
    import torch
    from safetensors.torch import save_file

    from pagoda.model.loader.safetensors import INDEX_FILE

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, arch.torch_dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    h, v, n = arch.hidden_size, arch.vocab_size, arch.num_hidden_layers
    shards = [[("model.embed_tokens.weight", (v, h), "random")]]
    shards += [layer_tensors(arch, i) for i in range(n + 1)]
    shards += [[("model.norm.weight", (h,), "norm"), ("lm_head.weight", (v, h), "random")]]
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"{SHARD_PREFIX}{i:05d}-of-{len(shards):05d}.safetensors"
        is_mtp = shard[0][0].startswith(f"model.layers.{n}.")
        tensors = {t: _make(s, kind, is_mtp, dtype, device, generator) for t, s, kind in shard}
        save_file(tensors, os.path.join(path, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
    if device == "cuda":
        torch.cuda.empty_cache()  # the engine's memory profile comes next
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config(arch), f, indent=1)
    return total


def active_bytes(arch) -> tuple[int, int]:
    """(weight bytes a batch-1 decode step of the target reads, those one application
    of the MTP layer reads): attention, the dense MLP or the routed + shared experts a
    token uses, the LM head (the embedding's one row left out)."""
    mla, moe, h = arch.mla, arch.moe, arch.hidden_size
    heads, qk = arch.num_attention_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim
    attention = h * mla.q_lora_rank + mla.q_lora_rank * heads * qk
    attention += h * (mla.kv_lora_rank + mla.qk_rope_head_dim)
    attention += mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    attention += heads * mla.v_head_dim * h
    dense = 3 * h * arch.intermediate_size
    sparse = moe.num_experts * h + 3 * h * moe.moe_intermediate_size * (
        moe.num_experts_per_tok + moe.n_shared_experts
    )
    n, head = arch.num_hidden_layers, arch.vocab_size * h
    num_sparse = sum(moe.is_moe_layer_index(arch.architecture, i) for i in range(n))
    target = n * attention + (n - num_sparse) * dense + num_sparse * sparse + head
    mtp_mlp = sparse if moe.is_moe_layer_index(arch.architecture, n) else dense
    mtp = 2 * h * h + attention + mtp_mlp + head
    size = 4 if arch.torch_dtype == "float32" else 2
    return target * size, mtp * size


class ReplayedDrafts:
    """Wraps an MTPProposer's propose(): the layer runs as it would (its k applications
    and their cost), then each request's drafts are replaced, as many as it proposed,
    by the replay's (None: the layer's own drafts pass)."""

    def __init__(self, drafter) -> None:
        self.propose = drafter.propose
        self.replay: ReplayProposer | None = None
        drafter.propose = self

    def __call__(self, starts) -> dict[str, list[int]]:
        drafts = self.propose(starts)
        if self.replay is None:
            return drafts
        for start in starts:
            mine = drafts[start.req_id]
            if mine:  # the request's tokens at 0 .. position: the replay's lookup
                tokens = start.tokens_between(0, start.position + 1)
                drafts[start.req_id] = self.replay(tokens, len(mine))
        return drafts


class MTPBench(Bench):
    """Bench over a checkpoint directory with MTP speculation (k = max of ks), its
    drafter's proposals replayed; run() takes "off", "layer only", "always" and
    "adaptive" and a k."""

    def __init__(self, args, path: str) -> None:
        from pagoda import LLM

        self.args = args
        kwargs = dict(
            max_model_len=args.input_len + args.output_len + 64,
            max_num_seqs=4,  # batch 1 only: few graphs to capture
            seed=0,
            skip_tokenizer_init=True,
            speculative_config={"method": "mtp", "num_speculative_tokens": max(args.k)},
        )
        if args.smoke:
            kwargs.update(device="cpu", kv_cache_memory=64 << 20)
        self.llm = LLM(path, **kwargs)
        self.engine = self.llm.llm_engine
        self.planner = self.engine.scheduler.draft_planner
        self.vocab = self.engine.model_info.vocab_size
        self.runner = self.engine.executor.runner
        self.drafter = self.runner.drafter
        self.replayed = ReplayedDrafts(self.drafter)
        self.counter = DraftAcceptance(self.planner.budget)

    def run(self, mode: str, prompts, concurrency: int = 1, k: int = 0, corrupt=None) -> dict:
        self.runner.drafter = None if mode == "off" else self.drafter
        self.planner.budget.max_k = k or max(self.args.k)
        self.replayed.replay = None
        if corrupt is not None:
            self.replayed.replay = ReplayProposer(self.recorded, corrupt, self.vocab)
        row = super().run("off" if mode == "layer only" else mode, prompts, concurrency)
        self.runner.drafter = self.drafter
        row["mode"], row["k"] = mode, k or None
        if corrupt is not None:
            same = [
                self.recorded[tuple(p[:KEY_LEN])][1] == o for p, o in zip(prompts, row["outputs"])
            ]
            row["corrupt"], row["same_as_recorded"] = corrupt, sum(same) / len(same)
        self.last_outputs = row.pop("outputs")
        return row


def _warm_up(bench: MTPBench, args) -> None:
    """Every configuration's kernels compiled (verify steps of k + 1 rows for each k)."""
    warm = make_prompts(1, args.input_len, bench.vocab, seed=7)
    for k in args.k:
        bench.run("always", warm, k=k)
    bench.run("off", warm)


def _batch_1_rows(bench: MTPBench, args) -> tuple[dict, list[dict]]:
    """("layer only" at batch 1, and per target acceptance: off, then always and
    adaptive for each k), after the recording the replay draws from."""
    prompts = make_prompts(args.batch1_requests, args.input_len, bench.vocab, seed=1)
    # Recorded with the layer on: the prompts' cached blocks then hold its KV too.
    bench.run("layer only", prompts)
    bench.recorded = {tuple(p[:KEY_LEN]): (len(p), o) for p, o in zip(prompts, bench.last_outputs)}
    off = bench.run("off", prompts, corrupt=1.0)
    layer_only = bench.run("layer only", prompts, corrupt=1.0)
    layer_only["speedup"] = off["ms_per_token"] / layer_only["ms_per_token"]
    print(
        f"\n== batch 1: ms/token ({args.input_len} in, {args.output_len} out; x: speed-up "
        "over off; acc/draft/len: vLLM's acceptance, per-draft acceptance, mean accepted "
        f"length)\nthe MTP layer on every step, nothing drafted: {layer_only['ms_per_token']:.2f}"
        f" ({layer_only['speedup']:.2f}x; off {off['ms_per_token']:.2f})"
    )
    print(
        f"{'target':>7}{'k':>3}{'off':>8}{'always':>15}{'adaptive':>15}"
        f"{'always acc/draft/len':>22}{'adaptive acc/draft/len':>24}{'same':>6}"
    )
    rows = []
    for target in args.targets:
        off = bench.run("off", prompts, corrupt=1.0 - target)
        for k in args.k:
            row = {m: bench.run(m, prompts, k=k, corrupt=1.0 - target) for m in MODES}
            for r in row.values():
                r["speedup"] = off["ms_per_token"] / r["ms_per_token"]
            rows.append({"target_acceptance": target, "k": k, "off": off, **row})
            same = min(r["same_as_recorded"] for r in (off, *row.values()))
            print(
                f"{target:>7.2f}{k:>3}{off['ms_per_token']:>8.2f}"
                + "".join(
                    f"{row[m]['ms_per_token']:>8.2f} ({row[m]['speedup']:.2f}x)" for m in MODES
                )
                + f"{acceptance_text(row['always']):>22}{acceptance_text(row['adaptive']):>24}"
                f"{same:>6.2f}"
            )
    return layer_only, rows


def run_mtp(args) -> dict:
    if args.smoke:
        args.layers, args.experts, args.input_len, args.output_len = 2, 8, 16, 12
        args.batch1_requests = 1
    args.targets = TARGETS
    arch = model_arch(args)
    path = tempfile.mkdtemp(prefix="pagoda-mtp-bench-", dir=args.checkpoint_root)
    try:
        start = time.perf_counter()
        size = write_checkpoint(arch, path)
        written = time.perf_counter() - start
        bench = MTPBench(args, path)
        loaded = time.perf_counter() - start - written
        result = _measure(bench, args, arch, size, written, loaded)
        result["seconds"] = time.perf_counter() - start
        bench.engine.shutdown()
    finally:
        if not args.keep_checkpoint:
            shutil.rmtree(path, ignore_errors=True)
    return result


def _measure(bench: MTPBench, args, arch, size: int, written: float, loaded: float) -> dict:
    from pagoda.model.presets import get_preset

    info = bench.engine.model_info
    target, mtp = active_bytes(arch)
    full_target, full_mtp = active_bytes(get_preset("deepseek-v3"))
    print(
        f"\n== DeepSeek-V3 shape, {arch.num_hidden_layers} layers "
        f"({arch.moe.first_k_dense_replace} dense) + MTP layer, {arch.moe.num_experts} "
        f"experts; checkpoint {size / 1e9:.1f} GB written in {written:.0f} s, engine up in "
        f"{loaded:.0f} s; async scheduling {'on' if bench.engine.async_scheduling else 'off'}"
        f"\none MTP application reads {mtp / target:.2f} of a target decode step's weight "
        f"bytes here ({full_mtp / full_target:.3f} in the 61-layer preset); the budget's "
        f"draft cost (all weight bytes): {info.draft_weight_bytes / info.weight_bytes:.3f}"
    )
    _warm_up(bench, args)
    layer_only, rows = _batch_1_rows(bench, args)
    return {
        "model": "deepseek-v3",
        "layers": arch.num_hidden_layers,
        "experts": arch.moe.num_experts,
        "k": args.k,
        "checkpoint_bytes": size,
        "checkpoint_write_seconds": written,
        "engine_start_seconds": loaded,
        "async_scheduling": bench.engine.async_scheduling,
        "mtp_active_byte_fraction": mtp / target,
        "mtp_active_byte_fraction_full_preset": full_mtp / full_target,
        "draft_weight_fraction": info.draft_weight_bytes / info.weight_bytes,
        "target_residual_branches_zeroed": True,
        "layer_only": layer_only,
        "batch_1": rows,
    }
