"""The test kit's statement and COMMIT hooks (`cronoq_store.testing.statements`), which the
fault driver's stop points and the drain-crash test stand on."""

from __future__ import annotations

from builders import BASE, status, submit

from cronoq_store import SqlStore
from cronoq_store.testing.statements import after_commits, after_statements


def test_every_hook_on_an_engine_hears_every_statement(store: SqlStore) -> None:
    """Hooks set one after another on one engine all hear the store's statements, on every
    path a statement takes (a cursor, psycopg's pipeline, a libpq flight): the fault driver
    watches the leader row with one and COMMITs with another. A second hooked cursor class
    derived from the first overrode its methods by name, and on PostgreSQL the first hook
    heard nothing of a take or a commit's fence."""
    first: list[str] = []
    second: list[str] = []
    commits: list[object] = []
    after_statements(store.engine, lambda _cursor, sql: first.append(sql))
    after_commits(store.engine, commits.append)
    after_statements(store.engine, lambda _cursor, sql: second.append(sql))
    epoch = store.acquire_leadership(timeout=10)
    store.commit(epoch, BASE, [submit(1)])
    store.commit(epoch, BASE, [status(1)])
    store.release_leadership()
    leader_updates = [sql for sql in first if "UPDATE" in sql and "cronoq_leader" in sql]
    assert leader_updates, first  # the take, the fences and the release
    without_commits = [sql for sql in second if sql.strip().upper() != "COMMIT"]
    assert [sql for sql in first if sql.strip().upper() != "COMMIT"] == without_commits
    assert len(commits) >= 3  # the take's, each commit's, the release's
