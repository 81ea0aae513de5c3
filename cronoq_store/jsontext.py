"""Compact JSON text with sorted keys, the form every JSON column is stored in.

`dumps_plain` uses orjson when it is installed (the `fast` extra) and the standard library
otherwise; both write the same bytes for what it is given (proven by a property test), so a
store may switch between them freely. orjson writes some floats differently (`1e-7` against
`1e-07`), so values that may hold floats (retry policies, recurring schedules) go through
`dumps` (always the standard library), and `dumps_plain` is for values of str, int, bool,
None, lists and str-keyed dicts only. Whatever orjson refuses (a lone surrogate, an int
beyond 64 bits) is written by the standard library.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final

__all__ = ["BACKEND", "dumps", "dumps_plain", "fast_loads"]

dumps: Final[Callable[[Any], str]] = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), sort_keys=True
).encode
"""JSON text of any JSON-able value, by the standard library."""


def _orjson_dumps() -> Callable[[Any], str] | None:
    try:
        import orjson
    except ImportError:
        return None
    encode = orjson.dumps
    option = orjson.OPT_SORT_KEYS
    refused = orjson.JSONEncodeError

    def dumps_plain(obj: Any) -> str:
        """JSON text of a value holding no floats (orjson, the standard library's bytes)."""
        try:
            return encode(obj, option=option).decode()
        except refused:
            return dumps(obj)

    return dumps_plain


_fast = _orjson_dumps()
BACKEND: Final = "json" if _fast is None else "orjson"
"""Which library `dumps_plain` uses."""
dumps_plain: Final[Callable[[Any], str]] = dumps if _fast is None else _fast
"""JSON text of a float-free value, sorted keys: the same text whichever library writes it."""


def _orjson_loads() -> Callable[[str], Any] | None:
    try:
        import orjson
    except ImportError:
        return None
    return orjson.loads


fast_loads: Final[Callable[[str], Any] | None] = _orjson_loads()
"""orjson's decoder where installed (it raises a `ValueError` for what it refuses), else None."""
