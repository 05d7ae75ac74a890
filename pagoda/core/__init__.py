"""Pure bookkeeping of the engine: requests, scheduler, block pool, KV cache manager.

Nothing in this package imports torch: it runs and is tested on any CPU with exact
assertions.
"""
