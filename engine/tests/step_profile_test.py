"""engine.step_profile's summary of a profiler's events: time and launches per step by name, and
the busy time as the union of overlapping intervals (kernels waiting under programmatic
dependent launch overlap the one before them)."""

from engine.step_profile import summarize


def test_busy_time_counts_overlapping_kernels_once_and_gaps_not_at_all():
    spans = [
        ("gemv", 0.0, 10.0),
        ("split", 8.0, 14.0),  # launched while gemv finishes: 4 us more busy, not 6
        ("combine", 9.0, 12.0),  # inside what is already busy
        ("gemv", 20.0, 30.0),  # after 6 us with no kernel
    ]
    profile = summarize(spans, steps=2, tokens=2)
    assert profile.wall_us_per_step == 15.0  # 30 us from the first start to the last end
    assert profile.busy_us_per_step == 12.0  # 24 us busy: 0-14 and 20-30
    names = [(k.name, k.us_per_step, k.launches_per_step) for k in profile.kernels]
    assert names == [("gemv", 10.0, 1.0), ("split", 3.0, 0.5), ("combine", 1.5, 0.5)]
    assert "us/step" in profile.table()


def test_no_events_make_an_empty_profile():
    profile = summarize([], steps=3, tokens=0)
    assert (profile.wall_us_per_step, profile.busy_us_per_step, profile.kernels) == (0.0, 0.0, [])
    assert "no events" in profile.table()
