"""engine.slice_choice: the two paths take turns in a trial (slice, graph, graph, slice), and
the faster is kept while it stays faster."""

from __future__ import annotations

from engine.slice_choice import SliceChoice


def _run(choice: SliceChoice, slice_s: float, paged_s: float) -> list[bool]:
    paths = []
    while choice.chosen is None:
        sliced = choice.next_sliced()
        paths.append(sliced)
        choice.record(sliced, slice_s if sliced else paged_s)
    return paths


def test_the_paths_take_turns_slice_graph_graph_slice():
    choice = SliceChoice(trial_steps=4, trial_turn=2)
    assert _run(choice, 0.005, 0.006) == [True] * 2 + [False] * 4 + [True] * 2
    assert choice.samples == {True: [0.005] * 4, False: [0.006] * 4}


def test_a_path_whose_samples_are_in_gives_its_turns_to_the_other():
    choice = SliceChoice(trial_steps=3, trial_turn=2)
    assert _run(choice, 0.005, 0.006) == [True] * 2 + [False] * 3 + [True]


def test_a_host_that_speeds_up_during_the_trial_does_not_decide_it():
    """The host is slow at first (just after a prefill, say) and gets faster while the trial
    runs. The slice is 5 % faster at every moment, so it must win; timed first and alone it
    would take the slow moments and lose to the graph."""
    steps = 48
    choice = SliceChoice(trial_steps=24)
    k = 0
    while choice.chosen is None:
        sliced = choice.next_sliced()
        host = 1.0 + 0.3 * (1 - k / steps)  # 30 % slower at the start, down to none
        choice.record(sliced, (0.0055 if sliced else 0.0058) * host)
        k += 1
    assert choice.chosen is True, choice.report()


def test_the_faster_path_is_kept_with_its_numbers():
    fast_slice = SliceChoice(trial_steps=3)
    _run(fast_slice, 0.0052, 0.0059)
    assert fast_slice.chosen is True and fast_slice.next_sliced() is True
    assert fast_slice.report() == {"slice_ms": 5.2, "paged_ms": 5.9, "samples": 3, "chosen": "slice",
                                   "retrials": 0, "last_retrial": None}
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


def test_samples_after_the_choice_leave_the_trials_numbers_alone():
    choice = SliceChoice(trial_steps=1, watch_steps=8)
    _run(choice, 0.004, 0.006)
    choice.record(False, 0.001)  # the other path: not watched
    choice.record(True, 0.0041)
    assert choice.samples == {True: [0.004], False: [0.006]} and choice.chosen is True
    assert choice.watched == [0.0041]


def test_a_chosen_path_that_slows_past_the_others_trial_is_timed_again():
    """The H200 case: the slice won its trial, then slowed request after request."""
    choice = SliceChoice(trial_steps=3, watch_steps=4)
    _run(choice, 0.0055, 0.0058)
    assert choice.chosen is True
    for _ in range(4):
        choice.record(True, 0.0063)  # 9 % over the graph's 5.8 ms: within the margin
    assert choice.chosen is True and choice.retrials == 0 and choice.watched == []
    for t in (0.0107, 0.0107, 0.0050, 0.0107):  # the window's median, not one fast step
        choice.record(True, t)
    assert choice.chosen is None and choice.retrials == 1
    assert choice.last_retrial == {"path": "slice", "window_ms": 10.7, "other_trial_ms": 5.8}
    assert choice.report()["chosen"] is None
    assert _run(choice, 0.0107, 0.0058) == [True] * 3 + [False] * 3  # both timed afresh
    assert choice.chosen is False
    assert choice.report() == {"slice_ms": 10.7, "paged_ms": 5.8, "samples": 3, "chosen": "paged",
                               "retrials": 1, "last_retrial": choice.last_retrial}


def test_a_chosen_path_that_holds_is_kept():
    choice = SliceChoice(trial_steps=3, watch_steps=4)
    _run(choice, 0.0075, 0.0068)
    for _ in range(40):
        choice.record(False, 0.0070)  # the graph, within 10 % of the slice's 7.5 ms and faster
    assert choice.chosen is False and choice.retrials == 0
