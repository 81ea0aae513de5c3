"""enqueue_many's arrays built for psycopg (`dialects.pgarrays`): the bytes psycopg sends, read
back by psycopg's own loaders (no database)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cronoq_store.model import INT64_MAX, INT64_MIN

psycopg = pytest.importorskip("psycopg")
from psycopg import pq  # noqa: E402
from psycopg.adapt import PyFormat, Transformer  # noqa: E402

from cronoq_store.dialects import pgarrays  # noqa: E402

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
clean_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"))
ARRAY_OIDS = {"TEXT": 1009, "VARCHAR": 1009, "SMALLINT": 1005, "BIGINT": 1016, "BYTEA": 1001}


class _Utf8:
    """What `pgarrays.binary` reads of a psycopg connection: its encoding and adapters."""

    def __init__(self, encoding: str = "utf-8") -> None:
        self.info = type("Info", (), {"encoding": encoding})()
        self.adapters = psycopg.adapters.__class__(psycopg.adapters)


def _built(cast: str, values: list[Any]) -> Any:
    return pgarrays.binary(_Utf8(), {"a": values}, {"a": cast})["a"]


def _loaded(cast: str, data: bytes) -> Any:
    return Transformer().get_loader(ARRAY_OIDS[cast], pq.Format.BINARY).load(data)


def _psycopgs(values: list[Any]) -> bytes:
    tx = Transformer()
    [dumped] = tx.dump_sequence([values], [PyFormat.BINARY])
    return bytes(dumped)


@SETTINGS
@given(
    st.lists(st.none() | clean_text, min_size=1, max_size=20),
    st.sampled_from(["TEXT", "VARCHAR"]),
)
def test_text_arrays_are_psycopgs(values: list[str | None], cast: str) -> None:
    built = _built(cast, values)
    if all(v is None for v in values):
        return  # psycopg sends a list of NULLs as text; the inbox sends such a column as NULL
    assert built.data == _psycopgs(values)
    assert _loaded(cast, built.data) == values


@SETTINGS
@given(st.lists(st.binary(max_size=40), min_size=1, max_size=20))
def test_bytea_arrays_are_psycopgs(values: list[bytes]) -> None:
    built = _built("BYTEA", values)
    assert built.data == _psycopgs(values)
    assert _loaded("BYTEA", built.data) == values


@SETTINGS
@given(st.lists(st.none() | st.integers(INT64_MIN, INT64_MAX), min_size=1, max_size=20))
def test_bigint_arrays_load_back(values: list[int | None]) -> None:
    assert _loaded("BIGINT", _built("BIGINT", values).data) == values


@SETTINGS
@given(st.lists(st.none() | st.integers(-(2**15), 2**15 - 1), min_size=1, max_size=20))
def test_smallint_arrays_load_back(values: list[int | None]) -> None:
    assert _loaded("SMALLINT", _built("SMALLINT", values).data) == values


@pytest.mark.parametrize(
    ("cast", "values"),
    [
        ("BIGINT", [1, True]),  # a bool is psycopg's to send as it sends one
        ("TEXT", ["a", b"b"]),
        ("BYTEA", [b"a", bytearray(b"b")]),
        ("BYTEA", [b"a", None]),
        ("NUMERIC", [1, 2]),  # a cast this module does not build
    ],
)
def test_anything_else_is_left_to_psycopg(cast: str, values: list[Any]) -> None:
    assert _built(cast, values) is values


def test_only_on_a_utf8_connection() -> None:
    params = {"a": ["é"], "b": None}
    assert pgarrays.binary(_Utf8("latin1"), params, {"a": "TEXT"}) == params


def test_kinds_reads_the_casts_of_binary_placeholders() -> None:
    sql = "SELECT unnest(%(a_pool)b::VARCHAR(128)[], %(a_n)b::BIGINT[], %(x)s::TEXT[])"
    assert pgarrays.kinds(sql) == {"a_pool": "VARCHAR", "a_n": "BIGINT"}
