"""The inbox rows of `cronoq-store bench`: the app's enqueue and the leader's drain beside the
raw driver, in the same run, in alternating pairs.

- `enqueue`, batch 1: `enqueue` of one spec in the app's transaction (an open `Connection`:
  begin, enqueue, commit) beside the raw driver's INSERT + COMMIT of the same row;
- `enqueue`, batch 100: `enqueue_many` of 100 specs in one transaction beside the raw driver's
  COPY (PostgreSQL) or executemany (SQLite, MariaDB) + COMMIT;
- `drain`, batch 1000: `read_inbox(1000)` and the commit of `Submitted` + `InboxTaken` for each
  item, until the inbox is empty, beside the raw driver reading the same rows, writing them as
  task rows (COPY on PostgreSQL, executemany elsewhere) and deleting them by id, per 1000.

The raw side encodes the JSON columns with the standard library inside its timed loop, as a
hand-written client would; it runs in the raw side's own database, like every raw baseline.
"""

from __future__ import annotations

__all__ = [
    "DRAIN_BATCH",
    "ENQUEUE_BATCHES",
    "INBOX_COLUMNS",
    "InboxBench",
    "inbox_figures",
    "raw_inbox_row",
]

import gc
import json
import random
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Final

from sqlalchemy import Connection, bindparam, delete, insert, select

from .. import dialects
from .. import inbox as inbox_module
from ..model import InboxTaken, Submitted, TaskId, TaskSpec, TaskStatus
from ..schema import inbox
from .runner import Bench, progress

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode

ENQUEUE_BATCHES: Final = (1, 100)
"""Specs per app transaction."""
DRAIN_BATCH: Final = 1000
"""Items per `read_inbox` and commit."""
INBOX_COLUMNS: Final = tuple(c.name for c in inbox.columns if c.name != "id")
"""The inbox's columns a row is inserted with (its id is the database's), in table order."""


def _sizes(tasks_n: int) -> tuple[int, int, int]:
    """Transactions per turn (batch 1, batch 100) and drained items per turn, from `-n`."""
    return (
        min(300, max(10, tasks_n)),
        min(30, max(2, tasks_n // 10)),
        DRAIN_BATCH * min(5, max(1, tasks_n // 10_000)),
    )


def _specs(count: int) -> list[TaskSpec]:
    """Inbox-shaped specs: a 100-byte payload, a kind, two tags and two labels."""
    rng = random.Random(7)
    return [
        TaskSpec(
            payload=rng.randbytes(100),
            kind="bench.job",
            tags=frozenset({"bench", f"t{i % 8}"}),
            labels={"team": "core", "shard": str(i % 16)},
        )
        for i in range(count)
    ]


def raw_inbox_row(spec: TaskSpec) -> tuple[Any, ...]:
    """An inbox row as a hand-written client encodes it (in `INBOX_COLUMNS` order)."""
    return (
        time.time_ns(),
        spec.pool,
        spec.kind,
        int(spec.priority),
        spec.key,
        spec.payload,
        None,
        None,
        None,
        None,
        spec.duration_hint_ns,
        spec.timeout_ns,
        None,
        "[]",
        _dumps(spec.resources) if spec.resources else "{}",
        _dumps(sorted(spec.tags)) if spec.tags else "[]",
        _dumps(spec.labels) if spec.labels else "{}",
        spec.tenant,
    )


class InboxBench:
    """The inbox figures on one target, measured by `Bench`'s store and raw driver."""

    def __init__(self, b: Bench) -> None:
        self.b = b
        self.raw = b.raw
        self.copies = dialects.dialect_of(b.engine).copies
        """The raw side loads rows with COPY where the store does (psycopg)."""
        empty = {c: None for c in INBOX_COLUMNS}
        self.insert_sql, order = self.raw.sql(insert(inbox).values(empty))
        if order != INBOX_COLUMNS:
            raise RuntimeError(f"unexpected inbox column order {order}")
        prep = b.engine.dialect.identifier_preparer
        names = ", ".join(prep.quote(c) for c in INBOX_COLUMNS)
        self.copy_inbox = f"COPY {prep.format_table(inbox)} ({names}) FROM STDIN"
        self.read_sql = str(
            select(inbox)
            .order_by(inbox.c.id)
            .limit(DRAIN_BATCH)
            .compile(dialect=self.raw.compile_dialect, compile_kwargs={"literal_binds": True})
        )
        self._delete = delete(inbox).where(inbox.c.id.in_(bindparam("ids", expanding=True)))
        self._deletes: dict[int, str] = {}

    def close(self) -> None:
        self.b.reset()
        for engine in (self.b.engine, self.b.raw_engine):
            with engine.begin() as conn:
                conn.execute(delete(inbox))

    # The app's side.

    def _store_enqueue(self, conn: Connection, txns: Sequence[Sequence[TaskSpec]]) -> None:
        for specs in txns:
            conn.begin()
            if len(specs) == 1:
                inbox_module.enqueue(conn, specs[0])
            else:
                inbox_module.enqueue_many(conn, specs)
            conn.commit()

    def _raw_enqueue(self, txns: Sequence[Sequence[TaskSpec]]) -> None:
        copy = self.copies
        for specs in txns:
            with self.raw.transaction() as cur:
                if len(specs) == 1:
                    cur.execute(self.insert_sql, raw_inbox_row(specs[0]))
                elif copy:
                    with cur.copy(self.copy_inbox) as c:
                        for spec in specs:
                            c.write_row(raw_inbox_row(spec))
                else:
                    cur.executemany(self.insert_sql, [raw_inbox_row(s) for s in specs])

    def enqueue(self, conn: Connection) -> None:
        batch1, batch100, _ = _sizes(self.b.n)
        for size, count in zip(ENQUEUE_BATCHES, (batch1, batch100), strict=True):
            specs = _specs(size)
            txns = [specs] * count
            pairs: list[tuple[float, float]] = []
            for run in range(self.b.runs):
                turns: list[tuple[str, Callable[[], Any]]] = [
                    ("store", partial(self._store_enqueue, conn, txns)),
                    ("raw", partial(self._raw_enqueue, txns)),
                ]
                if run % 2:
                    turns.reverse()
                wall = {name: _timed(fn) for name, fn in turns}
                rows = size * count
                pairs.append((rows / wall["store"], rows / wall["raw"]))
            baseline = "insert" if size == 1 else ("copy" if self.copies else "executemany")
            f = self.b.add("enqueue", size, "rows/s", pairs, baseline)
            progress(f"enqueue {size}/txn x{f.ratio:.2f} of raw {baseline}")

    # The leader's side.

    def _fill(self, conn: Connection, count: int) -> None:
        """`count` items in each side's inbox (untimed)."""
        specs = _specs(count)
        for start in range(0, count, DRAIN_BATCH):
            chunk = specs[start : start + DRAIN_BATCH]
            with conn.begin():
                inbox_module.enqueue_many(conn, chunk, notify=False)
            with self.raw.transaction() as cur:
                cur.executemany(self.insert_sql, [raw_inbox_row(s) for s in chunk])

    def _store_drain(self) -> None:
        b = self.b
        while items := b.store.read_inbox(DRAIN_BATCH, base=b.base):
            batch: list[Submitted | InboxTaken] = []
            arrival = b.work.now()
            for item in items:
                task = TaskId(b.work.next_id)
                b.work.next_id += 1
                batch.append(Submitted(id=task, seq=task, arrival=arrival, spec=item.spec))
                batch.append(InboxTaken(inbox_id=item.inbox_id))
            b.commit(batch)

    def _delete_sql(self, count: int) -> str:
        sql = self._deletes.get(count)
        if sql is None:
            compiled = self._delete.compile(dialect=self.raw.compile_dialect)
            state = compiled.construct_expanded_state({"ids": list(range(count))})
            sql = self._deletes[count] = state.statement
        return sql

    def _raw_drain(self, first_id: int) -> None:
        """Read 1000 rows, write them as queued task rows (the stored columns as they are),
        delete them by id, commit; until the inbox is empty."""
        raw = self.raw
        next_id = first_id
        queued = TaskStatus.QUEUED.value
        arrival = self.b.base.unix_ns + self.b.work.now()
        while True:
            with raw.transaction() as cur:
                cur.execute(self.read_sql)
                got = cur.fetchall()
                if not got:
                    return
                now = time.time_ns()
                rows = []
                for r in got:
                    # id, enqueued, pool, kind, priority, key, payload, ... tenant
                    rows.append(
                        (
                            next_id,
                            next_id,
                            arrival,
                            *r[2:6],
                            r[5],
                            bytes(r[6]),
                            *r[7:],
                            queued,
                            False,
                            0,
                            now,
                            None,
                            None,
                            None,
                        )
                    )
                    next_id += 1
                if self.copies:
                    with cur.copy(raw.copy_tasks) as c:
                        for row in rows:
                            c.write_row(row)
                else:
                    cur.executemany(raw.insert_tasks, rows)
                cur.execute(self._delete_sql(len(got)), [r[0] for r in got])

    def drain(self, conn: Connection) -> None:
        _, _, count = _sizes(self.b.n)
        pairs: list[tuple[float, float]] = []
        for run in range(self.b.runs):
            self.b.reset()
            self._fill(conn, count)
            first = self.b.work.next_id
            turns: list[tuple[str, Callable[[], Any]]] = [
                ("store", self._store_drain),
                ("raw", partial(self._raw_drain, first)),
            ]
            if run % 2:
                turns.reverse()
            wall = {name: _timed(fn) for name, fn in turns}
            if run == 0:
                self.b.check_same_rows(ignore=("arrival_unix_ns", "updated_unix_ns"))
            pairs.append((count / wall["store"], count / wall["raw"]))
        baseline = "copy" if self.copies else "executemany"
        f = self.b.add("drain", DRAIN_BATCH, "rows/s", pairs, baseline)
        progress(f"drain {DRAIN_BATCH} x{f.ratio:.2f} of raw {baseline}")


def _timed(fn: Callable[[], Any]) -> float:
    """Wall seconds of `fn`, after a full collection."""
    gc.collect()
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def inbox_figures(b: Bench) -> None:
    """The inbox rows: enqueue 1 and 100 in the app's transaction, drain of 1000."""
    bench = InboxBench(b)
    try:
        with b.engine.connect() as conn:
            bench.enqueue(conn)
            conn.rollback()
            for engine in (b.engine, b.raw_engine):
                with engine.begin() as c:
                    c.execute(delete(inbox))
            bench.drain(conn)
    finally:
        bench.close()
