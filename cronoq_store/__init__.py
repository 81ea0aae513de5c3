"""cronoq-store: the durable state of the cronoq task scheduler, on SQLAlchemy Core.

The public API is what this module re-exports.
"""

from . import errors, model
from .builds import VERSION as __version__  # noqa: F401 (the release, as pyproject.toml says)
from .errors import *  # noqa: F403 (every error is public here too)
from .inbox import enqueue as enqueue
from .inbox import enqueue_async as enqueue_async
from .inbox import enqueue_many as enqueue_many
from .inbox import enqueue_many_async as enqueue_many_async
from .model import *  # noqa: F403 (the whole model is public here too)
from .store import SqlStore as SqlStore
from .store import StoreConfig as StoreConfig

# `AsyncSqlStore` is public too, but it is not in `__all__`: it loads on first use (`__getattr__`
# below), and `from cronoq_store import *` must not need the asyncio extra. The errors and the
# model are re-exported whole: their own `__all__` says what they hold.
__all__ = [
    "SqlStore",
    "StoreConfig",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_many_async",
]
__all__ += errors.__all__
__all__ += model.__all__

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .aio import AsyncSqlStore as AsyncSqlStore


def __getattr__(name: str) -> object:
    """`AsyncSqlStore` on first use, so sync users never import the asyncio extension."""
    if name == "AsyncSqlStore":
        from .aio import AsyncSqlStore

        return AsyncSqlStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
