"""Conformance kit: a workload driver that leads, and a checker of what it was promised.

`WorkloadDriver` acts as a scheduler engine would: it takes leadership, recovers, and commits
batches of realistic mutations (tasks with keys, dependencies by id and by key, recurring
schedules, tasks moving through running to succeeded or failed with outputs). After every
successful commit it appends the batch to an fsynced JSON-lines log, and only then counts its
mutations as acknowledged. Before every commit it appends an (unsynced) *intent* record, so the
checker knows every batch that may have reached the database.

`check` compares a database with such a log, after any number of failovers:

- no acknowledged mutation is lost: every acknowledged task exists, at least as far along as its
  last acknowledged transition;
- no batch is partial: each commit is visible entirely or not at all;
- replaying the visible batches in commit order (fencing epoch, then sequence) gives exactly the
  stored tasks and schedules, and nothing else is stored;
- no batch that was rejected as fenced is visible;
- the inbox: every enqueue an enqueuer saw commit became exactly one task or one drop (or
  still waits), none from a rolled-back transaction, none twice, each with its spec.

The driver drains the inbox as an engine would (`read_inbox`, then each item's `Submitted`
and `InboxTaken` in the same commit). Enqueuers (`run_enqueuer`, or a process running
`python -m cronoq_store.testing enqueue`) write into it in transactions of their own, rolling
some back on purpose, and log each outcome to the same log.

Several drivers (a leader and its standbys, in several processes) share one log: records are
appended with single `O_APPEND` writes. Task ids are epoch-prefixed (`epoch << 48`, or above
the recovered `next_id` when that is higher), so two leaders never use the same id.

Run as a process:

    python -m cronoq_store.testing drive --url URL --log PATH [--ttl S] [--batch N] [--duration S]
    python -m cronoq_store.testing check --url URL --log PATH
    python -m cronoq_store.testing enqueue --url URL --log PATH [--rollback P] [--duration S]

`drive` prints one JSON event per line on stdout (`standby`, `leading`, `ack`, `fenced`,
`leadership_lost`, `released`, ...) and a final `exit` summary; `check` prints a JSON report
and exits 1 when an invariant does not hold. Signals steer a driving process: SIGTERM or SIGINT
stops it gracefully (releasing the lease), SIGUSR1 makes it stop itself (SIGSTOP) at a point
where it holds no database connection, and SIGUSR2 arms the fault chosen with `--hang-at`.
Signals are acted on by a thread of the process's own, wherever its main thread is; SIGQUIT
makes any of its processes print every thread's stack to stderr (`DriverProcess.stop` sends
it to a process that misses its exit, and puts the stacks in its error).
"""

from __future__ import annotations

__all__ = [
    "BASE",
    "EPOCH_SHIFT",
    "AckLog",
    "CheckReport",
    "DriverConfig",
    "DriverProcess",
    "DriverProcessError",
    "DriverSummary",
    "Emit",
    "Event",
    "HangPoint",
    "Store",
    "StoredTask",
    "WorkloadDriver",
    "check",
    "digest",
    "main",
    "output_for",
    "read_log",
]

# The reference page (`::: cronoq_store.testing`) shows these in source order, so they are
# imported in the order a reader meets them: the store the kit needs, how a driver behaves, the
# log, the driver, the checker, driver processes, the command line.
# isort: off
from .base import BASE, EPOCH_SHIFT, Event, Emit, Store
from .config import HangPoint, DriverConfig
from .driver import DriverSummary
from .base import digest
from .workload import output_for
from .acklog import AckLog, read_log
from .driver import WorkloadDriver
from .checker import StoredTask, CheckReport, check
from .process import DriverProcessError, DriverProcess
from .command import main
# isort: on

# Importable from here as before, though not in `__all__`.
from .base import SECOND_NS as SECOND_NS
from .enqueuer import EnqueuerSummary as EnqueuerSummary
from .enqueuer import app_engine as app_engine
from .enqueuer import enqueuer_argv as enqueuer_argv
from .enqueuer import run_enqueuer as run_enqueuer
from .workload import Workload as Workload
