"""The one harness of the benchmark programs.

- timing: device time between CUDA events, CUDA graph replay, host wall-clock timers
- results: write_result (JSON with the machine: GPU, torch and triton versions)
- server: a real `pagoda serve` on a free port, and `pagoda bench serve` against it
- rooflines: measured copy bandwidth, bf16 matmul rate and disk read ceiling; model bytes
- workloads: random prompts, token arrival times, small model directories
- processes: running a benchmark module in a child process
- traces: torch.profiler chrome traces by kernel kind, step, idle gap and increment
- compiles: which Triton kernels compiled inside a region
"""
