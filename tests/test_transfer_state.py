"""The transfer state machine alone (csrc/core/transfer.h), through private bindings: what a
transfer does next given its state and facts, and which moves between states are allowed. No
engine, no process."""
import pytest

from torch_p2p import _C

STATES = ["New", "WaitingForPeer", "Queued", "Running", "AwaitingAck", "Notifying", "Reported"]


def step(state, message=False, ok=True, held=False, acked=False, pending=0, needs_confirm=False):
    return _C._transfer_next_step(state=state, message=message, ok=ok, held=held, acked=acked,
                                  pending=pending, needs_confirm=needs_confirm)


def test_running_waits_for_its_ops_then_reports():
    assert step("Running", pending=3) == "Wait"
    assert step("Running", pending=0) == "Report"


def test_running_asks_for_confirmation_when_its_route_needs_one():
    assert step("Running", pending=1, needs_confirm=True) == "Wait"
    assert step("Running", needs_confirm=True) == "Confirm"
    assert step("AwaitingAck", needs_confirm=True) == "Wait"
    assert step("AwaitingAck", acked=True, needs_confirm=True) == "Report"


def test_a_message_waits_for_its_acknowledgement():
    assert step("Running", message=True) == "AwaitAck"
    assert step("AwaitingAck", message=True) == "Wait"
    assert step("AwaitingAck", message=True, acked=True) == "Report"
    # The acknowledgement came before the send's own completion.
    assert step("Running", message=True, acked=True) == "Report"
    assert step("Running", message=True, acked=True, pending=1) == "Wait"


def test_notifying_reports_once_the_notice_has_left():
    assert step("Notifying", pending=1) == "Wait"
    assert step("Notifying") == "Report"


def test_a_failure_reports_at_once_unless_held():
    for state in ["Queued", "Running", "AwaitingAck", "Notifying"]:
        assert step(state, ok=False, pending=2) == "Report"
        assert step(state, ok=False, held=True, pending=2) == "Wait"
        assert step(state, ok=False, held=True) == "Wait"


def test_nothing_moves_before_generation_or_after_the_report():
    for state in ["New", "WaitingForPeer", "Queued"]:
        assert step(state) == "Wait"
        assert step(state, message=True) == "Wait"
    assert step("Reported") == "Wait"
    assert step("Reported", ok=False) == "Wait"


ALLOWED = {
    ("New", "WaitingForPeer"), ("New", "Queued"), ("New", "Running"), ("New", "Reported"),
    ("WaitingForPeer", "Queued"), ("WaitingForPeer", "Running"), ("WaitingForPeer", "Reported"),
    ("Queued", "Running"), ("Queued", "Reported"),
    ("Running", "AwaitingAck"), ("Running", "Notifying"), ("Running", "Reported"),
    ("AwaitingAck", "Notifying"), ("AwaitingAck", "Reported"),
    ("Notifying", "Reported"),
}


@pytest.mark.parametrize("source", STATES)
def test_only_the_documented_moves_are_allowed(source):
    for target in STATES:
        assert _C._transfer_may_enter(source, target) == ((source, target) in ALLOWED), (source, target)


def test_unknown_state_names_are_refused():
    with pytest.raises(ValueError):
        _C._transfer_may_enter("Done", "Reported")
