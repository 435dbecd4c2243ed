"""``SilentAddresses`` (statemachine/decode/silent.py, spec/manager.md MGR-22): an address judged
silent is refused at once with ``PrefillSilent`` until a probe of it is heard (HEALTH-7)."""

from __future__ import annotations

from statemachine.decode.silent import SilentAddresses
from statemachine.errors import PrefillSilent

from .fakes import ADDR, OTHER_ADDR, ManualClock


def test_mgr_22_nothing_judged_silent_refuses_nothing() -> None:
    silent = SilentAddresses(clock=ManualClock())
    assert silent.refusal(ADDR) is None and silent.refused == 0


def test_mgr_22_a_silent_address_is_refused_at_once_saying_for_how_long() -> None:
    clock = ManualClock()
    silent = SilentAddresses(clock=clock)
    silent.judged_silent(ADDR, "3 probes timed out")
    clock.advance(2.5)
    refusal = silent.refusal(ADDR)
    assert isinstance(refusal, PrefillSilent) and refusal.addr == ADDR
    assert "2.50 s" in str(refusal) and "3 probes timed out" in str(refusal)
    assert "retry" in str(refusal)  # says what to do next
    assert silent.refused == 1 and len(silent) == 1


def test_mgr_22_only_the_silent_address_is_refused() -> None:
    silent = SilentAddresses(clock=ManualClock())
    silent.judged_silent(ADDR, "unanswered")
    assert silent.refusal(OTHER_ADDR) is None and silent.refused == 0


def test_health_7_a_heard_probe_lifts_the_hold_off() -> None:
    silent = SilentAddresses(clock=ManualClock())
    silent.judged_silent(ADDR, "unanswered")
    silent.heard(ADDR)
    silent.heard(OTHER_ADDR)  # never judged silent: nothing to lift, no error
    assert silent.refusal(ADDR) is None and len(silent) == 0


def test_clear_forgets_every_address() -> None:
    silent = SilentAddresses(clock=ManualClock())
    silent.judged_silent(ADDR, "unanswered")
    silent.judged_silent(OTHER_ADDR, "unanswered")
    silent.clear()
    assert len(silent) == 0 and silent.refusal(ADDR) is None
