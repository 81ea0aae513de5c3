"""Prune's plan stays a range of the finished-time index when most of the table is prunable.

A first prune of a large backlog deletes most of the task table. After a batch, MariaDB's
statistics (ANALYZE TABLE here, as InnoDB recalculates them once a tenth of the table changed)
made its optimizer trade the range of `limit` finished-time entries for a scan of the whole
table, or of `(terminal, id)`, with a sort: every finished task read for each batch.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from builders import mysql_accesses
from sqlalchemy import URL, Engine

from cronoq_store import SqlStore
from cronoq_store.bench import history
from cronoq_store.repository import prune
from cronoq_store.schema import tasks

TASKS = 4000
"""Finished tasks, every one prunable."""
LIMIT = 1000


def _check_victims_plan(engine: Engine, dialect: str, cutoff: int) -> None:
    compiled = prune.prunable_stmt().compile(dialect=engine.dialect)
    params: Any = compiled.construct_params({"cutoff": cutoff, "limit": LIMIT})
    if compiled.positiontup is not None:
        params = tuple(params[name] for name in compiled.positiontup)
    sql = str(compiled)
    with engine.connect() as conn:
        if dialect == "mysql":
            doc = conn.exec_driver_sql(f"ANALYZE FORMAT=JSON {sql}", params).scalar()
            accesses = list(mysql_accesses(json.loads(doc)))
            text = json.dumps(accesses, indent=1)
            assert [a.get("key") for a in accesses] == [f"ix_{tasks.name}_finished_unix_ns"], text
            read = sum(float(a.get("r_rows") or 1) * float(a.get("r_loops") or 1) for a in accesses)
            assert read <= LIMIT, text
        else:
            steps = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}", params).all()
            lines = [str(row[-1]) for row in steps]
            assert not any(line.startswith(f"SCAN {tasks.name}") for line in lines), lines


def test_each_batch_reads_a_range_of_the_finished_time_index(db_url: URL, dialect: str) -> None:
    """MariaDB: that range and nothing else; SQLite: no scan of the table. PostgreSQL scans a
    table whose live rows are about one batch, which reads no more than the range would."""
    if dialect == "postgresql":
        pytest.skip("a sequential scan of a table of one batch is PostgreSQL's right choice")
    with SqlStore.open(db_url) as store:
        engine = store.engine
        history.fill(engine, 1, TASKS + 1, time.time_ns() - 10 * 3600 * 10**9)
        cutoff = time.time_ns() - 3600 * 10**9
        deleted = []
        while True:
            history.analyze(engine)
            _check_victims_plan(engine, dialect, cutoff)
            with engine.begin() as conn:
                deleted.append(prune.prune_batch(conn, cutoff, LIMIT))
            if deleted[-1] < LIMIT:
                break
        assert deleted == [LIMIT] * (TASKS // LIMIT) + [0]
