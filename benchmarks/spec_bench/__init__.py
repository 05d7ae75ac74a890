"""The modes of `python -m benchmarks.spec_decode`, one module each: cpu (n-gram and
layer-skip drafts on the embedded SmolLM2), replay (replayed drafts at controlled
acceptance), draft (draft models), mtp (a DeepSeek-V3 cut's MTP layer, its drafts
replayed) and serve (through `pagoda serve`). `common` holds the
prompts, speculative configs and acceptance figures they share; `bench` the one engine
that replay and draft time under each configuration."""
