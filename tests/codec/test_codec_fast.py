"""The codec's fast paths change nothing but speed.

JSON columns are the same bytes whether orjson (the `fast` extra) writes them or not, decode
to the same values, and a spec read back without `TaskSpec.__post_init__` is one that
`__post_init__` accepts, equal to what it would build.
"""

from __future__ import annotations

import builtins
import importlib
import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st

import cronoq_store.codec
from cronoq_store import jsontext
from cronoq_store.model import ById, ByKey, Dep, TaskId, TaskSpec

# What dumps_plain is for: no floats. Any str (lone surrogates, NUL, astral), ints past 64 bits.
_scalars = st.none() | st.booleans() | st.integers() | st.text()
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=20,
)


def _stdlib(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


@given(_values)
def test_dumps_plain_writes_the_standard_librarys_bytes(value: Any) -> None:
    assert jsontext.dumps_plain(value) == _stdlib(value)
    assert jsontext.dumps(value) == _stdlib(value)


def test_orjson_is_the_fast_path_when_installed() -> None:
    """The dev extra installs orjson, so the property above exercises it."""
    pytest.importorskip("orjson")
    assert jsontext.BACKEND == "orjson"


def _reload_codec() -> Any:
    """`codec` imported again, each module in the order they import each other, so that its
    JSON parts take `jsontext` as it now is."""
    for part in ("values", "building", "jsonparts", "columns", "recurring", "rows"):
        importlib.reload(sys.modules[f"cronoq_store.codec.{part}"])
    return importlib.reload(cronoq_store.codec)


@pytest.fixture
def without_orjson(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """`jsontext` and `codec` as imported where orjson is not installed."""
    real_import = builtins.__import__

    def no_orjson(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "orjson":
            raise ImportError("no orjson here")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "orjson", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_orjson)
    try:
        yield importlib.reload(jsontext)
    finally:
        monkeypatch.undo()
        importlib.reload(jsontext)
        _reload_codec()


_specs = st.builds(
    TaskSpec,
    payload=st.binary(max_size=8),
    key=st.none() | st.text(min_size=1, max_size=20),
    deps=st.lists(
        st.builds(
            Dep,
            target=st.builds(ById, id=st.integers(0, 2**63 - 1).map(TaskId))
            | st.builds(ByKey, key=st.text(min_size=1, max_size=10)),
        ),
        max_size=3,
    ).map(tuple),
    resources=st.dictionaries(st.text(max_size=8), st.integers(0, 2**40), max_size=3),
    tags=st.frozensets(st.text(max_size=8), max_size=3),
    labels=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
)


@given(_specs)
def test_spec_json_columns_are_the_standard_librarys_bytes(spec: TaskSpec) -> None:
    """Whichever library wrote them, a spec's JSON columns are the stdlib's compact form."""
    from cronoq_store import codec
    from cronoq_store.model import TimeBase

    base = TimeBase(unix_ns=0)
    row = codec.spec_columns(base, spec)
    for column in ("deps", "resources", "tags", "labels"):
        assert row[column] == _stdlib(json.loads(row[column])), column


def test_stdlib_path_without_orjson(without_orjson: Any) -> None:
    assert without_orjson.BACKEND == "json"
    assert without_orjson.dumps_plain is without_orjson.dumps
    codec = _reload_codec()
    assert codec.jsonparts.dumps_plain is without_orjson.dumps  # the stdlib's, as reloaded
    from cronoq_store.model import TimeBase

    spec = TaskSpec(
        payload=b"x",
        deps=(Dep(target=ById(id=TaskId(1))), Dep(target=ByKey(key="k\x00é"))),
        resources={"gpu": 1},
        tags=frozenset({"b", "a\ud800"}),
        labels={"z": "1", "a": "é"},
    )
    row = codec.spec_columns(TimeBase(unix_ns=0), spec)
    assert row["deps"] == '[{"id":1,"on":"success"},{"key":"k\ufffdé","on":"success"}]'
    assert row["tags"] == '["a\ufffd","b"]'
    assert row["labels"] == '{"a":"é","z":"1"}'
    decoded = codec.spec_from_columns(TimeBase(unix_ns=0), row)
    assert decoded.tags == frozenset({"a\ufffd", "b"})
    assert decoded.labels == {"a": "é", "z": "1"}


_garbage = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.text(max_size=4)
    | st.floats()
    | st.binary(max_size=4)
)
_json_garbage = _values.map(_stdlib) | st.text(max_size=12) | _garbage


@given(spec=_specs, data=st.data())
def test_spec_read_back_is_one_post_init_accepts(spec: TaskSpec, data: st.DataObject) -> None:
    """Damaged columns either decode to a spec equal to one built with every check, or are
    refused as `CorruptValue`; orjson's and the stdlib's decoders agree on each column."""
    from dataclasses import fields

    from cronoq_store import codec
    from cronoq_store.errors import CorruptValue
    from cronoq_store.model import TimeBase

    base = TimeBase(unix_ns=0)
    row = codec.spec_columns(base, spec)
    # Each column drawn gets garbage, or the same column of another valid spec: a row of
    # valid columns must decode, so most examples reach the checks after the decode.
    other = codec.spec_columns(base, data.draw(_specs))
    garbled: list[str] = []
    for column in data.draw(st.lists(st.sampled_from(codec.SPEC_COLUMNS), max_size=3)):
        if data.draw(st.booleans()):
            row[column] = other[column]
        elif column in ("deps", "resources", "tags", "labels"):
            row[column] = data.draw(_json_garbage)
            garbled.append(column)
        elif column != "payload":
            row[column] = data.draw(_garbage)
            garbled.append(column)
    try:
        decoded = codec.spec_from_columns(base, row)
    except CorruptValue:
        assert garbled, "a row of valid columns was refused"
        event("refused")
        return
    event("decoded")
    if not garbled:
        assert codec.spec_columns(base, decoded) == row  # valid columns read back as written
    rebuilt = TaskSpec(**{f.name: getattr(decoded, f.name) for f in fields(TaskSpec)})
    assert rebuilt == decoded
    assert type(decoded.resources) is dict and type(decoded.tags) is frozenset


@given(_json_garbage)
@example('{"a":1180591620717411303424}')  # 2**70: an int to the stdlib, a float to orjson
@example('[{"id":-9223372036854775809,"on":"success"}]')
@example('["a","\\ud800"]')
@example('[{"id":12345,"on":"success"},{"key":"bench-12344","on":"success"}]')  # past SHALLOW
@example("[" * 40 + "]" * 40)  # past SHALLOW, nested too deep
@example('[{"key":"' + "k" * 60 + '","on":"success"}]' + " " * 3)
def test_plain_columns_decode_alike_with_and_without_orjson(text: Any) -> None:
    """Each plain column's decoder gives the same value, or refuses, on either path."""
    from cronoq_store import codec
    from cronoq_store.errors import CorruptValue

    # The uncached tag and label decoders: a cached one would answer the second path from
    # what the first decoded.
    decoders = (
        codec.decode_deps,
        codec.jsonparts.decode_tags_uncached,
        codec.jsonparts.decode_labels_uncached,
        codec.jsonparts.decode_resources,
    )
    for fn in decoders:
        outcomes = []
        for fast in (codec.jsonparts.fast_loads, None):
            saved = codec.jsonparts.fast_loads
            codec.jsonparts.fast_loads = fast
            try:
                outcomes.append(("ok", fn(text)))
            except CorruptValue:
                outcomes.append(("corrupt", None))
            finally:
                codec.jsonparts.fast_loads = saved
        assert outcomes[0] == outcomes[1], (fn.__name__, text)


@given(st.lists(_scalars, min_size=17, max_size=17))
def test_generated_builders_make_what_the_plain_constructors_make(values: list[Any]) -> None:
    """A drain's read builds each row's column dict and item by generated functions."""
    from cronoq_store import codec
    from cronoq_store.model import InboxItem

    assert codec.spec_dict(values) == dict(zip(codec.SPEC_COLUMNS, values, strict=True))
    spec = TaskSpec(payload=b"x")
    made = codec.inbox_item(inbox_id=7, spec=spec, enqueued_unix_ns=9)
    assert made == InboxItem(inbox_id=7, spec=spec, enqueued_unix_ns=9)
    assert type(made) is InboxItem


@given(
    st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=4),
    st.booleans(),
)
def test_shared_label_and_tag_texts_decode_alike_and_labels_stay_private(
    labels: dict[str, str], long: bool
) -> None:
    """Short label and tag texts decode once (a cache): every decode equals the uncached one,
    and each task gets a labels dict of its own, so changing one changes no other task's."""
    from cronoq_store import codec

    if long:  # past the cache's bound: decoded each time
        labels = {**labels, "pad": "p" * (codec.jsonparts.SHARED_TAGS_MAX + 1)}
    text = codec.jsonparts.encode_labels(labels)
    uncached = codec.jsonparts
    stored = uncached.decode_labels_uncached(text)  # as written: the encoder cleans what it must
    first, second = codec.jsonparts.decode_labels(text), codec.jsonparts.decode_labels(text)
    assert first == second == stored
    assert type(first) is dict
    first["changed"] = "yes"
    assert codec.jsonparts.decode_labels(text) == stored
    tags = codec.jsonparts.encode_tags(frozenset(labels))
    assert (
        codec.jsonparts.decode_tags(tags)
        == codec.jsonparts.decode_tags(tags)
        == uncached.decode_tags_uncached(tags)
    )
