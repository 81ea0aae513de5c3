"""Damaged rows never stop recovery: whatever a stored value holds (JSON nested 1,000 deep, too
much of it, text in an integer column, a status and terminal flag that disagree), its task is
quarantined (marked failed with the reason, key released), a schedule skipped and logged, and
recovery returns everything else. On every dialect the damage can occur on."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest
from builders import BASE, submit
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import text, update

import cronoq_store as cq
from cronoq_store import codec
from cronoq_store.codec import jsonparts
from cronoq_store.errors import CorruptValue
from cronoq_store.schema import recurring, tasks

DEEP_OPEN = "[" * 2000  # 2 KB of '[': what the fault campaign stored
DEEP_VALID = "[" * 1000 + "]" * 1000  # valid JSON, 1,000 levels deep
JSON_COLUMNS = ("retry", "deps", "resources", "tags", "labels")


def damage(store: cq.SqlStore, task_id: int, **values: Any) -> None:
    with store.engine.begin() as conn:
        conn.execute(update(tasks).where(tasks.c.id == task_id).values(**values))


def raw(store: cq.SqlStore, sql: str, **params: Any) -> None:
    with store.engine.begin() as conn:
        conn.execute(text(sql), params)


def schedule(name: str) -> cq.RecurringUpsert:
    return cq.RecurringUpsert(
        spec=cq.RecurringSpec(name=name, template=cq.TaskSpec(payload=b"t"), interval_ns=10**9)
    )


def assert_quarantined(
    store: cq.SqlStore, epoch: int, ids: dict[int, str], healthy: list[int]
) -> None:
    """Recovery returns `healthy` as live, each of `ids` (id -> key) as failed, and frees the
    keys; a second recovery finds nothing new to quarantine."""
    rec = store.recover(BASE)
    assert [t.id for t in rec.tasks] == healthy
    failed = {t.id: t for t in rec.terminal if t.id in ids}
    assert set(failed) == set(ids)
    for task_id, key in ids.items():
        assert failed[task_id].status is cq.TaskStatus.FAILED
        assert failed[task_id].key == key
        row = store.get_task(cq.ById(id=cq.TaskId(task_id)))
        assert row is not None and row.status is cq.TaskStatus.FAILED
        assert row.message is not None and row.message.startswith("corrupt task row")
    # Every key is free for a new live task.
    fresh = 1000
    store.commit(epoch, BASE, [submit(fresh + i, key=key) for i, key in enumerate(ids.values(), 1)])
    again = store.recover(BASE)
    assert [t.id for t in again.tasks] == healthy + [fresh + i for i in range(1, len(ids) + 1)]
    assert {t.id: t.status for t in again.terminal if t.id in ids} == dict.fromkeys(
        ids, cq.TaskStatus.FAILED
    )


def test_deep_json_in_any_column_is_quarantined(
    store: cq.SqlStore, caplog: pytest.LogCaptureFixture
) -> None:
    epoch = store.acquire_leadership()
    store.commit(
        epoch,
        BASE,
        [submit(i, key=f"k{i}") for i in range(1, 2 * len(JSON_COLUMNS) + 2)]
        + [schedule("fine"), schedule("deep"), schedule("open")],
    )
    bad: dict[int, str] = {}
    for n, column in enumerate(JSON_COLUMNS):
        for i, value in ((2 * n + 1, DEEP_OPEN), (2 * n + 2, DEEP_VALID)):
            damage(store, i, **{column: value})
            bad[i] = f"k{i}"
    with store.engine.begin() as conn:
        conn.execute(update(recurring).where(recurring.c.name == "deep").values(spec=DEEP_VALID))
        conn.execute(update(recurring).where(recurring.c.name == "open").values(spec=DEEP_OPEN))

    with caplog.at_level(logging.ERROR, logger="cronoq_store"):
        rec = store.recover(BASE)
    assert [r.spec.name for r in rec.recurring] == ["fine"]
    assert "skipping undecodable recurring schedule 'deep'" in caplog.text
    assert "skipping undecodable recurring schedule 'open'" in caplog.text
    deep = store.get_task(cq.ById(id=cq.TaskId(2)))
    assert deep is not None and deep.message is not None and "nested deeper" in deep.message
    assert_quarantined(store, epoch, bad, healthy=[2 * len(JSON_COLUMNS) + 1])
    # Skipped schedules stay in place, so an operator can repair them.
    with store.engine.connect() as conn:
        assert conn.execute(recurring.select().where(recurring.c.name == "deep")).one()


def test_oversized_json_is_quarantined(store: cq.SqlStore, monkeypatch: pytest.MonkeyPatch) -> None:
    epoch = store.acquire_leadership()
    store.commit(epoch, BASE, [submit(1, key="big"), submit(2)])
    damage(store, 1, labels=json.dumps({"k": "v" * 300}))
    monkeypatch.setattr(codec.jsonparts, "JSON_MAX_CHARS", 200)
    assert_quarantined(store, epoch, {1: "big"}, healthy=[2])
    row = store.get_task(cq.ById(id=cq.TaskId(1)))
    assert row is not None and row.message is not None and "at most 200" in row.message


def test_oversized_json_is_refused_at_commit(
    store: cq.SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    epoch = store.acquire_leadership()
    monkeypatch.setattr(codec.jsonparts, "JSON_MAX_CHARS", 200)
    spec = cq.TaskSpec(payload=b"", labels={"k": "v" * 300})
    with pytest.raises(cq.InvalidValue, match=r"TaskSpec\.labels"):
        store.commit(epoch, BASE, [cq.Submitted(id=cq.TaskId(1), seq=1, arrival=0, spec=spec)])
    assert store.get_task(cq.ById(id=cq.TaskId(1))) is None


@pytest.mark.sqlite
@pytest.mark.parametrize("dialect", ["sqlite"], indirect=True)
def test_text_in_integer_columns_is_quarantined(store: cq.SqlStore) -> None:
    epoch = store.acquire_leadership()
    store.commit(
        epoch,
        BASE,
        [submit(i, key=f"k{i}") for i in range(1, 7)] + [schedule("fine"), schedule("bad")],
    )
    damage(store, 1, arrival_unix_ns="abc")
    damage(store, 2, attempt="x")
    damage(store, 3, seq="y")
    damage(store, 4, duration_hint_ns="z")
    raw(store, "UPDATE cronoq_tasks SET terminal = 'yes' WHERE id = 5")
    raw(store, "UPDATE cronoq_recurring SET next_unix_ns = 'w' WHERE name = 'bad'")
    # A finished row too: text sorts above every integer, so it counts as recent.
    store.commit(epoch, BASE, [submit(7, key="k7")])
    store.commit(
        epoch,
        BASE,
        [
            cq.StatusChanged(
                id=cq.TaskId(7), status=cq.TaskStatus.FAILED, attempt=1, at=0, message=None
            )
        ],
    )
    raw(
        store,
        "UPDATE cronoq_tasks SET updated_unix_ns = 'v', finished_unix_ns = 'v', live_key = key "
        "WHERE id = 7",
    )
    rec = store.recover(BASE)
    assert [r.spec.name for r in rec.recurring] == ["fine"]
    assert_quarantined(store, epoch, {i: f"k{i}" for i in (1, 2, 3, 4, 5, 7)}, healthy=[6])


@pytest.mark.sqlite
@pytest.mark.parametrize("dialect", ["sqlite"], indirect=True)
def test_a_payload_that_is_not_a_blob_is_quarantined(store: cq.SqlStore) -> None:
    """SQLite keeps any type in the payload column: an integer must not decode as that many
    zero bytes, nor text as its encoding; both rows are set aside, their neighbour is not."""
    epoch = store.acquire_leadership()
    store.commit(epoch, BASE, [submit(i, key=f"k{i}") for i in range(1, 4)])
    raw(store, "UPDATE cronoq_tasks SET payload = 5 WHERE id = 1")
    raw(store, "UPDATE cronoq_tasks SET payload = 'text' WHERE id = 2")
    assert_quarantined(store, epoch, {1: "k1", 2: "k2"}, healthy=[3])


@pytest.mark.parametrize("flag", [0.0, 1.0, "0", None, 0, False, True])
def test_a_live_row_decodes_only_with_an_integer_flag_of_zero(flag: object) -> None:
    """A live row's flag must be 0 as an int (or PostgreSQL's False): 0.0 equals 0 and hashes
    alike, but no store writes it (SQLite's numeric affinity would have made it 0)."""
    spec = cq.TaskSpec(payload=b"p", key="k")
    columns = codec.spec_columns(BASE, spec)
    row = (1, 1, 0, 0, "queued", flag, *(columns[name] for name in codec.SPEC_COLUMNS))
    if type(flag) in (int, bool) and not flag:
        assert codec.live_task_from_row(BASE, row).spec == spec
    else:
        with pytest.raises(CorruptValue):
            codec.live_task_from_row(BASE, row)


@pytest.mark.sqlite
@pytest.mark.parametrize("dialect", ["sqlite"], indirect=True)
def test_an_output_that_is_not_a_blob_is_refused(store: cq.SqlStore) -> None:
    """Reading an output stored as an integer raises `CorruptValue`, never five zero bytes."""
    epoch = store.acquire_leadership()
    store.commit(epoch, BASE, [submit(1)])
    done = cq.StatusChanged(
        id=cq.TaskId(1), status=cq.TaskStatus.SUCCEEDED, attempt=1, at=0, message=None
    )
    store.commit(epoch, BASE, [done], [(cq.TaskId(1), b"out")])
    assert store.load_output(cq.TaskId(1)) == b"out"
    raw(store, "UPDATE cronoq_tasks SET output = 5 WHERE id = 1")
    with pytest.raises(CorruptValue, match="output"):
        store.load_output(cq.TaskId(1))
    with pytest.raises(CorruptValue, match="output"):
        store.get_task(cq.ById(id=cq.TaskId(1)))


def test_status_and_flag_out_of_range_are_quarantined(store: cq.SqlStore, dialect: str) -> None:
    epoch = store.acquire_leadership()
    now = time.time_ns()
    store.commit(
        epoch,
        BASE,
        [submit(i, key=f"k{i}") for i in range(1, 9)]
        + [
            cq.StatusChanged(
                id=cq.TaskId(8), status=cq.TaskStatus.SUCCEEDED, attempt=1, at=0, message=None
            )
        ],
    )
    bad = {i: f"k{i}" for i in range(2, 6)}
    damage(store, 2, status="bogus")
    damage(store, 3, status="")
    damage(store, 4, status="succeeded")  # with terminal false
    damage(  # finished recently, by its times
        store, 5, status="running", terminal=True, updated_unix_ns=now, finished_unix_ns=now
    )
    if dialect != "postgresql":  # a PostgreSQL boolean holds nothing else
        raw(store, "UPDATE cronoq_tasks SET terminal = 2 WHERE id = 1")
        raw(store, "UPDATE cronoq_tasks SET terminal = -1 WHERE id = 6")
        bad |= {1: "k1", 6: "k6"}
    healthy = [i for i in range(1, 8) if i not in bad]
    assert_quarantined(store, epoch, bad, healthy=healthy)
    done = store.get_task(cq.ById(id=cq.TaskId(8)))
    assert done is not None and done.status is cq.TaskStatus.SUCCEEDED  # left alone


# The bounded decoder itself.


@given(st.integers(min_value=1, max_value=5000))
def test_any_nesting_decodes_or_is_corrupt(depth: int) -> None:
    """Valid JSON up to the depth bound decodes; deeper, or unterminated, is CorruptValue
    (never a RecursionError), however deep."""
    arrays = "[" * depth + "]" * depth
    objects = '{"a":' * depth + "1" + "}" * depth
    for valid in (arrays, objects):
        if depth <= jsonparts.JSON_MAX_DEPTH:
            codec.jsonparts.loads("labels", valid)
        else:
            with pytest.raises(CorruptValue, match="nested deeper"):
                codec.jsonparts.loads("labels", valid)
    with pytest.raises(CorruptValue):
        codec.jsonparts.loads("labels", "[" * depth)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab'),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(alphabet='[]{}"\\ab'), inner, max_size=3)
    ),
    max_leaves=40,
)


def _depth(obj: object) -> int:
    if isinstance(obj, list):
        return 1 + max(map(_depth, obj), default=0)
    if isinstance(obj, dict):
        return 1 + max(map(_depth, obj.values()), default=0)
    return 0


@given(_json)
def test_json_depth_ignores_brackets_in_strings(obj: object) -> None:
    assert jsonparts.json_depth(json.dumps(obj)) == _depth(obj)
    assert jsonparts.json_depth(
        json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    ) == _depth(obj)


def test_brackets_inside_strings_are_not_nesting() -> None:
    labels = {"k": "[" * 5000, "{" * 100: "]"}
    assert jsonparts.decode_labels(jsonparts.encode_labels(labels)) == labels


@given(_json)
def test_json_short_enough_to_skip_measuring_is_never_too_deep(obj: object) -> None:
    """The decoders take JSON text of at most `_SHALLOW` characters without measuring it:
    no such text may nest deeper than the bound, however it is written."""
    for written in (json.dumps(obj), json.dumps(obj, separators=(",", ":"))):
        if len(written) <= codec.jsonparts.SHALLOW:
            assert jsonparts.json_depth(written) <= jsonparts.JSON_MAX_DEPTH
    too_deep = "[" * (jsonparts.JSON_MAX_DEPTH + 1) + "]" * (jsonparts.JSON_MAX_DEPTH + 1)
    assert len(too_deep) > codec.jsonparts.SHALLOW
