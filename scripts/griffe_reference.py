"""Griffe extensions for the API reference (mkdocs.yml loads them; nothing here runs otherwise).

`filters: public` in mkdocs.yml keeps a module's members to its `__all__`, but inside a class
Griffe counts every special method as public, so each dataclass would list its
`__post_init__` (a validation hook no caller uses): `HideUndocumentedHooks` hides the special
methods that have no docstring (a documented one is still shown).

`RequireDocstrings` warns about every public name without a docstring, so `mkdocs build
--strict` fails instead of publishing a bare entry. `RequireSignatureDocs` warns about a public
function or method whose docstring does not document each parameter (`Args:`), what it
returns (`Returns:`, unless it returns None) and, where it touches the database, what it
raises (`Raises:`). `SharedFaceDocs` gives the async face's methods the sections of their sync
twins, so each contract is written once. `HideInternals` drops private base classes
(`_Face[...]`) and the source text of attributes set in `__init__` from the pages.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import griffe


class HideUndocumentedHooks(griffe.Extension):
    """Mark a class's undocumented `__dunder__` methods as not public."""

    def on_class(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        """Runs once the object tree is complete, so every member and docstring is known."""
        for name, member in list(cls.members.items()):
            if member.is_special and not member.is_alias and member.docstring is None:
                member.public = False
                if name != "__init__":
                    # A class that a package re-exports from one of its modules is rendered
                    # through an alias, whose members are fresh aliases that do not see
                    # `public`: so the hook itself goes (`__init__` stays, for its signature).
                    cls.del_member(name)


def _shown(module: griffe.Module) -> Iterator[griffe.Object]:
    """What the reference shows of a module with `__all__`: its exports, and their members."""
    for name in module.exports or ():
        member = module.members.get(name)
        if member is not None and member.is_alias and _inside(member, module):
            member = member.final_target  # from a module of this package: shown here
        if member is None or member.is_alias or member.is_module:
            continue  # a re-export is documented where it is defined
        yield member
        if member.is_class:
            for inner in member.members.values():
                if not inner.is_alias and inner.is_public and not inner.name.startswith("_"):
                    yield inner


def _inside(alias: griffe.Alias, package: griffe.Module) -> bool:
    """Whether `alias` names something defined in a part of `package` that has no `__all__` of
    its own (as `cronoq_store.testing` re-exports what its modules define): the reference
    shows it in `package`, not where it is defined."""
    if not alias.target_path.startswith(f"{package.path}."):
        return False
    home = alias.final_target.parent
    return home is not None and home.is_module and home.exports is None


def _modules(module: griffe.Module) -> Iterator[griffe.Module]:
    """`module` and every module under it (subpackages included)."""
    yield module
    for sub in module.modules.values():
        if not sub.is_alias:
            yield from _modules(sub)


REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference"


def _rendered() -> set[str]:
    """The modules the reference renders: each page's `::: module` lines."""
    found: set[str] = set()
    for page in REFERENCE.glob("*.md"):
        found.update(re.findall(r"^::: *(\S+)", page.read_text(encoding="utf-8"), re.MULTILINE))
    return found


FACES = {"aio.AsyncSqlStore": "store.SqlStore"}
"""Each async face of `cronoq_store` and the sync face whose contracts it shares."""

SECTION = re.compile(r"^(Args|Returns|Raises|Yields):[ \t]*$", re.MULTILINE)


class SharedFaceDocs(griffe.Extension):
    """Give an async face's method that documents no section (`Args:`, `Returns:`, `Raises:`)
    its sync twin's: the async docstring says what differs in one line (`as SqlStore.x`),
    and the contract, written once in `store.py`, is shown on both pages. Listed first in
    mkdocs.yml, so the checks below see the sections."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Runs once the package is loaded, before the checks' own `on_package`."""
        if pkg.path != "cronoq_store":
            return
        for async_path, sync_path in FACES.items():
            async_cls, sync_cls = pkg[async_path], pkg[sync_path]
            for name, member in async_cls.members.items():
                twin = sync_cls.members.get(name)
                if member.is_alias or not member.is_function or twin is None:
                    continue
                shared = shared_sections(member.docstring, twin.docstring)
                if shared is not None:
                    member.docstring = griffe.Docstring(
                        shared, lineno=member.docstring.lineno, parent=member
                    )


def shared_sections(own: griffe.Docstring | None, twin: griffe.Docstring | None) -> str | None:
    """`own`'s text followed by `twin`'s sections, when `own` has none and `twin` has some."""
    if own is None or twin is None or SECTION.search(own.value):
        return None
    found = SECTION.search(twin.value)
    return None if found is None else f"{own.value.rstrip()}\n\n{twin.value[found.start() :]}"


class RequireDocstrings(griffe.Extension):
    """Warn (so a strict build fails) about a public name that has no docstring."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Runs once the package is loaded: every module the reference renders is checked (an
        internal package such as `bench` may keep an `__all__` without joining the reference)."""
        rendered = _rendered()
        for module in _modules(pkg):
            if module.path not in rendered:
                continue
            for obj in _shown(module):
                if obj.docstring is None:
                    where = f"{obj.relative_filepath}:{obj.lineno}"
                    griffe.logger.warning(f"{where}: public {obj.path} has no docstring")


RAISES_REQUIRED = (
    "cronoq_store.store.SqlStore.",
    "cronoq_store.aio.AsyncSqlStore.",
    "cronoq_store.inbox.",
    "cronoq_store.migrate.upgrade",
    "cronoq_store.migrate.downgrade",
    "cronoq_store.migrate.current_revision",
)
"""Where a function touches the database: its docstring must also say what it raises (a
`Raises:` section, or "Raises nothing" with why)."""
NOT_YET_DOCUMENTED: frozenset[str] = frozenset()
"""Functions still documented in prose only (a debt). The list only shrinks: a name
documented in full must leave it (the check says so), and a new function is never added."""


def missing_signature_docs(func: griffe.Function, *, raises: bool) -> list[str]:
    """What `func`'s docstring leaves out: parameters not under `Args:`, a `Returns:` for a
    function that returns something, a `Raises:` when `raises`."""
    sections = func.docstring.parse("google") if func.docstring is not None else []
    kinds = {section.kind.value for section in sections}
    documented = {
        param.name
        for section in sections
        if section.kind.value == "parameters"
        for param in section.value
    }
    missing = []
    for param in func.parameters:
        if param.name not in ("self", "cls") and param.name not in documented:
            missing.append(f"parameter {param.name!r} (Args:)")
    returns = str(func.returns) if func.returns is not None else "None"
    if returns != "None" and "property" not in func.labels and "returns" not in kinds:
        missing.append("what it returns (Returns:)")
    said_none = func.docstring is not None and "Raises nothing" in func.docstring.value
    if raises and "property" not in func.labels and "raises" not in kinds and not said_none:
        missing.append("what it raises (Raises:)")
    return missing


class RequireSignatureDocs(griffe.Extension):
    """Warn (so a strict build fails) about a public function or method that does not
    document its parameters, its return value and (on the database) what it raises."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Runs once the package is loaded, over what the reference renders."""
        rendered = _rendered()
        for module in _modules(pkg):
            if module.path not in rendered:
                continue
            for obj in _shown(module):
                if not obj.is_function or obj.name.startswith("__"):
                    continue
                assert isinstance(obj, griffe.Function)
                raises = obj.path.startswith(RAISES_REQUIRED)
                missing = missing_signature_docs(obj, raises=raises)
                where = f"{obj.relative_filepath}:{obj.lineno}"
                if obj.path in NOT_YET_DOCUMENTED:
                    if not missing:
                        griffe.logger.warning(
                            f"{where}: {obj.path} is documented in full now: take it off "
                            "NOT_YET_DOCUMENTED in scripts/griffe_reference.py"
                        )
                    continue
                for what in missing:
                    griffe.logger.warning(f"{where}: public {obj.path} does not document {what}")


class HideInternals(griffe.Extension):
    """Keep the store's inside off the pages: private base classes (`Bases: _Face[...]`), and
    the source text of attributes assigned in `__init__` (`config = config or StoreConfig()`),
    whose docstrings say what they are."""

    def on_class(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        """Runs once the class is loaded (its bases may not be yet: see `on_package`)."""
        for member in cls.members.values():
            if (
                not member.is_alias
                and member.is_attribute
                and "instance-attribute" in member.labels
            ):
                member.value = None

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Runs once every module is loaded, so private bases resolve: what a class inherits
        from one (`SqlStore`'s `is_leader`, `epoch`... from `_Face`) becomes the class's own
        member on its page, and only then is the base dropped (Griffe finds inherited members
        through the bases, so dropping it first hid them)."""
        for module in _modules(pkg):
            for cls in _classes(module):
                private = [b for b in cls.bases if _private(b)]
                if not private:
                    continue
                for name, member in cls.inherited_members.items():
                    if name not in cls.members:
                        cls.set_member(name, member)
                cls.bases = [b for b in cls.bases if not _private(b)]


def _private(base: object) -> bool:
    """Whether a base class expression names a private class (`_Face[Engine, ...]`)."""
    return str(base).split("[")[0].split(".")[-1].startswith("_")


def _classes(module: griffe.Module) -> Iterator[griffe.Class]:
    """The classes `module` defines (not those it imports), nested ones included."""
    todo = [m for m in module.members.values() if not m.is_alias and m.is_class]
    while todo:
        cls = todo.pop()
        yield cls
        todo += [m for m in cls.members.values() if not m.is_alias and m.is_class]
