"""The parts of `python -m benchmarks.soak`: `client` (one request of the workload to its
single outcome) and `report` (the summary, its checks and the table)."""
