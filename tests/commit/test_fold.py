"""Property tests of the batch fold (`repository.folding`), without a database.

The fold decides what a commit writes: which tasks are inserted (with the status they reached
within the batch), which stored tasks are updated, and which dependency rows are written. Its
promise is that splitting a batch changes no row. `write` below applies a `Folded` to plain
dicts as SPEC.md says `commit.write` applies it to the tables (updates of stored tasks first,
then the inserts of new ones, a replayed insert ignored), so that promise, and the rule that
only live tasks hold dependency rows, are checked here on the fold alone;
tests/store/test_store_properties.py checks them on every dialect, through the store.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import cronoq_store as cq
from cronoq_store import codec
from cronoq_store.errors import CorruptValue, InvalidValue
from cronoq_store.model import INT64_MAX
from cronoq_store.repository import folding

BASE = cq.TimeBase(unix_ns=1_700_000_000 * 10**9)
NOW = BASE.unix_ns + 10**12
"""The commit's wall clock (Unix ns): every fold of one test uses the same."""
IDS = (1, 2, 3, 4)

Tasks = dict[int, dict[str, Any]]
DepRows = dict[int, list[dict[str, Any]]]


def write(tasks: Tasks, deps: DepRows, folded: folding.Folded) -> None:
    """Apply `folded` to `tasks` and `deps` (task rows and dependency rows by task id)."""
    for task_id, change in folded.updates.items():
        row = tasks.get(task_id)
        if row is None:
            continue  # not stored (yet): the transition changes nothing
        terminal = change.status.is_terminal
        revived = row["terminal"] and not terminal
        if revived and (rows := folding.dep_rows(task_id, codec.decode_deps(row["deps"]))):
            deps[task_id] = rows  # its dependency rows return
        row.update(
            status=change.status.value,
            terminal=terminal,
            attempt=change.attempt,
            updated_unix_ns=change.at,
            finished_unix_ns=change.at if terminal else None,
            live_key=None if terminal else row["key"],
        )
        if change.message is not None:
            row["message"] = change.message
        if terminal:
            deps.pop(task_id, None)
    for task_id, new in folded.inserts.items():
        if task_id in tasks:
            continue  # stored already: a replay, ignored with what was folded into it
        tasks[task_id] = dict(new)
        if not new["terminal"] and folded.deps.get(task_id):
            deps[task_id] = list(folded.deps[task_id])


def committed(batches: Sequence[Sequence[cq.Mutation]]) -> tuple[Tasks, DepRows]:
    """The rows after committing `batches` in order, each folded on its own."""
    tasks: Tasks = {}
    deps: DepRows = {}
    for batch in batches:
        write(tasks, deps, folding.fold(BASE, NOW, batch))
    return tasks, deps


statuses = st.sampled_from(cq.TaskStatus)
messages = st.none() | st.sampled_from(["", "boom", "nul\x00byte", "ünï"])
deps_of = st.lists(
    st.builds(
        cq.Dep,
        target=st.builds(cq.ById, id=st.sampled_from(IDS).map(cq.TaskId))
        | st.builds(cq.ByKey, key=st.sampled_from(["a", "b\x00"])),
        on=st.sampled_from(["success", "finish"]),
    ),
    max_size=3,
).map(tuple)


def transitions(task_id: int) -> st.SearchStrategy[cq.StatusChanged]:
    return st.builds(
        cq.StatusChanged,
        id=st.just(cq.TaskId(task_id)),
        status=statuses,
        attempt=st.integers(0, 3),
        at=st.integers(0, 10**6),
        message=messages,
    )


@st.composite
def streams(draw: st.DrawFn, *, early: bool = True) -> list[cq.Mutation]:
    """Mutations as an engine sends them: each task submitted once, and transitions of any
    task in any order (after it finished, of a task never submitted, and unless not `early`,
    before its submission)."""
    submitted = draw(st.lists(st.sampled_from(IDS), unique=True))
    out: list[cq.Mutation] = [
        cq.Submitted(
            id=cq.TaskId(i),
            seq=n,
            arrival=draw(st.integers(0, 10**6)),
            spec=cq.TaskSpec(
                payload=b"p",
                key=draw(st.none() | st.sampled_from(["a", "b\x00"])),
                deps=draw(deps_of),
            ),
        )
        for n, i in enumerate(submitted)
    ]
    for change in draw(st.lists(st.sampled_from(IDS).flatmap(transitions), max_size=12)):
        at = [n for n, m in enumerate(out) if isinstance(m, cq.Submitted) and m.id == change.id]
        lowest = 0 if early or not at else at[0] + 1
        out.insert(draw(st.integers(lowest, len(out))), change)
    return out


@st.composite
def cuts(draw: st.DrawFn, stream: list[cq.Mutation]) -> list[list[cq.Mutation]]:
    """`stream` cut into consecutive batches (some may be empty)."""
    points = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=4)))
    bounds = [0, *points, len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(bounds)]


@given(st.data())
def test_folding_a_batch_equals_folding_its_halves_in_order(data: st.DataObject) -> None:
    stream = data.draw(streams(), label="stream")
    cut = data.draw(st.integers(0, len(stream)), label="cut")
    assert committed([stream[:cut], stream[cut:]]) == committed([stream])


@given(st.data())
def test_any_split_of_a_stream_leaves_the_same_rows(data: st.DataObject) -> None:
    stream = data.draw(streams(), label="stream")
    batches = data.draw(cuts(stream), label="batches")
    assert committed(batches) == committed([stream])


@given(st.data())
def test_a_replayed_batch_changes_nothing(data: st.DataObject) -> None:
    """Committed again right after itself (its commit's fate was unknown), a batch changes no
    row. Not so for a batch that names a task before submitting it (`early`): replayed, that
    transition finds the task stored, as any later batch would."""
    stream = data.draw(streams(early=False), label="stream")
    batches = data.draw(cuts(stream), label="batches")
    replayed = data.draw(st.integers(0, len(batches) - 1), label="replayed")
    again = [*batches[: replayed + 1], batches[replayed], *batches[replayed + 1 :]]
    assert committed(again) == committed(batches)


@given(streams())
def test_only_live_tasks_hold_dependency_rows(stream: list[cq.Mutation]) -> None:
    """A task inserted and finished in one batch has none; a live one has its spec's, in order."""
    tasks, deps = committed([stream])
    for task_id, row in tasks.items():
        spec_deps = codec.decode_deps(row["deps"])
        if row["terminal"] or not spec_deps:
            assert task_id not in deps
        else:
            assert deps[task_id] == folding.dep_rows(task_id, spec_deps)


@given(streams())
def test_a_transition_folds_into_the_insert_only_after_the_submission(
    stream: list[cq.Mutation],
) -> None:
    folded = folding.fold(BASE, NOW, stream)
    first: dict[int, int] = {}
    for n, m in enumerate(stream):
        if isinstance(m, cq.Submitted):
            first.setdefault(m.id, n)
    assert set(folded.inserts) == set(first)
    early = {
        m.id
        for n, m in enumerate(stream)
        if isinstance(m, cq.StatusChanged) and n < first.get(m.id, len(stream))
    }
    assert set(folded.updates) == early
    for task_id, row in folded.inserts.items():
        after = [
            m
            for m in stream[first[task_id] :]
            if isinstance(m, cq.StatusChanged) and m.id == task_id
        ]
        status = after[-1].status if after else cq.TaskStatus.QUEUED
        assert row["status"] == status.value
        assert row["terminal"] is status.is_terminal
        assert row["live_key"] == (None if status.is_terminal else row["key"])
        said = [m.message for m in after if m.message is not None]
        assert row["message"] == (codec.clean(said[-1]) if said else None)


def test_a_second_submission_of_a_task_in_one_batch_is_ignored() -> None:
    spec = cq.TaskSpec(payload=b"x")
    folded = folding.fold(
        BASE,
        NOW,
        [
            cq.Submitted(id=cq.TaskId(1), seq=7, arrival=0, spec=spec),
            cq.Submitted(id=cq.TaskId(1), seq=8, arrival=5, spec=cq.TaskSpec(payload=b"y")),
        ],
    )
    assert folded.inserts[1]["seq"] == 7
    assert folded.inserts[1]["payload"] == b"x"


def test_the_fold_refuses_a_time_it_cannot_store() -> None:
    late = cq.StatusChanged(id=cq.TaskId(1), status=cq.TaskStatus.RUNNING, attempt=1, at=INT64_MAX)
    with pytest.raises(InvalidValue, match=r"^StatusChanged\.at "):
        folding.fold(BASE, NOW, [late])
    early = cq.Submitted(id=cq.TaskId(1), seq=1, arrival=INT64_MAX, spec=cq.TaskSpec(payload=b""))
    with pytest.raises(InvalidValue, match=r"^Submitted\.arrival "):
        folding.fold(BASE, NOW, [early])


def test_a_fold_holds_what_the_batch_says() -> None:
    """The rows themselves, not only that two folds agree: a second submission of a task
    changes nothing and stops nothing; a transition of a task submitted earlier in the batch
    is in its insert; any other is an update of the stored task; times under the base."""
    base = cq.TimeBase(unix_ns=1000)
    batch: list[cq.Mutation] = [
        cq.Submitted(
            id=cq.TaskId(1), seq=1, arrival=5, spec=cq.TaskSpec(payload=b"a", deadline=50)
        ),
        cq.Submitted(id=cq.TaskId(1), seq=9, arrival=6, spec=cq.TaskSpec(payload=b"b")),
        cq.Submitted(id=cq.TaskId(2), seq=2, arrival=6, spec=cq.TaskSpec(payload=b"c")),
        cq.StatusChanged(
            id=cq.TaskId(2), status=cq.TaskStatus.RUNNING, attempt=3, at=7, message="m"
        ),
        cq.StatusChanged(
            id=cq.TaskId(9), status=cq.TaskStatus.FAILED, attempt=2, at=8, message=None
        ),
        cq.RecurringRemove(name="s"),
        cq.InboxTaken(inbox_id=5),
        cq.InboxTaken(inbox_id=5),
    ]
    folded = folding.fold(base, 42, batch)
    assert folded.recurring == [cq.RecurringRemove(name="s")]  # written in batch order
    assert list(folded.inbox_taken) == [5]
    one, two = folded.inserts[1], folded.inserts[2]
    assert (one["id"], one["seq"], one["payload"]) == (1, 1, b"a")
    assert (one["arrival_unix_ns"], one["deadline_unix_ns"], one["updated_unix_ns"]) == (
        1005,
        1050,
        42,
    )
    assert one["finished_unix_ns"] is None and one["message"] is None
    assert (one["status"], one["terminal"], one["attempt"], one["live_key"]) == (
        "queued",
        False,
        0,
        None,
    )
    assert (two["id"], two["status"], two["attempt"], two["message"]) == (2, "running", 3, "m")
    assert (two["arrival_unix_ns"], two["updated_unix_ns"]) == (1006, 1007)
    assert folded.updates == {
        9: folding.FoldedStatus(status=cq.TaskStatus.FAILED, attempt=2, at=1008, message=None)
    }


@given(
    st.lists(
        st.tuples(
            st.integers(-(2**63), 2**63 - 1).map(cq.TaskId),
            st.binary(max_size=4) | st.binary(max_size=4).map(bytearray),
        )
    )
)
def test_checked_outputs_keeps_every_valid_pair_as_bytes(
    pairs: list[tuple[cq.TaskId, Any]],
) -> None:
    checked = folding.checked_outputs(pairs)
    assert checked == [(i, bytes(o)) for i, o in pairs]
    assert all(type(o) is bytes for _, o in checked)


@pytest.mark.parametrize(
    ("pair", "why"),
    [
        ((True, b""), "outputs: a task id must be an int, not bool"),
        ((2**63, b""), f"outputs: task id {2**63} is outside the 64-bit range"),
        ((1, "text"), "outputs: the output of task 1 must be bytes"),
        ((1,), "outputs must hold (task id, bytes) pairs"),
        ("ab", "outputs: a task id must be an int, not str"),
        (7, "outputs must hold (task id, bytes) pairs"),
    ],
    ids=["bool id", "id out of range", "str output", "one value", "a str", "an int"],
)
def test_checked_outputs_refuses_what_no_task_could_hold(pair: Any, why: str) -> None:
    """Refused before any write, the message saying what is wrong (docs/guarantees.md)."""
    with pytest.raises(InvalidValue) as refused:
        folding.checked_outputs([pair])
    assert str(refused.value) == why


def test_dependency_rows_name_each_target_by_id_or_by_key() -> None:
    """A live task's dependencies as the rows of cronoq_task_deps (its columns exactly), in
    order, a key cleaned as every stored string is."""
    deps = (
        cq.Dep(target=cq.ById(id=cq.TaskId(7))),
        cq.Dep(target=cq.ByKey(key="k\x00"), on="finish"),
    )
    assert folding.dep_rows(3, deps) == [
        {"task_id": 3, "ordinal": 0, "target_id": 7, "target_key": None},
        {"task_id": 3, "ordinal": 1, "target_id": None, "target_key": "k\ufffd"},
    ]


def test_the_fold_imports_no_sqlalchemy() -> None:
    """The fold, and every module of the package it imports (transitively), import no SQLAlchemy:
    it stays a pure function of its arguments. Imports under `if TYPE_CHECKING:` never run,
    so they are not followed."""
    package = Path(folding.__file__).resolve().parent.parent
    seen: set[Path] = set()
    todo = [Path(folding.__file__).resolve()]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {
            id(inner)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
            for inner in ast.walk(block)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.ImportFrom):
                here = path.parent
                for _ in range(node.level - 1):
                    here = here.parent
                targets = [node.module] if node.module else [a.name for a in node.names]
                for target in targets:
                    found = here.joinpath(*target.split("."))
                    for candidate in (found.with_suffix(".py"), found / "__init__.py"):
                        if candidate.is_file() and candidate != package / "__init__.py":
                            todo.append(candidate)
                continue
            else:
                continue
            assert not [n for n in names if n.split(".")[0] == "sqlalchemy"], path
    assert len(seen) > 1  # codec, model, errors were followed


def test_a_task_revived_in_a_later_batch_without_deps_holds_no_dependency_rows() -> None:
    """Found by hypothesis in CI: the model wrote an empty list, which no table can hold."""
    task = cq.TaskId(3)
    submitted = cq.Submitted(id=task, seq=0, arrival=0, spec=cq.TaskSpec(payload=b"p"))
    done = cq.StatusChanged(id=task, status=cq.TaskStatus.SUCCEEDED, attempt=0, at=0, message=None)
    again = cq.StatusChanged(id=task, status=cq.TaskStatus.QUEUED, attempt=0, at=1, message=None)
    stream = [submitted, done, again]
    assert committed([stream[:2], stream[2:]]) == committed([stream])
    assert committed([stream[:2], stream[2:]])[1] == {}


raw_texts = st.sampled_from(["default", "gpu", "ünï", "nul\x00", "\ud800", "x" * 300])


@given(
    spec=st.builds(
        cq.TaskSpec,
        payload=st.binary(max_size=4),
        deadline=st.none() | st.integers(0, 10**12),
        tags=st.frozensets(st.sampled_from(["a", "ü"])),
        labels=st.dictionaries(st.sampled_from(["k"]), st.sampled_from(["v", "w"])),
        deps=deps_of,
    ),
    texts=st.fixed_dictionaries(
        {"pool": raw_texts, "kind": raw_texts, "key": st.none() | raw_texts},
        optional={"tenant": st.none() | raw_texts},
    ),
    other=st.booleans(),
)
def test_a_spec_read_from_a_row_is_written_as_encoding_it_would_write_it(
    spec: cq.TaskSpec, texts: dict[str, str | None], other: bool
) -> None:
    """What the drain copies from an inbox row (its spec's columns, `StoredSpecs`) is what
    encoding the decoded spec writes, or refuses, whatever text a hand-written row holds; under
    another base the spec is encoded, its times shifted."""
    row = {**codec.spec_columns(BASE, spec), **texts}
    try:
        decoded = codec.spec_from_columns(BASE, row)
    except CorruptValue:
        return  # set aside by `read_inbox`, never drained
    stored = codec.StoredSpecs(BASE)
    stored.add(decoded, row)
    base = cq.TimeBase(BASE.unix_ns + 1) if other else BASE
    try:
        expected = codec.spec_columns(base, decoded)
    except InvalidValue:
        with pytest.raises(InvalidValue):
            stored.columns(base, decoded)
        return
    assert stored.columns(base, decoded) == expected
    assert stored.columns(base, dataclasses.replace(decoded)) == expected  # not the same spec
