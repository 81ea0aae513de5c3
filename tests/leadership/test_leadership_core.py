"""`leadership`'s decisions alone, on a fake clock: no database, no threads, no event loop.

The drivers (`lease.Keeper`, `aio.AsyncKeeper`, both stores) only block or await around these
decisions; test_leadership.py runs them against real databases on both faces.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cronoq_store import StoreUnavailable
from cronoq_store.errors import StoreError
from cronoq_store.leadership import (
    Acquiring,
    GiveUp,
    Keeping,
    Leadership,
    Renew,
    Retry,
    StepDown,
    Taken,
    Wait,
)

EVERY, TTL = 2.0, 10.0

# Keeping: the keeper's decisions.


@dataclass
class Advance:
    seconds: float


@dataclass
class End:
    """The running renewal (if any) ends with `result`."""

    result: bool | BaseException


@dataclass
class Fence:
    """A commit that started `ago` seconds back landed (its fence check renewed the lease)."""

    ago: float


class Stop:
    pass


events = st.lists(
    st.one_of(
        st.builds(Advance, st.floats(min_value=0.0, max_value=2 * TTL)),
        st.builds(
            End,
            st.sampled_from([True, True, True, False, StoreUnavailable("down"), ValueError("x")]),
        ),
        st.builds(Fence, st.floats(min_value=0.0, max_value=TTL)),
        st.just(Stop()),
    ),
    max_size=60,
)


class Model:
    """What the database knows: the lease cannot expire before `expiry` (a renewal started at
    `s` runs on the database no earlier than `s`, and sets expiry to its own now plus the TTL)."""

    def __init__(self, now: float) -> None:
        self.expiry = now + TTL
        self.taken_over = False


@settings(max_examples=300, deadline=None)
@given(events)
def test_keeper_leads_only_while_the_lease_cannot_have_expired(script: list[object]) -> None:
    now = 1000.0
    keeper = Keeping(every=EVERY, ttl=TTL, renewed_at=now)
    model = Model(now)
    running: float | None = None
    last_end = now
    stepped_down: list[str] = []

    def decide() -> None:
        nonlocal running
        decision = keeper.next(now)
        if decision is None:
            assert stepped_down or stopped
            return
        assert not stepped_down, "a decision after stepping down"
        if isinstance(decision, StepDown):
            stepped_down.append(decision.reason)
            # Only when it may be lost: taken over, or past the earliest expiry.
            assert model.taken_over or now >= keeper.deadline
            assert keeper.deadline <= model.expiry
            return
        # Still leading: the lease cannot have expired, nor been taken over.
        assert now < keeper.deadline <= model.expiry
        assert not model.taken_over
        if isinstance(decision, Renew):
            # Never scheduled at or past the deadline, nor sooner than `every` after the last.
            assert decision.at < keeper.deadline
            assert decision.at >= last_end + EVERY - 1e-9
            if decision.at <= now:
                assert running is None
                keeper.started(now)
                running = now
        else:
            assert isinstance(decision, Wait)
            assert now < decision.until <= keeper.deadline

    stopped = False
    for event in script:
        decide()
        if isinstance(event, Advance):
            now += event.seconds
        elif isinstance(event, End) and running is not None:
            if event.result is True:
                model.expiry = max(model.expiry, running + TTL)
            elif event.result is False:
                model.taken_over = True
            keeper.ended(now, event.result)
            running, last_end = None, now
        elif isinstance(event, Fence) and not model.taken_over:
            model.expiry = max(model.expiry, now - event.ago + TTL)
            keeper.renewed(now - event.ago)
        elif isinstance(event, Stop):
            keeper.stop()
            stopped = True
    decide()
    now = max(now, keeper.deadline)  # at the deadline at the latest, it steps down
    decide()
    assert stopped or len(stepped_down) == 1


def _when(decision: Renew | Wait | StepDown | None, now: float) -> float:
    """When a keeper's driver must act on `decision` made at `now` (an overdue one: now)."""
    if isinstance(decision, Renew):
        return max(now, decision.at)
    if isinstance(decision, Wait):
        return max(now, decision.until)
    return now if isinstance(decision, StepDown) else float("inf")


@settings(max_examples=300, deadline=None)
@given(
    renewals=st.lists(st.tuples(st.floats(0, 3 * TTL), st.booleans()), max_size=6),
    running=st.booleans(),
    later=st.floats(0, 2 * TTL),
    ago=st.floats(0, TTL),
)
def test_a_fence_renewal_never_makes_a_decision_due_sooner(
    renewals: list[tuple[float, bool]], running: bool, later: float, ago: float
) -> None:
    """Why a commit's fence renewal wakes neither keeper thread (`KeeperShell.renewed`): it
    only ever moves the next renewal or the deadline later, so a thread asleep until the old
    time wakes then and waits again, and nothing is missed by not waking it now."""
    keeper, now = Keeping(every=EVERY, ttl=TTL, renewed_at=0.0), 0.0
    for gap, ok in renewals:
        now += gap
        keeper.started(now)
        keeper.ended(now, ok or StoreUnavailable("down"))
    if running:
        keeper.started(now)
    now += later
    twin = Keeping(every=EVERY, ttl=TTL, renewed_at=0.0)
    twin.__dict__.update(keeper.__dict__)
    before = _when(twin.next(now), now)
    keeper.renewed(max(0.0, now - ago))
    assert _when(keeper.next(now), now) >= before


def step_down_reason(keeper: Keeping, now: float) -> str:
    decision = keeper.next(now)
    assert isinstance(decision, StepDown), decision
    assert keeper.next(now) is None  # once
    return decision.reason


def test_keeper_reasons() -> None:
    keeper = Keeping(every=1, ttl=4, renewed_at=0)
    assert keeper.next(0) == Renew(1)
    keeper.started(1)
    assert keeper.next(3.9) == Wait(4)  # a renewal runs: wait for it, or the deadline
    assert keeper.ended(4.5, True) is None  # ended past the old deadline: still in time
    assert keeper.deadline == 5  # from the renewal's start, not its end
    assert keeper.next(4.5) == Wait(5)  # the next one would start past the deadline
    assert step_down_reason(keeper, 5) == "the lease was not renewed within its TTL (4 s)"

    keeper = Keeping(every=1, ttl=4, renewed_at=0)
    keeper.started(1)
    assert step_down_reason(keeper, 4) == (
        "the lease was not renewed within its TTL (4 s): a renewal hung"
    )
    assert keeper.ended(6, True) is None and keeper.next(6) is None  # too late: no change

    keeper = Keeping(every=1, ttl=4, renewed_at=0)
    keeper.started(1)
    note = keeper.ended(1.5, StoreUnavailable("down"))
    assert note == (logging.WARNING, "renewing the cronoq lease failed, retrying: down")
    assert keeper.next(1.5) == Renew(2.5)
    keeper.started(2.5)
    note = keeper.ended(2.5, ValueError("bug"))
    assert note is not None and note[0] == logging.ERROR
    assert step_down_reason(keeper, 4) == (
        "the lease was not renewed within its TTL (4 s): ValueError('bug')"
    )

    keeper = Keeping(every=1, ttl=4, renewed_at=0)
    keeper.started(1)
    keeper.ended(1.1, False)
    assert step_down_reason(keeper, 1.1) == "the lease was taken over"

    keeper = Keeping(every=1, ttl=4, renewed_at=0)
    keeper.stop()
    assert keeper.next(100) is None


def test_keeper_reasons_name_the_last_failure_or_nothing() -> None:
    """What an operator reads when the holder steps down: the last failed renewal's error, or
    the TTL alone when no renewal ever ended."""
    keeper = Keeping(every=1, ttl=4, renewed_at=0)
    keeper.started(1)
    keeper.ended(1.5, StoreUnavailable("down"))
    assert step_down_reason(keeper, 4) == "the lease was not renewed within its TTL (4 s): down"

    keeper = Keeping(every=5, ttl=4, renewed_at=0)  # the first renewal would be past the TTL
    assert keeper.next(0) == Wait(4)
    assert step_down_reason(keeper, 4) == "the lease was not renewed within its TTL (4 s)"


def test_a_renewal_that_ends_after_the_keeper_finished_changes_nothing() -> None:
    keeper = Keeping(every=1, ttl=4, renewed_at=0)
    keeper.started(1)
    keeper.stop()
    assert keeper.ended(2, True) is None
    assert keeper.deadline == 4  # not moved to the late renewal's start plus the TTL
    assert keeper.next(2) is None


# Acquiring: the acquire loop's decisions.


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(["held", "down"]), max_size=40),
    st.one_of(st.none(), st.floats(min_value=0.0, max_value=30.0)),
    st.floats(min_value=0.0, max_value=0.2),
)
def test_acquire_polls_backs_off_and_gives_up_at_the_deadline(
    outcomes: list[str], timeout: float | None, lag: float
) -> None:
    poll, max_delay, start = 0.5, 5.0, 100.0
    acquiring = Acquiring(poll=poll, max_delay=max_delay, timeout=timeout, now=start)
    now, streak = start, 0
    warnings = 0
    for outcome in [*outcomes, "taken"]:
        now += lag  # the attempt's own time
        error = StoreUnavailable("refused") if outcome == "down" else None
        result = error or (None if outcome == "held" else (1, now))
        step = acquiring.attempted(now, result)
        if step.note is not None and step.note[0] == logging.WARNING:
            warnings += 1
            assert streak == 0, "one warning per unreachable streak, not one per try"
        if isinstance(step, Taken):
            assert outcome == "taken"
            return
        if isinstance(step, GiveUp):
            assert timeout is not None and now >= start + timeout
            why = "unreachable: refused" if outcome == "down" else "another instance holds"
            assert why in str(step.error) and f"after {timeout} s" in str(step.error)
            return
        assert isinstance(step, Retry)
        assert timeout is None or now < start + timeout
        assert now < step.at
        if timeout is not None:
            assert step.at <= start + timeout
        expected = min(poll * 2**streak, max_delay) if outcome == "down" else poll
        assert step.at == pytest.approx(min(now + expected, start + (timeout or 1e9)))
        streak = streak + 1 if outcome == "down" else 0
        now = step.at
    raise AssertionError("never taken")


def test_acquire_notes_the_transitions() -> None:
    acquiring = Acquiring(poll=1, max_delay=5, timeout=None, now=0)
    step = acquiring.attempted(0, StoreUnavailable("refused"))
    assert step.note == (
        logging.WARNING,
        "cannot reach the database to acquire leadership: refused",
    )
    assert acquiring.attempted(1, StoreUnavailable("refused")).note is None
    assert acquiring.attempted(3, None).note == (logging.INFO, "the database is reachable again")
    assert acquiring.attempted(4, (1, 4.0)) == Taken()


def test_acquire_notes_ride_on_the_decision_they_come_with() -> None:
    """The transition's line is on whatever decision comes with it (a take right after the
    database came back, a retry or a give-up under a deadline), and the give-up says why."""
    warning = (logging.WARNING, "cannot reach the database to acquire leadership: refused")
    acquiring = Acquiring(poll=1, max_delay=5, timeout=10, now=0)
    step = acquiring.attempted(0, StoreUnavailable("refused"))
    assert isinstance(step, Retry) and step.note == warning
    assert acquiring.attempted(1, (1, 1.0)) == Taken(
        (logging.INFO, "the database is reachable again")
    )

    acquiring = Acquiring(poll=1, max_delay=5, timeout=2, now=0)
    assert acquiring.attempted(1, None).note is None
    gave_up = acquiring.attempted(2, StoreUnavailable("refused"))
    assert isinstance(gave_up, GiveUp) and gave_up.note == warning
    assert str(gave_up.error) == "not leader after 2 s: the database is unreachable: refused"

    held = Acquiring(poll=1, max_delay=5, timeout=2, now=0).attempted(2, None)
    assert isinstance(held, GiveUp) and held.note is None
    assert str(held.error) == "not leader after 2 s: another instance holds the lease"


# Leadership: who leads, and which news is stale.


def test_leadership_ignores_stale_keepers_and_epochs() -> None:
    first, second = object(), object()
    state: Leadership[object] = Leadership()
    assert state.leading is None and state.lose() is None  # never led: nothing to lose
    state.acquired(3, first)
    assert state.leading == 3 and state.may_commit(3) and not state.may_commit(2)
    assert state.fence_renewed(3, 1) is first and state.fence_renewed(2, 1) is None
    assert state.lose(keeper=second) is None  # a keeper of another lease
    assert state.lose(epoch=2) is None  # a commit fenced under an older epoch
    lost = state.lose(keeper=first)
    assert lost is not None and (lost.epoch, lost.keeper) == (3, first)
    assert state.lose() is None  # once
    assert state.leading is None and not state.may_commit(3)
    assert state.detach() is first and state.detach() is None
    state.acquired(4, second)
    assert state.lose(keeper=first) is None  # the old keeper's late news
    assert state.lose(epoch=4) is not None
    state.released()
    assert state.epoch is None


def test_error_types() -> None:
    """A `StoreError` that is not `StoreUnavailable` is a failed renewal too, retried."""
    keeper = Keeping(every=1, ttl=4, renewed_at=0)
    keeper.started(1)
    note = keeper.ended(1, StoreError("constraint"))
    assert note is not None and note[0] == logging.WARNING
    assert keeper.next(1) == Renew(2)
