"""Pagoda's benchmark programs. Run each from the repository root as a module:
`python -m benchmarks.<name> --help`. README.md lists them; the shared code (timers,
result files, server launcher, rooflines) is in benchmarks/harness/."""
