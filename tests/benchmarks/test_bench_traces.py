"""benchmarks.harness.traces.increments (profile_step's timeline mode): the critical-path
increments of a device timeline, exactly, on a made-up trace where the second kernel
starts before the first ends (as with PDL)."""

from benchmarks.harness.traces import increments


def test_increments_add_up_to_the_span_and_name_the_predecessor():
    # Two steps of norm -> gemv (starts 2 us before the norm ends) -> attn.
    spans = []
    for t in (0.0, 100.0):
        spans += [(t, t + 5, "norm"), (t + 3, t + 12, "gemv"), (t + 12, t + 16, "attn")]
    rows = increments(spans, steps=2)
    by_kernel = {(r["after"], r["kernel"]): r for r in rows}
    gemv = by_kernel[("norm", "gemv")]
    assert (gemv["per_step"], gemv["increment_us"], gemv["duration_us"], gemv["head_start_us"]) == (
        1.0,
        7.0,
        9.0,
        2.0,
    )
    attn = by_kernel[("gemv", "attn")]
    assert (attn["increment_us"], attn["head_start_us"]) == (4.0, 0.0)
    # The step boundary pair (attn -> next step's norm) carries the idle time between.
    between = by_kernel[("attn", "norm")]
    assert (between["per_step"], between["increment_us"]) == (0.5, 89.0)
    # Ordered by increment per step; all increments add up to last end - first end.
    assert [r["kernel"] for r in rows] == ["norm", "gemv", "attn"]
    assert sum(r["increment_us_per_step"] for r in rows) * 2 == spans[-1][1] - spans[0][1]
