"""The migrations: pytest-alembic's suite, the CLI, concurrent upgrades, unknown revisions and
the packaged wheel, on every dialect the fixtures provide."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest
from builders import captured
from pytest_alembic.config import Config as PytestAlembicConfig
from pytest_alembic.tests import (
    test_model_definitions_match_ddl,
    test_single_head_revision,
    test_up_down_consistency,
    test_upgrade,
)
from sqlalchemy import URL, Connection, Engine, func, inspect, select, text

import cronoq_store
from cronoq_store import migrate
from cronoq_store.schema import TABLES, leader

__all__ = [
    "test_model_definitions_match_ddl",
    "test_single_head_revision",
    "test_up_down_consistency",
    "test_upgrade",
]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TABLE_NAMES = {t.name for t in TABLES}


@pytest.fixture
def alembic_config() -> PytestAlembicConfig:
    return PytestAlembicConfig.from_raw_config(migrate.alembic_config())


@pytest.fixture
def alembic_engine(engine: Engine) -> Iterator[Connection]:
    # env.py takes a Connection from config.attributes["connection"], not an Engine.
    with engine.connect() as conn:
        yield conn


def _url(db_url: URL) -> str:
    return db_url.render_as_string(hide_password=False)


def _tables(engine: Engine) -> set[str]:
    return set(inspect(engine).get_table_names())


def _version_rows(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT version_num FROM cronoq_alembic_version")).scalars())


def _alembic_cli(db_url: URL) -> subprocess.CompletedProcess[str]:
    return captured(
        [str(BIN / "alembic"), "-c", "alembic.ini", "-x", f"url={_url(db_url)}", "upgrade", "head"],
        cwd=REPO,
        timeout=120,
    )


def test_cli_upgrade_head_twice(db_url: URL, engine: Engine) -> None:
    first = _alembic_cli(db_url)
    assert first.returncode == 0, first.stderr
    second = _alembic_cli(db_url)
    assert second.returncode == 0, second.stderr
    assert migrate.current_revision(engine) == migrate.head_revision()
    assert _tables(engine) >= TABLE_NAMES
    assert _version_rows(engine) == [migrate.head_revision()]


UPGRADE_SCRIPT = """
import sys
from sqlalchemy import create_engine
from cronoq_store import migrate
engine = create_engine(sys.argv[1])
try:
    migrate.upgrade(engine)
finally:
    engine.dispose()
"""


def test_concurrent_upgrades_all_succeed(db_url: URL, engine: Engine) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", UPGRADE_SCRIPT, _url(db_url)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    results = []
    for proc in procs:
        _out, err = proc.communicate(timeout=180)
        results.append((proc.returncode, err))
    assert [code for code, _ in results] == [0] * 8, [err for _, err in results]
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(leader)).scalar_one() == 1
    assert migrate.current_revision(engine) == migrate.head_revision()
    assert _version_rows(engine) == [migrate.head_revision()]


def test_unknown_newer_revision_is_refused(engine: Engine) -> None:
    migrate.upgrade(engine)
    with engine.begin() as conn:
        conn.execute(text("UPDATE cronoq_alembic_version SET version_num = '9999_future'"))
    before = _tables(engine)

    with pytest.raises(cronoq_store.SchemaError, match="9999_future"):
        migrate.upgrade(engine)

    assert _version_rows(engine) == ["9999_future"]
    assert _tables(engine) == before
    assert before >= TABLE_NAMES
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(leader)).scalar_one() == 1


@pytest.mark.sqlite
def test_installed_wheel_migrates_without_source_tree(tmp_path: Path, dist: Path) -> None:
    (wheel,) = dist.glob("cronoq_store-*.whl")

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / ("Scripts" if os.name == "nt" else "bin") / "python"
    install = captured(
        [str(python), "-m", "pip", "install", "--quiet", str(wheel)],
        timeout=240,
    )
    assert install.returncode == 0, install.stderr

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = (
        "from sqlalchemy import create_engine; from cronoq_store import migrate; "
        "import cronoq_store; assert 'site-packages' in cronoq_store.__file__; "
        "e = create_engine('sqlite:///x.db'); migrate.upgrade(e); "
        "print(migrate.current_revision(e))"
    )
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    run = captured(
        [str(python), "-c", code],
        cwd=elsewhere,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == migrate.head_revision()  # every migration shipped
