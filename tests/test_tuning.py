"""The tuning knobs (:mod:`kalmanscan.tuning`): changed for a block, in one thread only, undone on
leaving it; bad names and values refused."""

import threading

import pytest

from kalmanscan import tuning


def test_tuned_holds_for_the_block_and_is_undone():
    assert tuning.current() == tuning.DEFAULT
    with tuning.tuned(small_work=0, replay=False) as knobs:
        assert tuning.current() is knobs and knobs.small_work == 0 and not knobs.replay
        with tuning.tuned(replay_after=5):
            assert tuning.current().small_work == 0 and tuning.current().replay_after == 5
        assert tuning.current().replay_after == tuning.DEFAULT.replay_after
    assert tuning.current() == tuning.DEFAULT
    with pytest.raises(RuntimeError), tuning.tuned(y_by_result=3):
        raise RuntimeError
    assert tuning.current() == tuning.DEFAULT


def test_another_thread_keeps_its_own_knobs():
    seen, entered, leave = [], threading.Event(), threading.Event()

    def other():
        with tuning.tuned(small_work=7):
            entered.set()
            leave.wait(10)
            seen.append(tuning.current().small_work)

    thread = threading.Thread(target=other)
    thread.start()
    entered.wait(10)
    assert tuning.current().small_work == tuning.DEFAULT.small_work
    with tuning.tuned(small_work=11):
        leave.set()
        thread.join(10)
        assert tuning.current().small_work == 11
    assert seen == [7]


@pytest.mark.parametrize("changes, match", [(dict(smallwork=1), "unknown knobs"), (dict(small_work=-1), "small_work"),
                                            (dict(replay=1), "replay must be True or False"),
                                            (dict(replay_graphs=0), "replay_graphs must be >= 1"),
                                            (dict(y_by_result=1.5), "y_by_result")])
def test_bad_knobs_are_refused(changes, match):
    with pytest.raises(ValueError, match=match), tuning.tuned(**changes):
        pass
