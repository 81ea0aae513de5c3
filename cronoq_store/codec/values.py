"""Scalar values as columns: texts cleaned and bounded, engine times as Unix nanoseconds.

Strings are cleaned (NUL and lone surrogates become U+FFFD) because no dialect stores both
faithfully; a text longer than its column holds is refused (`InvalidValue`, naming the field),
never truncated. Times are Unix nanoseconds as BIGINT, saturated to the 64-bit range on the way
back. `expect` is the one check of a decoded value's type (`CorruptValue` when it is off).
"""

from __future__ import annotations

import re
from typing import Any, Final

from ..errors import CorruptValue, InvalidValue
from ..model import INT64_MAX, INT64_MIN, Time, TimeBase

KEY_MAX: Final = 512
"""Longest key, in characters (MySQL indexes at most 3072 bytes: 768 utf8mb4 characters)."""
POOL_MAX: Final = 128
KIND_MAX: Final = 255
TENANT_MAX: Final = 255
NAME_MAX: Final = 255
"""Longest recurring schedule name."""
HOLDER_MAX: Final = 128
STATUS_MAX: Final = 16

_UNCLEAN = re.compile("[\x00\ud800-\udfff]")


def clean(text: str) -> str:
    """`text` with NUL and lone surrogates replaced by U+FFFD."""
    if text.isascii() and "\x00" not in text:
        return text
    return _UNCLEAN.sub("\ufffd", text)


def clean_opt(text: str | None) -> str | None:
    return None if text is None else clean(text)


def bounded(field: str, text: str, limit: int) -> str:
    """`text` cleaned, refused if longer than `limit` characters (never truncated)."""
    text = clean(text)
    if len(text) > limit:
        raise InvalidValue(f"{field} is {len(text)} characters long; at most {limit} are stored")
    return text


def bounded_opt(field: str, text: str | None, limit: int) -> str | None:
    return None if text is None else bounded(field, text, limit)


def bounded_texts(
    where: str, pool: str, kind: str, key: str | None, tenant: str | None
) -> tuple[str, str, str | None, str | None]:
    """A spec's pool, kind, key and tenant, each `bounded` by its limit; `where` starts each
    field's name in messages ("TaskSpec.", "template ")."""
    return (
        bounded(f"{where}pool", pool, POOL_MAX),
        bounded(f"{where}kind", kind, KIND_MAX),
        bounded_opt(f"{where}key", key, KEY_MAX),
        bounded_opt(f"{where}tenant", tenant, TENANT_MAX),
    )


def to_unix(base: TimeBase, t: Time, field: str = "time") -> int:
    """Unix nanoseconds of engine time `t`, refused when outside BIGINT."""
    unix = base.unix_ns + t
    if not INT64_MIN <= unix <= INT64_MAX:
        raise InvalidValue(f"{field} {t} is out of range with time base {base.unix_ns}")
    return unix


def to_unix_opt(base: TimeBase, t: Time | None, field: str = "time") -> int | None:
    return None if t is None else to_unix(base, t, field)


def saturate(value: int) -> int:
    """`value` clamped to the signed 64-bit range: an overflow stays at the bound, never wraps."""
    return INT64_MIN if value < INT64_MIN else INT64_MAX if value > INT64_MAX else value


def from_unix(base: TimeBase, unix_ns: int) -> Time:
    """Engine time of stored Unix nanoseconds, saturated to the 64-bit range.

    A time valid when committed stays valid under any later base: converting is arithmetic,
    never a reason to quarantine a row.
    """
    t = unix_ns - base.unix_ns
    return t if INT64_MIN <= t <= INT64_MAX else saturate(t)


def expect(column: str, value: object, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise CorruptValue(f"{column}: unexpected {type(value).__name__} in stored value")
    return value
