"""`python -m cronoq_store.testing drive`, but the driver leaves the inbox alone.

The failover rounds on a PostgreSQL pair (tests/test_replica_failover.py) drive their leader
through the primary's crash with this: the kit's driver reads the inbox before every commit,
and a `StoreUnavailable` from that read still ends the process (the kit's fix is under way
elsewhere). The rounds drain the inbox with the kit's own driver once the new primary stands.
Everything else (events, signals, the acknowledgement log) is the kit's own.
"""

from __future__ import annotations

import functools
import sys

from cronoq_store.testing import command
from cronoq_store.testing.config import DriverConfig

command.DriverConfig = functools.partial(DriverConfig, inbox=False)  # type: ignore[misc]

if __name__ == "__main__":
    sys.exit(command.main())
