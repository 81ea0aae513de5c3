"""cronoq-store: the durable state of the cronoq task scheduler, on SQLAlchemy Core.

The public API is what this module re-exports.
"""

# `AsyncSqlStore` is public too, but it is not in `__all__`: it loads on first use (`__getattr__`
# below), and `from cronoq_store import *` must not need the asyncio extra.
__all__ = [
    "BuildTooOld",
    "ById",
    "ByKey",
    "CorruptValue",
    "DatabaseBehind",
    "Dep",
    "Fenced",
    "FixedStart",
    "InboxItem",
    "InboxTaken",
    "InvalidValue",
    "LeaderRowMissing",
    "LostCommits",
    "Mutation",
    "NotDurable",
    "Priority",
    "Recovered",
    "RecoveredRecurring",
    "RecoveredTask",
    "RecoveredTerminal",
    "RecurringNext",
    "RecurringRemove",
    "RecurringSpec",
    "RecurringUpsert",
    "RetryPolicy",
    "SchemaError",
    "SqlStore",
    "StatusChanged",
    "StoreConfig",
    "StoreError",
    "StoreUnavailable",
    "Submitted",
    "TaskId",
    "TaskRecord",
    "TaskRef",
    "TaskSpec",
    "TaskStatus",
    "Time",
    "TimeBase",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_many_async",
]

from .builds import VERSION as __version__  # noqa: F401 (the release, as pyproject.toml says)
from .errors import BuildTooOld as BuildTooOld
from .errors import CorruptValue as CorruptValue
from .errors import DatabaseBehind as DatabaseBehind
from .errors import Fenced as Fenced
from .errors import InvalidValue as InvalidValue
from .errors import LeaderRowMissing as LeaderRowMissing
from .errors import NotDurable as NotDurable
from .errors import SchemaError as SchemaError
from .errors import StoreError as StoreError
from .errors import StoreUnavailable as StoreUnavailable
from .inbox import enqueue as enqueue
from .inbox import enqueue_async as enqueue_async
from .inbox import enqueue_many as enqueue_many
from .inbox import enqueue_many_async as enqueue_many_async
from .model import ById as ById
from .model import ByKey as ByKey
from .model import Dep as Dep
from .model import FixedStart as FixedStart
from .model import InboxItem as InboxItem
from .model import InboxTaken as InboxTaken
from .model import LostCommits as LostCommits
from .model import Mutation as Mutation
from .model import Priority as Priority
from .model import Recovered as Recovered
from .model import RecoveredRecurring as RecoveredRecurring
from .model import RecoveredTask as RecoveredTask
from .model import RecoveredTerminal as RecoveredTerminal
from .model import RecurringNext as RecurringNext
from .model import RecurringRemove as RecurringRemove
from .model import RecurringSpec as RecurringSpec
from .model import RecurringUpsert as RecurringUpsert
from .model import RetryPolicy as RetryPolicy
from .model import StatusChanged as StatusChanged
from .model import Submitted as Submitted
from .model import TaskId as TaskId
from .model import TaskRecord as TaskRecord
from .model import TaskRef as TaskRef
from .model import TaskSpec as TaskSpec
from .model import TaskStatus as TaskStatus
from .model import Time as Time
from .model import TimeBase as TimeBase
from .store import SqlStore as SqlStore
from .store import StoreConfig as StoreConfig

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .aio import AsyncSqlStore as AsyncSqlStore


def __getattr__(name: str) -> object:
    """`AsyncSqlStore` on first use, so sync users never import the asyncio extension."""
    if name == "AsyncSqlStore":
        from .aio import AsyncSqlStore

        return AsyncSqlStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
