"""Which builds may write which schema: the rule of two builds side by side.

Every revision module declares, at its top, `OLDEST_WRITER` (the oldest release of
cronoq-store whose code still writes rows this revision's schema and every newer build read
right) and `CLASS` (`ONLINE`: it runs while the old build serves; `STOPS_OLD_BUILD`: the old
build must be stopped first). Since revision 0006 the database records the floor in
`cronoq_writers.oldest_writer`, as one number (`encode`): each migration raises it to its own
`OLDEST_WRITER` (`raise_oldest_writer`), never lowers it.

Enforced at no extra cost on the hot path: the lease's take, renewal and fence statements match
only while `oldest_writer <= this build` (a scalar subquery of theirs, this build a constant in
their text), so a build a migration
outdated is fenced off at its next commit or renewal, and the diagnosis, which reads the row
anyway, names both versions (`refusal`). A build starts (`SqlStore.open`) only on its own head
revision; on a newer one its refusal names the floor too.

This build is its release (`VERSION`) and its packaged revisions (`script_location`,
`head_revision`, `revision_module`): read here, run by `migrate`, which imports from here and
never the other way.
"""

from __future__ import annotations

__all__ = [
    "BUILD",
    "CLASSES",
    "ONLINE",
    "STOPS_OLD_BUILD",
    "VERSION",
    "decode",
    "encode",
    "head_floor",
    "head_revision",
    "migration_class",
    "oldest_writer",
    "raise_oldest_writer",
    "refusal",
    "revision_module",
    "script_location",
]

import re
from functools import cache
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from alembic.script import ScriptDirectory

VERSION: Final = "0.2.0"
"""This build's release, `cronoq_store.__version__`: the version in pyproject.toml (a test keeps
them equal), kept here so a source tree on PYTHONPATH knows its own release."""

ONLINE: Final = "online"
"""A migration that runs while the previous release keeps serving."""
STOPS_OLD_BUILD: Final = "needs the old build stopped"
"""A migration that the previous release must not serve through: stop it first."""
CLASSES: Final = (ONLINE, STOPS_OLD_BUILD)

_PART: Final = 1000
_VERSION_RE: Final = re.compile(r"^(\d+)\.(\d+)\.(\d+)")


def encode(version: str) -> int:
    """A release as one number that orders as releases do: major, minor and patch (each
    below 1000) in thousands, so SQL compares it with `<=`. "0.2.0" is 2000.

    Raises:
        ValueError: Not a MAJOR.MINOR.PATCH version with parts below 1000.
    """
    match = _VERSION_RE.match(version)
    if match is None or any(int(p) >= _PART for p in match.groups()):
        raise ValueError(f"not a MAJOR.MINOR.PATCH version with parts below 1000: {version!r}")
    major, minor, patch = (int(p) for p in match.groups())
    return (major * _PART + minor) * _PART + patch


def decode(number: int) -> str:
    """`encode`'s release again: 2000 is "0.2.0"."""
    return f"{number // _PART // _PART}.{number // _PART % _PART}.{number % _PART}"


BUILD: Final = encode(VERSION)
"""This build, encoded: what the lease statements compare `oldest_writer` with."""


def script_location() -> Path:
    """The migrations folder: inside the installed package, or the source tree's.

    Returns:
        The folder holding `env.py` and `versions/`.
    """
    packaged = Path(str(resources.files("cronoq_store"))) / "migrations"
    if (packaged / "env.py").is_file():
        return packaged
    return Path(__file__).resolve().parent.parent / "migrations"


def _scripts() -> ScriptDirectory:
    """This build's revisions, read only (`migrate.alembic_config` runs them)."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory(script_location())


@cache
def head_revision() -> str:
    """The newest revision this build knows (read once: Alembic loads every revision file to
    say, 20-60 ms of an open's CPU each time, and the packaged files do not change).

    Returns:
        Its id, such as "0004_commit_seq".
    """
    head = _scripts().get_current_head()
    assert head is not None, "the packaged migrations have no head"
    return head


def revision_module(revision: str) -> ModuleType:
    """The module of `revision` in this build's migrations."""
    script = _scripts().get_revision(revision)
    if script is None:
        raise ValueError(f"no revision {revision!r} in this build")
    return script.module


def oldest_writer(revision: str) -> str:
    """The oldest release that may write the schema at `revision` (its `OLDEST_WRITER`)."""
    value = getattr(revision_module(revision), "OLDEST_WRITER", None)
    if not isinstance(value, str):
        raise ValueError(f"revision {revision!r} declares no OLDEST_WRITER")
    encode(value)
    return value


def migration_class(revision: str) -> str:
    """`ONLINE` or `STOPS_OLD_BUILD`: whether `revision` runs while the old build serves."""
    value = getattr(revision_module(revision), "CLASS", None)
    if value not in CLASSES:
        raise ValueError(f"revision {revision!r} declares no CLASS of {CLASSES}")
    return str(value)


def head_floor() -> int:
    """This build's head revision's `OLDEST_WRITER`, encoded: what a restored lease row
    records."""
    return encode(oldest_writer(head_revision()))


def refusal(floor: int, *, revision: str | None = None) -> str:
    """Why this build may not write a database whose `oldest_writer` is `floor`."""
    at = f" at schema revision {revision!r}" if revision else ""
    return (
        f"this build of cronoq-store ({VERSION}) is older than the oldest build that may write "
        f"this database{at} ({decode(floor)}): run cronoq-store {decode(floor)} or newer "
        "(`cronoq-store history` lists the revisions and their builds)"
    )


def raise_oldest_writer(version: str) -> None:
    """From a revision's `upgrade()`, after its schema changes: raise the database's floor to
    `version` (its `OLDEST_WRITER`), never lower it. Safe to run again after a kill."""
    import sqlalchemy as sa
    from alembic import op

    from . import ddl

    floor = encode(version)
    row = sa.table("cronoq_writers", sa.column("oldest_writer"), schema=ddl.schema())
    op.execute(
        row.update()
        .where(row.c.oldest_writer < sa.literal_column(str(floor)))
        .values(oldest_writer=sa.literal_column(str(floor)))
    )
