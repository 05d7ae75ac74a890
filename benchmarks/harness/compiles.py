"""Which Triton kernels compile during a region of a benchmark, and how long each took.

    from benchmarks.harness.compiles import CompileLog
    with CompileLog() as log:
        llm.generate(...)
    log.summary()   # {"count": n, "seconds": s, "kernels": [{"kernel", "seconds"}, ...]}

Triton calls `knobs.runtime.jit_cache_hook` just before it compiles a kernel variant
(a new set of compile-time constants or argument specialisations, not found in the
in-process cache) and `jit_post_compile_hook` just after; the log pairs the two by the
variant's repr. A variant found in Triton's on-disk cache still passes both hooks, in
a fraction of the time. Where this Triton has no such knobs the log says so
(`available: False`) rather than reporting zero compilations.
"""

from __future__ import annotations

import time


class CompileLog:
    def __init__(self) -> None:
        self.entries: list[dict] = []
        self._started: dict[str, float] = {}
        self._saved = None
        self.available = False

    def _before(self, *args, **kwargs):
        self._started[str(kwargs.get("repr"))] = time.perf_counter()
        return None  # a truthy return would tell Triton to skip the compilation

    def _after(self, *args, **kwargs):
        name = str(kwargs.get("repr"))
        start = self._started.pop(name, None)
        fn = kwargs.get("fn")
        kernel = getattr(fn, "name", None) or name.split("[", 1)[0]
        self.entries.append(
            {
                "kernel": kernel,
                "variant": name[:300],
                "seconds": None if start is None else time.perf_counter() - start,
            }
        )
        return None

    def __enter__(self) -> CompileLog:
        try:
            from triton import knobs

            runtime = knobs.runtime
        except (ImportError, AttributeError):
            return self
        self._saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._before, self._after
        self.available = True
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            from triton import knobs

            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved
            self._saved = None

    def summary(self) -> dict:
        timed = [e["seconds"] for e in self.entries if e["seconds"] is not None]
        return {
            "available": self.available,
            "count": len(self.entries),
            "seconds": sum(timed),
            "kernels": sorted(
                ({"kernel": e["kernel"], "seconds": e["seconds"]} for e in self.entries),
                key=lambda e: -(e["seconds"] or 0.0),
            ),
        }
