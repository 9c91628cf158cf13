"""One peer's liveness schedule alone (csrc/core/liveness.h), on a fake clock through the
private _C._Liveness binding: when a HELLO goes out, when a check begins, when the peer is
given up. No engine, no process."""
import pytest

from torch_p2p import _C

T = 10.0  # peer_timeout


def connected(now=100.0):
    live = _C._Liveness(T)
    live.connect(now)
    return live


def ready(now=100.0):
    live = connected(now)
    live.answered()
    return live


def test_connecting_waits_and_dies_unanswered_after_the_timeout():
    live = connected(100.0)
    assert live.state == "Connecting" and live.waits
    assert live.tick(100.0 + T, busy=True) == (False, "Alive")
    assert live.tick(100.0 + T + 0.001, busy=False) == (False, "Unanswered")


def test_an_answer_makes_it_ready():
    live = connected()
    live.answered()
    assert live.state == "Ready" and not live.waits and not live.checking
    assert live.tick(1e6, busy=False) == (False, "Alive")  # idle: never watched


def test_a_busy_peer_silent_for_a_quarter_of_the_timeout_is_checked():
    live = ready(100.0)
    assert live.tick(100.0 + T / 4, busy=True) == (False, "Alive")
    assert live.tick(100.0 + T / 4 + 0.01, busy=True) == (True, "Alive")  # the check's HELLO
    assert live.checking and live.waits
    assert live.tick(100.0 + T / 2, busy=True) == (False, "Alive")  # one check at a time
    # The check's deadline counts from the last sign of life.
    assert live.tick(100.0 + T, busy=True) == (False, "Alive")
    assert live.tick(100.0 + T + 0.01, busy=True) == (False, "Silent")


def test_a_sign_of_life_postpones_the_check():
    live = ready(100.0)
    live.heard(102.0)
    assert live.tick(102.0 + T / 4, busy=True) == (False, "Alive")
    assert live.tick(102.0 + T / 4 + 0.01, busy=True) == (True, "Alive")


def test_an_answered_check_ends_it():
    live = ready(100.0)
    assert live.start_check(deadline=110.0)
    assert not live.start_check(deadline=120.0)
    live.answered()
    assert not live.checking and live.state == "Ready"
    assert live.tick(111.0, busy=False) == (False, "Alive")


def test_only_a_ready_peer_is_checked():
    assert not connected().start_check(deadline=1e9)
    live = ready()
    live.fail()
    assert not live.start_check(deadline=1e9)


def test_silence_counts_from_when_work_begins():
    live = ready(100.0)
    live.watch_from(500.0)  # idle until then
    assert live.last_heard == 500.0
    assert live.tick(500.0 + T / 4, busy=True) == (False, "Alive")
    live.watch_from(400.0)  # never backwards
    assert live.last_heard == 500.0


def test_transient_hello_failures_retry_with_a_growing_pause():
    live = connected(100.0)
    pauses = []
    now = 100.0
    for _ in range(8):
        verdict, at = live.hello_failed(now, transient=True)
        assert verdict == "Later"
        pauses.append(round(at - now, 6))
        assert live.tick(at - 0.001, busy=True) == (False, "Alive")
        assert live.tick(at, busy=True) == (True, "Alive")  # the HELLO goes again
        now = at
    assert pauses == [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.5]


def test_a_hello_failure_is_final_when_not_transient_or_past_the_deadline():
    assert connected(100.0).hello_failed(100.0, transient=False)[0] == "GiveUp"
    assert connected(100.0).hello_failed(100.0 + T - 0.005, transient=True)[0] == "GiveUp"
    live = ready(100.0)
    assert live.start_check(deadline=105.0)
    assert live.hello_failed(104.999, transient=True)[0] == "GiveUp"


def test_a_hello_failure_after_the_answer_is_ignored():
    live = connected()
    live.answered()
    assert live.hello_failed(100.0, transient=True)[0] == "Ignore"
    live = connected()
    live.fail(left=True)
    assert live.state == "Left"
    assert live.hello_failed(100.0, transient=False)[0] == "Ignore"


def test_a_retry_due_after_the_answer_sends_nothing():
    live = connected(100.0)
    _, at = live.hello_failed(100.0, transient=True)
    live.answered()
    assert live.tick(at, busy=True) == (False, "Alive")


def test_connect_again_resets_the_schedule():
    live = ready(100.0)
    assert live.start_check(deadline=110.0)
    live.fail()
    assert live.state == "Dead" and not live.waits
    live.connect(200.0)
    assert live.state == "Connecting" and not live.checking
    assert live.tick(200.0 + T, busy=True) == (False, "Alive")
    assert live.tick(200.0 + T + 0.01, busy=True) == (False, "Unanswered")


@pytest.mark.parametrize("left", [False, True])
def test_a_failed_peer_is_not_watched(left):
    live = ready(100.0)
    live.fail(left=left)
    assert live.tick(1e6, busy=True) == (False, "Alive")
