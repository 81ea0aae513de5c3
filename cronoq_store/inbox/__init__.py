"""The inbox: apps enqueue task specs in their own transactions; the leader drains them.

An app calls `enqueue(conn, spec)` on its own `Connection` or ORM `Session`, inside its own
transaction: the row commits with the app's writes or not at all, and nothing here commits;
or on its `Engine`, when it has no transaction to join: then the enqueue is its own, committed
(on PostgreSQL one autocommit statement).
The leader reads the oldest rows (`SqlStore.read_inbox`), turns each into a task, and commits
`InboxTaken` for it in the same fenced batch as its `Submitted`, so an item becomes at most one
task and a fenced leader consumes nothing (see docs/guarantees.md).

Times in an enqueued spec (deadline, fixed start) are Unix nanoseconds, i.e. engine times under
`TimeBase(0)`: an app knows no engine's time base. The leader reads them under its own base.

The rooms, one job each: `statements` (every statement, built once), `enqueuing` (the app's
side), `draining` (the leader's reads and the rows set aside), `listening` (waiting for an
enqueue: LISTEN on PostgreSQL, a poll elsewhere). Their names are all reachable from here.
"""

from __future__ import annotations

__all__ = ["EnqueueOptions", "enqueue", "enqueue_async", "enqueue_many", "enqueue_many_async"]

from .draining import Read as Read
from .draining import check_after as check_after
from .draining import check_limit as check_limit
from .draining import depth as depth
from .draining import has_items as has_items
from .draining import read as read
from .draining import set_aside as set_aside
from .enqueuing import MAX_PAYLOAD_SETTING as MAX_PAYLOAD_SETTING
from .enqueuing import EnqueueOptions as EnqueueOptions
from .enqueuing import arrays as arrays
from .enqueuing import enqueue as enqueue
from .enqueuing import enqueue_async as enqueue_async
from .enqueuing import enqueue_many as enqueue_many
from .enqueuing import enqueue_many_async as enqueue_many_async
from .listening import SLOW_CHECK_S as SLOW_CHECK_S
from .listening import UNHEARD_DRAIN_S as UNHEARD_DRAIN_S
from .listening import UNHEARD_WARNING as UNHEARD_WARNING
from .listening import AsyncListener as AsyncListener
from .listening import Listener as Listener
from .listening import can_listen as can_listen
from .listening import run_calls as run_calls
from .listening import run_calls_async as run_calls_async
from .listening import wait as wait
from .listening import waiting as waiting
from .statements import CHANNEL as CHANNEL
from .statements import EMPTY as EMPTY
from .statements import UNIX as UNIX
from .statements import array_param as array_param
from .statements import depth_stmt as depth_stmt
from .statements import first_id_stmt as first_id_stmt
from .statements import inbox_in as inbox_in
from .statements import insert_into_stmt as insert_into_stmt
from .statements import insert_many_stmt as insert_many_stmt
from .statements import insert_notify_stmt as insert_notify_stmt
from .statements import insert_one_stmt as insert_one_stmt
from .statements import insert_stmt as insert_stmt
from .statements import last_rowid_stmt as last_rowid_stmt
from .statements import notify_call as notify_call
from .statements import notify_stmt as notify_stmt
from .statements import oldest_stmt as oldest_stmt
from .statements import reject_delete_stmt as reject_delete_stmt
from .statements import reject_insert_stmt as reject_insert_stmt
from .statements import rejects_count_stmt as rejects_count_stmt
from .statements import rejects_stmt as rejects_stmt
from .statements import sized as sized
