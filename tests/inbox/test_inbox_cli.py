"""The inbox's commands on every dialect: enqueue, inbox, and the inbox line of status."""

from __future__ import annotations

import json

from sqlalchemy import URL, Engine, update
from test_cli import cli_url, one_error, run

from cronoq_store import Priority, SqlStore
from cronoq_store.schema import inbox


def test_enqueue_inbox_and_status(db_url: URL, store: SqlStore, engine: Engine) -> None:
    url = cli_url(db_url)
    first = int(run(url, "enqueue", "hello", "--key", "k1", "--pool", "mail").stdout)
    second = int(
        run(
            url,
            "enqueue",
            "--payload-file",
            "-",
            "--kind",
            "email",
            "--priority",
            "high",
            "--tenant",
            "acme",
            "--tag",
            "a",
            "--tag",
            "b",
            "--label",
            "team=x",
            "--label",
            "empty=",
            input="from stdin",
        ).stdout
    )
    assert second > first
    items = store.read_inbox()
    assert [i.inbox_id for i in items] == [first, second]
    assert items[0].spec.payload == b"hello" and items[0].spec.key == "k1"
    assert items[0].spec.pool == "mail"
    spec = items[1].spec
    assert spec.payload == b"from stdin" and spec.kind == "email"
    assert spec.priority is Priority.HIGH and spec.tenant == "acme"
    assert spec.tags == frozenset({"a", "b"}) and spec.labels == {"team": "x", "empty": ""}

    with engine.begin() as conn:  # damage the first one: the leader sets it aside
        conn.execute(update(inbox).where(inbox.c.id == first).values(retry="[oops"))
    assert [i.inbox_id for i in store.read_inbox()] == [second]

    data = json.loads(run(url, "inbox", "--json").stdout)
    assert [i["inbox_id"] for i in data["inbox"]] == [second]
    assert data["inbox"][0]["payload_size"] == len(b"from stdin")
    assert [r["inbox_id"] for r in data["rejects"]] == [first]
    assert "retry" in data["rejects"][0]["reason"]
    assert data["items"] == 1 and data["set_aside"] == 1 and data["oldest_age_s"] >= 0
    out = run(url, "inbox").stdout
    assert "1 waiting" in out and "1 set aside" in out and str(second) in out

    status = json.loads(run(url, "status", "--json").stdout)["inbox"]
    assert status["items"] == 1 and status["set_aside"] == 1
    assert status["oldest_age_s"] is not None
    assert "inbox      1 waiting, oldest" in run(url, "status").stdout


def test_enqueue_refuses_bad_input(db_url: URL, store: SqlStore) -> None:
    url = cli_url(db_url)
    assert "PAYLOAD or --payload-file" in run(url, "enqueue", code=2).stderr
    assert "NAME=VALUE" in run(url, "enqueue", "x", "--label", "novalue", code=2).stderr
    assert "pool" in run(url, "enqueue", "x", "--pool", "p" * 500, code=2).stderr
    assert store.read_inbox() == []


def test_enqueue_on_a_missing_sqlite_file(tmp_path: object) -> None:
    error = one_error(run(f"{tmp_path}/none.db", "enqueue", "x", code=1))
    assert "upgrade` creates one" in error
