#!/usr/bin/env bash
# The kernel and model tests on a GPU machine, in parallel processes.
#
# On a fresh GPU machine most of a test's time is Triton compiling kernel variants (one
# CPU core each); run one process at a time, tests/test_fused_moe_kernel.py alone did
# not finish in 100 s on the H200. pytest-xdist spreads the files' tests over N
# processes sharing the GPU (the tests size their KV caches explicitly).
#
#   tools/gpu_tests.sh --fetch          where a package index is reachable: downloads
#                                       pytest-xdist and execnet into .whl/ (add /.whl/
#                                       to .git/info/exclude; copy it to the GPU machine)
#   tools/gpu_tests.sh [-n N] [FILES]   on the GPU machine: installs them from .whl/ into /tmp/site
#                                       and runs FILES (default: the kernel and MoE/MLA
#                                       model tests) with N processes (default 8)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--fetch" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 -d .whl \
    pytest-xdist==3.8.0 execnet==2.1.2
  ls .whl
  exit 0
fi

workers=8
if [ "${1:-}" = "-n" ]; then
  workers="$2"
  shift 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/pytest_xdist-*.whl .whl/execnet-*.whl
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
if [ "$#" -eq 0 ]; then
  set -- tests/test_fused_moe_kernel.py tests/test_moe_routing_kernel.py \
    tests/test_moe_routing.py tests/test_moe_router_fused.py tests/test_moe_layers.py \
    tests/test_mla_prefill.py tests/test_mla_kernels.py tests/test_mla_absorb.py \
    tests/test_pdl.py tests/test_fused_ops.py tests/test_gemv_kernel.py \
    tests/test_qk_rope_store.py tests/test_triton_attention.py \
    tests/test_fp8_kv_kernels.py tests/test_short_context_graphs.py \
    tests/test_l2_prefetch.py tests/test_input_stream.py tests/test_fp8_linear_kernels.py \
    tests/test_deepseek.py tests/test_qwen3_moe.py
fi
exec python3 -m pytest -q -p xdist -n "$workers" "$@"
