"""The modes of `python -m benchmarks.profile_step`, one module each: decode (the kernel
table of one decode step, and the step as served), static (the static workload step by
step), timeline (a served decode step's device idle gaps) and cpu (a CPU decode step's
engine stages and model parts). `common` holds what the GPU modes share."""
