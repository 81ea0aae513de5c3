"""A Griffe extension for the API reference: undocumented special methods are not shown.

`filters: public` in mkdocs.yml keeps a module's members to its `__all__`, but inside a class
Griffe counts every special method as public, so each dataclass would list its
`__post_init__` (a validation hook no caller uses). A special method with a docstring, such as
a context manager's `__enter__` that says what it returns, is still shown.
"""

from __future__ import annotations

from typing import Any

import griffe


class HideUndocumentedHooks(griffe.Extension):
    """Mark a class's undocumented `__dunder__` methods as not public."""

    def on_class(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        """Runs once the object tree is complete, so every member and docstring is known."""
        for member in cls.members.values():
            if member.is_special and not member.is_alias and member.docstring is None:
                member.public = False
