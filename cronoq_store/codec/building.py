"""Model objects built from values the codec has already checked, without `__init__`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any, Final, TypeVar

from ..model import InboxItem

_T = TypeVar("_T")


def builder(cls: type[_T]) -> Callable[..., _T]:
    """A keyword-only function building `cls` (a slotted dataclass) from every field's value,
    with no `__init__` or `__post_init__`: for values the codec has already checked.

    Validating each of 100,000 recovered tasks a second time costs a large share of recovery,
    and so does `object.__setattr__` by name, field by field. The function is generated, as
    dataclasses generates `__init__`, and calls each slot's own setter.
    """
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    setters = {f"_set_{name}": slot_setter(cls, name) for name in names}
    body = "".join(f"    _set_{name}(obj, {name})\n" for name in names)
    source = f"def build(*, {', '.join(names)}):\n    obj = _new(_cls)\n{body}    return obj\n"
    namespace: dict[str, Any] = {"_new": object.__new__, "_cls": cls, **setters}
    exec(source, namespace)
    build: Callable[..., _T] = namespace["build"]
    return build


def slot_setter(cls: type, name: str) -> Callable[[Any, Any], None]:
    """The setter of slot `name` of `cls` (a frozen dataclass's own setattr refuses)."""
    setter: Callable[[Any, Any], None] = getattr(cls, name).__set__
    return setter


inbox_item: Final = builder(InboxItem)
"""`InboxItem(...)` without dataclass's frozen `__init__` (a drain makes one per item; the
class has no checks to skip)."""
