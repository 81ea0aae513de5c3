"""PostgreSQL multi-host URLs: the forms libpq understands work, one that can never connect is
refused at `open` (a leader would otherwise retry a configuration error as unavailable forever).
"""

from __future__ import annotations

import asyncio

import pytest
from builders import BASE
from sqlalchemy import URL

from cronoq_store import InvalidValue, SqlStore, Submitted, TaskId, TaskSpec
from cronoq_store.aio import AsyncSqlStore

FORMS = "one host= per server with its port"


@pytest.mark.parametrize(
    ("query", "why"),
    [
        ("host=127.0.0.1:5433,127.0.0.1:5434", "puts ports inside a host list"),
        ("host=db1:5432,db2", "puts ports inside a host list"),
        ("host=db1,db2,db3&port=5432,5433", "2 ports for 3 hosts"),
    ],
)
def test_a_host_list_that_can_never_connect_is_refused_at_open(query: str, why: str) -> None:
    url = f"postgresql+psycopg://app:s3cret@/app?{query}&target_session_attrs=read-write"
    with pytest.raises(InvalidValue, match=why) as caught:
        SqlStore.open(url)
    assert FORMS in str(caught.value) and "s3cret" not in str(caught.value)
    with pytest.raises(InvalidValue, match=why):
        asyncio.run(AsyncSqlStore.open(url))


@pytest.mark.parametrize("dialect", [pytest.param("postgresql", marks=pytest.mark.postgresql)])
@pytest.mark.parametrize("form", ["repeated", "lists"])
def test_the_multi_host_forms_reach_the_primary(db_url: URL, form: str) -> None:
    host, port = db_url.host or "127.0.0.1", db_url.port or 5432
    # The first host refuses connections (nothing listens on port 1): libpq goes on to the next.
    query = (
        {"host": [f"{host}:1", f"{host}:{port}"]}
        if form == "repeated"
        else {"host": f"{host},{host}", "port": f"1,{port}"}
    )
    url = db_url.set(host=None, port=None, query={**query, "target_session_attrs": "read-write"})
    with SqlStore.open(url) as store:
        epoch = store.acquire_leadership(timeout=10)
        store.commit(
            epoch, BASE, [Submitted(id=TaskId(1), seq=1, arrival=0, spec=TaskSpec(payload=b""))]
        )
        assert [t.id for t in store.recover(BASE).tasks] == [1]


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://app@db/app?autocommit=false",
        "postgresql+psycopg://app@db/app?autocommit=true",
        "mysql+pymysql://app@db/app?autocommit=0",
    ],
)
def test_a_url_that_sets_autocommit_is_refused(url: str) -> None:
    """psycopg reads `autocommit=false` from a URL as true (any non-empty text): the store's
    transactions would commit statement by statement, a fence check apart from its writes."""
    with pytest.raises(InvalidValue, match="autocommit"):
        SqlStore.open(url)
    with pytest.raises(InvalidValue, match="autocommit"):
        asyncio.run(AsyncSqlStore.open(url))
