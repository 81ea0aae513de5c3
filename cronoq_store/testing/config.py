"""How a driver and its workload behave (`DriverConfig`), and where an armed driver hangs
(`HangPoint`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final


class HangPoint(enum.StrEnum):
    """Where an armed driver stops and waits to be killed (fault injection)."""

    IN_COMMIT = "in-commit"
    """Inside the commit's transaction, after its writes, before COMMIT (SqlStore only)."""
    AFTER_COMMIT = "after-commit"
    """After the commit returned, before the batch is logged as acknowledged."""
    AFTER_ACK = "after-ack"
    """Right after the batch was logged as acknowledged."""
    STOP_IN_RENEWAL = "stop-in-renewal"
    """SIGSTOP the whole process inside a lease renewal's transaction, right after its UPDATE
    of the leader row, before COMMIT (SqlStore only): it holds the row lock while stopped."""
    STOP_IN_COMMIT = "stop-in-commit"
    """SIGSTOP the whole process inside a commit, right after its fence UPDATE (SqlStore only)."""
    STOP_IN_TAKE = "stop-in-take"
    """SIGSTOP the whole process inside the transaction that takes the lease, right after its
    UPDATE of the leader row (SqlStore only)."""
    AFTER_TX_COMMIT = "after-tx-commit"
    """Inside a commit, right after a COMMIT returned at the driver (`testing.after_commits`),
    before whatever follows it: a further transaction of the same commit, if the store ran
    one, or the return (SqlStore only). The one point between a commit and a follow-up."""


STOPS: Final = frozenset(
    {HangPoint.STOP_IN_RENEWAL, HangPoint.STOP_IN_COMMIT, HangPoint.STOP_IN_TAKE}
)
"""The hang points that stop the process (SIGSTOP) where a statement ran."""

WATCHED: Final = STOPS | {HangPoint.AFTER_TX_COMMIT}
"""The hang points found by watching statements and COMMITs (`DriverConfig.watch_statements`)."""

SQL_ONLY: Final = frozenset(
    {
        HangPoint.IN_COMMIT,
        HangPoint.STOP_IN_RENEWAL,
        HangPoint.STOP_IN_COMMIT,
        HangPoint.STOP_IN_TAKE,
        HangPoint.AFTER_TX_COMMIT,
    }
)
"""The hang points only a SqlStore reaches (they hook its engine)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DriverConfig:
    """How a `WorkloadDriver` behaves."""

    batch: int = 20
    """Mutations per commit (at least one of them a new task)."""
    gap: float = 0.0
    """Seconds to rest between commits."""
    duration: float | None = None
    """Stop (releasing leadership) after so many seconds; None runs until stopped."""
    max_batches: int | None = None
    """Stop after so many acknowledged batches."""
    turn_batches: int | None = None
    """Release leadership after so many batches per term, rest, then contend again."""
    rest: float = 0.2
    """Seconds to wait after releasing in turn mode before contending again."""
    seed: int | None = None
    """Seed of the workload's randomness (random when None)."""
    hang_at: HangPoint | None = None
    """The fault that `arm_hang()` (SIGUSR2 for a process) arms when it names none."""
    watch_statements: bool = False
    """Watch the statements the engine's driver runs and its COMMITs (`testing.statements`),
    as the STOP_IN_* points and AFTER_TX_COMMIT need. The store's statements take the same
    path either way (the path production runs); off (the default), no statement pays for
    the hook."""
    acquire_slice: float = 0.25
    """Seconds per `acquire_leadership` call, so a standby notices a stop request."""
    key_pool: int = 16
    """Keys shared by tasks over time (a finished task's key is reused)."""
    schedules: int = 6
    """Recurring schedule names the workload upserts, advances and removes."""
    inbox: bool = True
    """Drain the inbox as an engine would: each batch makes up to `batch` waiting items into
    tasks (`Submitted` + `InboxTaken` in the same commit), dropping those whose key is live."""

    @property
    def watches_statements(self) -> bool:
        """Whether a driver watches statements: told to, or configured to stop at a STOP_IN_*."""
        return self.watch_statements or self.hang_at in WATCHED

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError("DriverConfig.batch must be at least 1")
        if self.gap < 0 or self.rest < 0 or self.acquire_slice <= 0:
            raise ValueError("DriverConfig: gap and rest >= 0, acquire_slice > 0")
