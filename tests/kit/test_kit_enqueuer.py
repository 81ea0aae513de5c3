"""The kit's enqueuer is an app: a database that drops its connection mid-enqueue is a failed
transaction it logs and moves past, never the end of the process (a failover's crash is one)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import URL, Engine, text

from cronoq_store import SqlStore
from cronoq_store.testing.enqueuer import run_enqueuer


@pytest.mark.parametrize("dialect", [pytest.param("postgresql", marks=pytest.mark.postgresql)])
def test_an_enqueuer_survives_its_connections_being_cut(
    db_url: URL, engine: Engine, tmp_path: Path
) -> None:
    SqlStore.open(db_url).close()
    stop = threading.Event()
    result: list[object] = []

    def enqueue() -> None:
        try:
            result.append(
                run_enqueuer(
                    db_url.render_as_string(hide_password=False),
                    tmp_path / "acks.jsonl",
                    stop_event=stop,
                    gap=0,
                )
            )
        except BaseException as exc:
            result.append(exc)

    app = threading.Thread(target=enqueue)
    app.start()
    deadline = time.monotonic() + 3
    cut = (
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = :db AND pid <> pg_backend_pid()"
    )
    with engine.connect() as admin:
        while time.monotonic() < deadline and app.is_alive():
            admin.execute(text(cut), {"db": db_url.database})
            admin.commit()
            time.sleep(0.02)
    stop.set()
    app.join(30)
    assert not app.is_alive()
    (summary,) = result
    assert not isinstance(summary, BaseException), repr(summary)
    assert summary.failed > 0 and summary.committed > 0  # type: ignore[attr-defined]
