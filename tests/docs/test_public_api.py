"""The public API is what `__all__` says, and the API reference documents exactly that.

Dialect-free and quick: these tests import modules and read files, nothing else. A new module
of the package must be named in `PUBLIC` (it gets an `__all__` and a reference page) or in
`INTERNAL` (no promise to users), so none is published or hidden by accident.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import cronoq_store

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"

# Each has an `__all__` and a page docs/reference/<name>.md rendering `::: cronoq_store.<name>`.
PUBLIC = (
    "model",
    "errors",
    "store",
    "aio",
    "migrate",
    "schema",
    "dialects",
    "testing",
    "demo",
    "inbox",
    "durability",
)
# The store's inside, and the commands whose interface is the CLI (docs/cli.md).
INTERNAL = (
    "codec",
    "config",  # `StoreConfig`, re-exported and documented by `store`
    "face",  # what `store` and `aio` share
    "repository",
    "lease",
    "leadership",
    "ddl",
    "verdict",  # records whose public homes are `durability` and `model`
    "builds",  # the rule of which build may write a schema (docs/deploying.md)
    "schemacheck",  # `cronoq-store check`: its interface is the CLI
    "galera",
    "execution",
    "wire",  # how `execution` sends a PostgreSQL flight
    "compat",
    "jsontext",
    "cli",
    "inspection",
    "telemetry",  # its instrument names are the contract (docs/observability.md), not its code
    "bench",
    "web",
    "examples",  # the engine loop docs/engine.md shows whole: code to copy, not an API
)
# A public package's modules: its parts, no promise to users on their own. The package's
# `__all__` names what of them is public, and its reference page documents it.
PARTS = {
    "dialects": (
        "base",
        "sqlite",
        "postgresql",
        "mysql",
        "compiled",
        "cursor",
        "sockets",
        "statements",
        "sessions",
        "locks",
        "urls",
        "translation",
        "pgarrays",
    ),
    "inbox": ("statements", "enqueuing", "draining", "listening"),
    "testing": (
        "base",
        "config",
        "acklog",
        "workload",
        "driver",
        "checker",
        "enqueuer",
        "statements",
        "process",
        "command",
        "__main__",
    ),
}
# What `cronoq_store` re-exports lives in these; the API reference documents each name there.
HOMES = ("store", "aio", "model", "errors", "inbox")
# Public at the top level but loaded on first use, so left out of `__all__` (see __init__.py).
LAZY = ("AsyncSqlStore",)


def public_module(name: str) -> ModuleType:
    return importlib.import_module(f"cronoq_store.{name}")


def test_every_module_is_public_or_internal() -> None:
    found = {info.name for info in pkgutil.iter_modules(cronoq_store.__path__)}
    assert found == set(PUBLIC) | set(INTERNAL), (
        "classify each module of cronoq_store as PUBLIC (with __all__ and a reference page) "
        "or INTERNAL in tests/docs/test_public_api.py"
    )


@pytest.mark.parametrize("package", PARTS)
def test_every_part_of_a_public_package_is_listed(package: str) -> None:
    assert package in PUBLIC
    found = {info.name for info in pkgutil.iter_modules(public_module(package).__path__)}
    assert found == set(PARTS[package]), (
        f"list each module of cronoq_store.{package} in PARTS in tests/docs/test_public_api.py"
    )
    for part in PARTS[package]:
        assert not (REFERENCE / f"{package}.{part}.md").exists()


@pytest.mark.parametrize("name", ["__init__", *PUBLIC])
def test_all_lists_existing_public_names(name: str) -> None:
    module = cronoq_store if name == "__init__" else public_module(name)
    exported = module.__dict__.get("__all__")
    assert isinstance(exported, list), f"{module.__name__} has no __all__ list"
    assert exported, f"{module.__name__}.__all__ is empty"
    assert len(exported) == len(set(exported)), f"{module.__name__}.__all__ repeats a name"
    for item in exported:
        assert isinstance(item, str)
        assert not item.startswith("_"), f"{module.__name__}.__all__ exports private {item!r}"
        assert hasattr(module, item), f"{module.__name__}.__all__ names missing {item!r}"
    namespace: dict[str, object] = {}
    exec(f"from {module.__name__} import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(exported)


def test_top_level_names_import() -> None:
    for item in [*cronoq_store.__all__, *LAZY]:
        namespace: dict[str, object] = {}
        exec(f"from cronoq_store import {item}", namespace)
        assert namespace[item] is getattr(cronoq_store, item)


def test_every_top_level_reexport_is_in_all() -> None:
    reexported = {
        name
        for name, value in vars(cronoq_store).items()
        if not name.startswith("_") and not isinstance(value, ModuleType)
    } - {"TYPE_CHECKING"}
    assert reexported - set(LAZY) == set(cronoq_store.__all__)
    assert not set(LAZY) & set(cronoq_store.__all__)


def test_star_import_needs_no_asyncio_extra() -> None:
    """`from cronoq_store import *` works, and loads no asyncio module, without greenlet."""
    code = (
        "import sys\n"
        "for name in ('greenlet', 'aiosqlite', 'asyncmy'):\n"
        "    sys.modules[name] = None\n"
        "from cronoq_store import *\n"
        "assert SqlStore and TaskSpec\n"
        "assert 'cronoq_store.aio' not in sys.modules\n"
        "assert 'sqlalchemy.ext.asyncio' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_top_level_names_are_documented_where_they_live() -> None:
    index = (REFERENCE / "index.md").read_text(encoding="utf-8")
    for item in [*cronoq_store.__all__, *LAZY]:
        homes = [home for home in HOMES if item in public_module(home).__all__]
        assert len(homes) == 1, f"{item} should be in the __all__ of one of {HOMES}: {homes}"
        assert getattr(public_module(homes[0]), item) is getattr(cronoq_store, item)
        assert f"[cronoq_store.{homes[0]}.{item}]" in index, (
            f"docs/reference/index.md does not link {item} to cronoq_store.{homes[0]}.{item}"
        )


@pytest.mark.parametrize("name", PUBLIC)
def test_public_module_has_a_reference_page(name: str) -> None:
    page = REFERENCE / f"{name}.md"
    assert page.is_file(), f"no reference page {page.relative_to(ROOT)}"
    assert re.search(rf"^::: cronoq_store\.{name}$", page.read_text(encoding="utf-8"), re.M)
    assert f"reference/{name}.md" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


def test_internal_modules_have_no_reference_page() -> None:
    for name in INTERNAL:
        assert not (REFERENCE / f"{name}.md").exists()
    documented = re.findall(
        r"^::: ([\w.]+)",
        "\n".join(p.read_text(encoding="utf-8") for p in REFERENCE.glob("*.md")),
        re.M,
    )
    assert set(documented) == {f"cronoq_store.{name}" for name in PUBLIC}
