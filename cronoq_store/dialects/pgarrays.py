"""Arrays in PostgreSQL's binary format, built for sync psycopg (`enqueue_many`'s columns:
`PostgresqlImpl.built_arrays`).

psycopg dumps a list element by element, a Python dumper call apiece (0.16 µs each: 0.7 µs
a row for the four columns a usual spec fills, a quarter of a 1000-row enqueue_many's client
CPU). Here a column's distinct values are encoded once each and the array joined in C: the
bytes psycopg's binary list dumper sends (`array_recv`'s format: a header, then each element's
length, -1 for NULL, and its bytes), held by a `Built` that a dumper registered on the
connection sends as it is, with the array's type.

Only where nothing observes the connection's statements (`cursor.pipelines`): an observer
sees the lists, as before. Only on a UTF-8 connection (psycopg's text encoding there).
"""

from __future__ import annotations

import re
import struct
import weakref
from collections.abc import Callable, Mapping
from itertools import chain
from typing import Any, Final

from psycopg import pq
from psycopg.adapt import Dumper

_HEADER: Final = struct.Struct(">iiiii")  # ndim, has NULLs, element type, length, lower bound
_LENGTH: Final = struct.Struct(">i")
_NULL: Final = _LENGTH.pack(-1)
_INT2: Final = struct.Struct(">ih")
_INT8: Final = struct.Struct(">iq")
_NONE: Final = type(None)


class Built:
    """An array in PostgreSQL's binary format (`data`), which its dumper sends as it is:
    held, not a `bytes` subclass, so that megabytes of payloads are not copied once more."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


class _Text(Built):
    """A text[]."""


class _Int2(Built):
    """An int2[]."""


class _Int8(Built):
    """An int8[]."""


class _Bytea(Built):
    """A bytea[]."""


def _dumper(oid: int) -> type[Dumper]:
    class _Sent(Dumper):
        format = pq.Format.BINARY

        def dump(self, obj: Any) -> Any:
            return obj.data

    _Sent.oid = oid
    return _Sent


_DUMPERS: Final = (
    (_Text, _dumper(1009)),
    (_Int2, _dumper(1005)),
    (_Int8, _dumper(1016)),
    (_Bytea, _dumper(1001)),
)
_READY: weakref.WeakSet[Any] = weakref.WeakSet()
"""psycopg connections these dumpers are registered on."""


def _text(value: str) -> bytes:
    data = value.encode()
    return _LENGTH.pack(len(data)) + data


def _int2(value: int) -> bytes:
    return _INT2.pack(2, value)


def _int8(value: int) -> bytes:
    return _INT8.pack(8, value)


_KINDS: Final[dict[str, tuple[type[Built], int, Callable[[Any], bytes], type]]] = {
    # The SQL's cast after a placeholder: the array's class, element oid, element encoder,
    # and the one Python type its values may have (anything else is psycopg's to dump).
    "VARCHAR": (_Text, 25, _text, str),
    "TEXT": (_Text, 25, _text, str),
    "SMALLINT": (_Int2, 21, _int2, int),
    "BIGINT": (_Int8, 20, _int8, int),
}
_CAST: Final = re.compile(r"%\((\w+)\)b::(\w+)")


def kinds(sql: str) -> dict[str, str]:
    """The casts of `sql`'s binary placeholders (`%(name)b::TYPE`), by parameter name."""
    return {name: cast.upper() for name, cast in _CAST.findall(sql)}


def binary(driver: Any, params: Mapping[str, Any], casts: Mapping[str, str]) -> dict[str, Any]:
    """`params` with each list whose placeholder is cast to a type this module builds (`casts`,
    from `kinds`) replaced by its binary array; anything else left for psycopg to dump, as
    is everything on a connection whose encoding is not UTF-8."""
    if driver.info.encoding != "utf-8":
        return dict(params)
    if driver not in _READY:
        for cls, dumper in _DUMPERS:
            driver.adapters.register_dumper(cls, dumper)
        _READY.add(driver)
    out = dict(params)
    for name, values in params.items():
        cast = casts.get(name)
        if type(values) is not list or not values or cast is None:
            continue
        if cast == "BYTEA":
            out[name] = _blobs(values)
        elif cast in _KINDS:
            out[name] = _array(values, *_KINDS[cast])
    return out


def _array(
    values: list[Any], cls: type[Built], oid: int, encode: Callable[[Any], bytes], kind: type
) -> Any:
    """`values` (of type `kind`, or None) as a binary array of element type `oid`; the list
    itself where a value is of another type."""
    types = set(map(type, values))  # of each value: 1 and True are one in a set
    if types - {kind, _NONE}:
        return values  # a bool, an enum, a subclass: psycopg decides, as it did
    distinct = set(values)
    nulls = None in distinct
    distinct.discard(None)
    table = {v: encode(v) for v in distinct}
    if nulls:
        table[None] = _NULL
    header = _HEADER.pack(1, nulls, oid, len(values), 1)
    return cls(b"".join(chain((header,), map(table.__getitem__, values))))


def _blobs(values: list[Any]) -> Any:
    """`values` (bytes) as a binary bytea array, each payload copied once; the list itself
    where a value is not bytes (payloads are not hashed: they may be megabytes)."""
    if set(map(type, values)) != {bytes}:
        return values
    lengths = {n: _LENGTH.pack(n) for n in set(map(len, values))}
    parts = chain.from_iterable(
        zip(map(lengths.__getitem__, map(len, values)), values, strict=True)
    )
    header = _HEADER.pack(1, 0, 17, len(values), 1)
    return _Bytea(b"".join(chain((header,), parts)))
