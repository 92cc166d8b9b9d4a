"""engine.slice_choice: the slice is timed first, then the graph, and the faster is kept."""

from __future__ import annotations

from engine.slice_choice import SliceChoice


def _run(choice: SliceChoice, slice_s: float, paged_s: float) -> list[bool]:
    paths = []
    while choice.chosen is None:
        sliced = choice.next_sliced()
        paths.append(sliced)
        choice.record(sliced, slice_s if sliced else paged_s)
    return paths


def test_the_slice_is_timed_first_then_the_graph():
    choice = SliceChoice(trial_steps=4)
    assert _run(choice, 0.005, 0.006) == [True] * 4 + [False] * 4


def test_the_faster_path_is_kept_with_its_numbers():
    fast_slice = SliceChoice(trial_steps=3)
    _run(fast_slice, 0.0052, 0.0059)
    assert fast_slice.chosen is True and fast_slice.next_sliced() is True
    assert fast_slice.report() == {"slice_ms": 5.2, "paged_ms": 5.9, "samples": 3, "chosen": "slice"}
    slow_slice = SliceChoice(trial_steps=3)
    _run(slow_slice, 0.0075, 0.0068)
    assert slow_slice.chosen is False and slow_slice.next_sliced() is False
    assert slow_slice.report()["chosen"] == "paged"


def test_the_median_decides_not_one_outlier():
    choice = SliceChoice(trial_steps=5)
    for t in (0.005, 0.005, 0.090, 0.005, 0.005):  # one step that waited on something else
        choice.record(True, t)
    for _ in range(5):
        choice.record(False, 0.006)
    assert choice.chosen is True


def test_samples_after_the_choice_are_ignored():
    choice = SliceChoice(trial_steps=1)
    _run(choice, 0.004, 0.006)
    choice.record(False, 0.001)
    assert choice.samples == {True: [0.004], False: [0.006]} and choice.chosen is True
