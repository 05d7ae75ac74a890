"""Reading torch.profiler's results: kernel names into groups, a chrome trace's device
activity attributed to the engine steps that launched it, idle gaps with the host work
around them, and the per-kernel increments of a device timeline."""

from __future__ import annotations

import bisect
import collections
import gzip
import json
import os
import re
import shutil
import statistics
import tempfile
from collections import defaultdict

# Kernel name patterns -> coarse group, first match wins (Triton kernels keep their
# Python names; cuBLAS / CUTLASS GEMMs carry gemm / cutlass / sm90 in theirs).
KERNEL_GROUPS: list[tuple[str, str]] = [
    (r"moe_gemm|fused_moe|align_small|moe_align", "moe experts"),
    (r"route|topk|sort|softmax|sigmoid", "routing / top-k"),
    (r"mla|paged|attention|attn|flash|decode_kernel|store_kv|reshape_and_cache", "attention"),
    (r"rms_norm|layer_norm|norm", "norm"),
    (r"rotary|rope", "rotary"),
    (r"silu|act_and_mul|gelu", "activation"),
    (r"gemm|gemv|cutlass|sm90|sm80|cublas|nvjet|matmul|splitK|dot_kernel", "gemm (dense)"),
    (r"all_reduce|nccl", "communication"),
    (r"copy|memcpy|memset|fill|cat|index|gather|scatter", "copy / index"),
    (r"elementwise|vectorized|reduce|unrolled", "elementwise / reduce"),
]

# Kernel name fragments -> a finer kind, first match wins (names are lower-cased).
KERNEL_KINDS = [
    ("_moe_gemm", "moe_gemm"),
    ("_gemv_gate_up", "moe_gemv"),
    ("_gemv_down", "moe_gemv"),
    ("fmha", "sdpa"),
    ("flash", "sdpa"),
    ("catarray", "cat"),
    ("_mla_prefill", "mla_prefill"),
    ("_align_small", "moe_align"),
    ("_align_count", "moe_align"),
    ("_align_place", "moe_align"),
    ("router", "moe_route"),
    ("_route", "moe_route"),
    ("_mla_decode", "mla_decode"),
    ("_mla_merge", "mla_decode"),
    ("_absorb", "mla_proj"),
    ("_project_v", "mla_proj"),
    ("_store_latent", "store_kv"),
    ("_norm_rope_store", "store_kv"),
    ("attention_kernel", "sdpa"),
    ("efficient", "sdpa"),
    ("_chunk_kernel", "attn_chunk"),
    ("_decode_kernel", "attn_decode"),
    ("_decode_words", "attn_decode"),
    ("_quant_rows", "act_quant"),
    ("_w8a16", "gemv"),
    ("_gemv_kernel", "gemv"),
    ("_w8a8_gemm", "gemm"),
    ("xmma", "gemm"),
    ("_merge_kernel", "attn_merge"),
    ("_store_kv", "store_kv"),
    ("rms_norm", "rms_norm"),
    ("silu", "silu_mul"),
    ("rotary", "rotary"),
    ("nvjet", "gemm"),
    ("gemm", "gemm"),
    ("cutlass", "gemm"),
    ("softmax", "sampling"),
    ("argmax", "sampling"),
    ("sort", "sampling"),
    ("topk", "sampling"),
    ("memcpy", "memcpy"),
    ("memset", "memset"),
    ("reduce", "reduce"),
    ("index", "index"),
    ("elementwise", "elementwise"),
]

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def group_of(name: str) -> str:
    low = name.lower()
    for pattern, group in KERNEL_GROUPS:
        if re.search(pattern, low):
            return group
    return "other"


def kind_of(name: str) -> str:
    low = name.lower()
    for fragment, kind in KERNEL_KINDS:
        if fragment in low:
            return kind
    return "other"


def chrome_trace(prof, gzip_path: str | None = None) -> dict:
    """The profile as a chrome trace (a dict); also written to gzip_path when given."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw) as f:
            trace = json.load(f)
        if gzip_path:
            os.makedirs(os.path.dirname(os.path.abspath(gzip_path)), exist_ok=True)
            with open(raw, "rb") as src, gzip.open(gzip_path, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return trace


# ---------------------------------------------------------------- per step ----------
def attribute_kernels(
    trace: dict, num_steps: int, prefix: str = "pagoda_step_"
) -> tuple[list, dict]:
    """Each kernel, copy and memset goes to the step whose record_function range
    (`prefix` + index) launched it: the profiler's correlation id joins it to its host
    launch, so the attribution holds with async scheduling, where the host runs a step
    ahead of the device. Per step: device ms by kind, device span, and the host time in
    the four largest CUDA runtime calls; over the run: device busy time (union of the
    intervals) and first-to-last span."""
    events = trace["traceEvents"]
    ranges = sorted(
        (e["ts"], e["ts"] + e["dur"], int(e["name"].rsplit("_", 1)[1]))
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") == "user_annotation"
        and str(e.get("name", "")).startswith(prefix)
    )
    starts = [r[0] for r in ranges]
    launch_step = {}
    runtime = [collections.defaultdict(float) for _ in range(num_steps)]
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            corr = e.get("args", {}).get("correlation")
            k = bisect.bisect_right(starts, e["ts"]) - 1
            if k < 0 or e["ts"] > ranges[k][1]:
                continue
            step = ranges[k][2]
            if corr is not None:
                launch_step[corr] = step
            if step < num_steps:  # host time in runtime calls: long ones are waits
                runtime[step][e["name"]] += e["dur"] / 1e3
    per_step = [collections.defaultdict(float) for _ in range(num_steps)]
    spans = [[float("inf"), 0.0] for _ in range(num_steps)]
    intervals = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in DEVICE_CATEGORIES:
            continue
        intervals.append((e["ts"], e["ts"] + e["dur"]))
        step = launch_step.get(e.get("args", {}).get("correlation"))
        if step is None or step >= num_steps:
            continue
        per_step[step][kind_of(e["name"])] += e["dur"] / 1e3
        spans[step][0] = min(spans[step][0], e["ts"])
        spans[step][1] = max(spans[step][1], e["ts"] + e["dur"])
    busy, end = 0.0, float("-inf")
    for s, t in sorted(intervals):  # union of device intervals
        if t > end:
            busy += t - max(s, end)
            end = t
    first = min((s for s, _ in intervals), default=0.0)
    run = {
        "device_busy_ms": busy / 1e3,
        "device_first_to_last_ms": (end - first) / 1e3 if intervals else 0.0,
    }
    steps = [
        {
            "kinds": dict(k),
            "device_ms": sum(k.values()),
            "span_ms": (sp[1] - sp[0]) / 1e3 if sp[1] else 0.0,
            "runtime_ms": {
                n: round(v, 3) for n, v in sorted(rt.items(), key=lambda kv: -kv[1])[:4]
            },
        }
        for k, sp, rt in zip(per_step, spans, runtime)
    ]
    return steps, run


# ---------------------------------------------------------------- timeline ----------
def device_intervals(trace: dict) -> list[tuple[float, float, str]]:
    """(start, end, name) of every device activity in a chrome trace, by start (us)."""
    spans = [
        (e["ts"], e["ts"] + e.get("dur", 0), e["name"])
        for e in trace["traceEvents"]
        if e.get("cat") in DEVICE_CATEGORIES and e.get("ph") == "X"
    ]
    return sorted(spans)


def host_events(trace: dict) -> list[tuple[float, float, str, str]]:
    """(start, end, name, category) of CPU ops and CUDA runtime calls, by start (us)."""
    spans = [
        (e["ts"], e["ts"] + e.get("dur", 0), e["name"], e.get("cat", ""))
        for e in trace["traceEvents"]
        if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")
        and e.get("ph") == "X"
    ]
    return sorted(spans)


def idle_gaps(spans: list[tuple[float, float, str]]) -> tuple[float, list[tuple]]:
    """Busy time (union of spans) and the idle gaps between them: (start, end, before, after)."""
    busy, gaps = 0.0, []
    cur_start, cur_end, cur_name = spans[0]
    for start, end, name in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((cur_end, start, cur_name, name))
            cur_start, cur_end = start, end
        elif end > cur_end:
            cur_end = end
        cur_name = name if end >= cur_end else cur_name
    busy += cur_end - cur_start
    return busy, gaps


def describe_gap(gap: tuple, hosts: list[tuple]) -> dict:
    """A gap with the host work around it: what ended within 20 us before the device went
    idle, what ran through the gap, and what started in it (the launch that ended it)."""
    start, end, before, after = gap
    ended_before = [h[2] for h in hosts if start - 20 <= h[1] <= start + 2][-6:]
    spanning = sorted({h[2] for h in hosts if h[0] < start and h[1] > end})
    started = [h[2] for h in hosts if start <= h[0] < end][:12]
    return {
        "us": round(end - start, 2),
        "device_before": before[:80],
        "device_after": after[:80],
        "host_ended_before": ended_before,
        "host_spanning": spanning[:8],
        "host_started_in_gap": started,
    }


def host_table(hosts: list[tuple], steps: int) -> list[dict]:
    """Per name: calls and host us per step, largest first."""
    total, count = defaultdict(float), defaultdict(int)
    for start, end, name, cat in hosts:
        total[(name, cat)] += end - start
        count[(name, cat)] += 1
    rows = [
        {
            "name": n,
            "cat": c,
            "per_step": count[(n, c)] / steps,
            "us_per_step": total[(n, c)] / steps,
        }
        for (n, c) in total
    ]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def increments(
    spans: list[tuple[float, float, str]], steps: int, name_width: int = 40
) -> list[dict]:
    """Per (predecessor, activity) pair in device order: how often per step, and the
    medians of the activity's increment (end minus the predecessor's end), duration and
    head start (the predecessor's end minus its start), largest total increment first.
    With PDL a kernel starts before its predecessor ends, so its own duration overstates
    what it adds to the step; the increments of a step add up to its span."""
    pairs = defaultdict(list)
    for (_, e0, before), (s1, e1, name) in zip(spans, spans[1:]):
        pairs[(before[:name_width], name[:name_width])].append((e1 - e0, e1 - s1, e0 - s1))
    rows = []
    for (before, name), values in pairs.items():
        incr, dur, early = (statistics.median(v) for v in zip(*values))
        rows.append(
            {
                "after": before,
                "kernel": name,
                "per_step": len(values) / steps,
                "increment_us": incr,
                "duration_us": dur,
                "head_start_us": early,
                "increment_us_per_step": sum(v[0] for v in values) / steps,
            }
        )
    return sorted(rows, key=lambda r: -r["increment_us_per_step"])


def timeline(trace: dict, steps: int) -> dict:
    """Device busy and idle time per step, the largest idle gaps with the host work
    around them, the host table and the per-kernel increments."""
    spans, hosts = device_intervals(trace), host_events(trace)
    if not spans:
        return {"device_spans": 0, "host_table": host_table(hosts, steps)[:30]}
    window = spans[-1][1] - spans[0][0]
    busy, gaps = idle_gaps(spans)
    big = sorted(gaps, key=lambda g: g[0] - g[1])[:8]
    return {
        "device_spans": len(spans),
        "window_us": window,
        "busy_us_per_step": busy / steps,
        "idle_us_per_step": (window - busy) / steps,
        "gaps_over_5us_per_step": sum(1 for g in gaps if g[1] - g[0] > 5) / steps,
        "largest_gaps": [describe_gap(g, hosts) for g in big],
        "host_table": host_table(hosts, steps)[:30],
        "increments": increments(spans, steps)[:30],
    }
