"""CPU per job for `bench_peers.py`: the client process's, and the database's server backends'.

The server runs on this machine, so its backends' CPU is read from /proc/PID/stat (utime +
stime), the backends found in `pg_stat_activity` by database, before and after a timed part.
Plain Python and psycopg only: the peers' interpreter runs this file too (procrastinate).
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg

Figures = dict[str, dict[str, float]]
"""Per part ("single", "batch"): "rate" (jobs/s), "client_us" and "server_us" (CPU per job)."""

TICK = 1 / os.sysconf("SC_CLK_TCK")


def server_cpu(dsn: str) -> float:
    """CPU seconds used so far by the database's backends (all but the one asking)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        pids = [
            row[0]
            for row in conn.execute(
                "SELECT pid FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        ]
    used = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        used += (int(fields[11]) + int(fields[12])) * TICK
    return used


class Part:
    """One timed part of `jobs` jobs: jobs/s, the client's and the server's CPU per job (µs)."""

    def __init__(self, dsn: str, jobs: int) -> None:
        self.dsn, self.jobs = dsn, jobs
        self.figures: dict[str, float] = {}

    def __enter__(self) -> Part:
        self._server = server_cpu(self.dsn)
        self._client = time.process_time()
        self._wall = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        wall = time.perf_counter() - self._wall
        client = time.process_time() - self._client
        server = server_cpu(self.dsn) - self._server
        self.figures = {
            "rate": self.jobs / wall,
            "client_us": client / self.jobs * 1e6,
            "server_us": server / self.jobs * 1e6,
        }


def figures(single: Part, batch: Part) -> Figures:
    """A system's figures: one job per transaction, and 1,000 per call."""
    return {"single": single.figures, "batch": batch.figures}
